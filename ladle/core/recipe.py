"""Recipes: typed dataclasses, YAML loading, ``key=value`` overrides and validation with clear errors.

A recipe is data (torchtune style): every key is a dataclass field, nested sections are dataclasses
(``view.parts=32``), and a bad key or value is rejected with the key's dotted name.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from ladle.core.errors import LadleError
from ladle.core.recipe_files import RecipeLoader, read_recipe_file

MODEL_KINDS = ("gcn", "sage", "gat", "gin", "appnp", "custom")  # custom: the class given with --model-class
NORM_KINDS = ("none", "batch", "layer")
FEATURE_MODES = ("auto", "raw", "normalize")
SOUP_SEARCHES = ("grid", "fast")
SOUP_METRICS = ("acc", "loss", "acc+loss")
TRUNK_KEEPS = ("best", "last")
BRANCH_KEEPS = ("best", "last", "swa")
LR_SCHEDULES = ("constant", "cos")


@dataclass(frozen=True)
class SoupConfig:
    """How ``ladle.soup`` merges the ingredients (recipe section ``soup``). ``method`` names a registered soup
    method (:data:`ladle.soup.methods.SOUPS`, or ``all``); the stages that read it check it there."""

    method: str = "all"
    grid: int = 21
    search: str = "grid"
    metric: str = "acc"  # Wortsman et al.'s rule: accuracy alone, ties accepted
    recompute_bn: bool = True

    def __post_init__(self) -> None:
        _check_choice("soup.search", self.search, SOUP_SEARCHES)
        _check_choice("soup.metric", self.metric, SOUP_METRICS)
        if self.grid < 2:
            raise ValueError(f"soup.grid must be >= 2, got {self.grid}")


@dataclass(frozen=True)
class TrunkConfig:
    """One shared trunk, trained once before the ingredients, which all start from its weights
    (recipe section ``trunk``; ``epochs: 0`` turns it off and ingredients start from the shared init).

    ``view``: the view kind it trains on, one a bounded worker can hold; empty means ``cluster`` for
    partition recipes and the recipe's own view otherwise. ``schedule``: its learning rate ``constant`` or
    ``cos`` (decayed to 0 over ``epochs``, so the weights it keeps settle rather than swing with each sampled
    batch). ``keep``: its ``best``-validation or ``last`` weights.
    """

    epochs: int = 10
    view: str = ""
    lr: float = 0.01
    schedule: str = "constant"
    keep: str = "last"

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise ValueError(f"trunk.epochs must be >= 0 (0 = no trunk), got {self.epochs}")
        if self.view and (self.view not in VIEW_KINDS or self.view in PARTITION_KINDS):
            kinds = [kind for kind in VIEW_KINDS if kind not in PARTITION_KINDS]
            raise ValueError(f"trunk.view must be empty (derived) or one of {', '.join(kinds)}; got {self.view!r} "
                             "(a trunk sees the whole graph through a bounded view, not one part)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"trunk.lr must be finite and > 0, got {self.lr}")
        _check_choice("trunk.schedule", self.schedule, LR_SCHEDULES)
        _check_choice("trunk.keep", self.keep, TRUNK_KEEPS)


@dataclass(frozen=True)
class BranchConfig:
    """How each ingredient trains from its start (the trunk, or the shared init): recipe section ``branch``.

    ``lr``: null means the recipe's ``lr``; ``schedule``: ``constant`` or ``cos`` (cosine decay to 0 over
    ``epochs``); ``warmup``: epochs over which the learning rate rises linearly into that schedule (a fresh
    Adam's first steps move every weight by the full ``lr``); ``keep``: ``best`` validation (early stopping
    after ``patience``), ``last``, or ``swa`` (the mean of the weights after each epoch of the second half).
    Ingredients may differ in more than their seed, as model soups' fine-tunes do: ingredient k trains with
    ``dropout[k % n]``, ``weight_decay[k % n]``, the learning rate times ``lr_scale[k % n]`` and DropEdge at
    ``drop_edge[k % n]`` (each training batch loses that share of its edges, drawn afresh; Rong et al. 2020);
    each empty: the recipe's value, and no DropEdge, for every ingredient. ``distill``: the weight of a term that
    keeps a model started from the trunk near the trunk's predictions on every node of its batch, labelled or not
    (the KL divergence from the trunk's softmax; 0: none): a part's few labels then do not pull its branch away from
    what the trunk learned of the whole graph.
    """

    lr: float | None = None
    schedule: str = "constant"
    warmup: int = 0
    keep: str = "best"
    dropout: tuple[float, ...] = ()
    weight_decay: tuple[float, ...] = ()
    lr_scale: tuple[float, ...] = ()
    drop_edge: tuple[float, ...] = ()
    distill: float = 0.0

    def __post_init__(self) -> None:
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"branch.lr must be finite and > 0 (or null: the recipe's lr), got {self.lr}")
        object.__setattr__(self, "dropout", tuple(self.dropout))
        object.__setattr__(self, "weight_decay", tuple(self.weight_decay))
        object.__setattr__(self, "lr_scale", tuple(self.lr_scale))
        object.__setattr__(self, "drop_edge", tuple(self.drop_edge))
        if any(not 0.0 <= d < 1.0 for d in self.dropout):
            raise ValueError(f"branch.dropout values must be in [0, 1), got {list(self.dropout)}")
        if any(not (math.isfinite(w) and w >= 0) for w in self.weight_decay):
            raise ValueError(f"branch.weight_decay values must be finite and >= 0, got {list(self.weight_decay)}")
        if any(not (math.isfinite(s) and s > 0) for s in self.lr_scale):
            raise ValueError(f"branch.lr_scale values must be finite and > 0, got {list(self.lr_scale)}")
        if any(not 0.0 <= p < 1.0 for p in self.drop_edge):
            raise ValueError(f"branch.drop_edge values must be in [0, 1), got {list(self.drop_edge)}")
        _check_choice("branch.schedule", self.schedule, LR_SCHEDULES)
        if not (math.isfinite(self.distill) and self.distill >= 0):
            raise ValueError(f"branch.distill must be finite and >= 0, got {self.distill}")
        if self.warmup < 0:
            raise ValueError(f"branch.warmup must be >= 0 epochs, got {self.warmup}")
        _check_choice("branch.keep", self.keep, BRANCH_KEEPS)


@dataclass(frozen=True)
class IngredientSettings:
    """What may differ between ingredients of one architecture (:meth:`Recipe.ingredient_settings`)."""

    dropout: float
    weight_decay: float
    lr: float
    drop_edge: float = 0.0


@dataclass(frozen=True)
class Recipe:
    """Everything one run needs: dataset, model, how ingredients see the graph, training, soup.

    The defaults are the embedded default recipe (``recipes/default.yaml`` says the same).
    """

    name: str = "default"
    dataset: str = "cora"
    split: int = 0
    features: str = "auto"
    model: str = "gcn"
    hidden: int = 64
    layers: int = 2
    dropout: float = 0.5
    norm: str = "none"
    heads: int = 8
    view: ViewConfig = field(default_factory=lambda: ViewConfig(kind="saint-rw", subgraph_share=0.5,
                                                                 subgraph_max_nodes=16000))
    epochs: int = 200
    lr: float = 0.01
    weight_decay: float = 5e-4
    patience: int = 100
    seed: int = 0
    soup: SoupConfig = field(default_factory=SoupConfig)
    trunk: TrunkConfig = field(default_factory=TrunkConfig)
    branch: BranchConfig = field(default_factory=BranchConfig)

    def __post_init__(self) -> None:
        if not _is_file_name(self.name):
            raise ValueError(f"name must be a plain file name (not empty, no '/' or '\\', not starting with '.', "
                             f"at most {_MAX_NAME} characters), got {self.name!r}")
        _check_choice("model", self.model, MODEL_KINDS)
        _check_choice("norm", self.norm, NORM_KINDS)
        _check_choice("features", self.features, FEATURE_MODES)
        for key, most in _BOUNDS.items():
            if not 1 <= getattr(self, key) <= most:
                raise ValueError(f"{key} must be between 1 and {most}, got {getattr(self, key)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (math.isfinite(self.lr) and self.lr > 0 and math.isfinite(self.weight_decay)
                and self.weight_decay >= 0):
            raise ValueError(f"lr must be finite and > 0, weight_decay finite and >= 0; got {self.lr}, "
                             f"{self.weight_decay}")
        if not (0 <= self.split <= MAX_SEED and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"split and seed must be between 0 and {MAX_SEED}, got {self.split} and {self.seed}")

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON/YAML-able dict (tuples become lists)."""
        return _plain(dataclasses.asdict(self))

    @property
    def branch_lr(self) -> float:
        """The ingredients' learning rate: ``branch.lr``, else ``lr``."""
        return self.lr if self.branch.lr is None else self.branch.lr

    def ingredient_settings(self, k: int) -> IngredientSettings:
        """Ingredient ``k``'s dropout, weight decay, learning rate and DropEdge rate (see :class:`BranchConfig`)."""
        def pick(values: tuple[float, ...], default: float) -> float:
            return values[k % len(values)] if values else default
        return IngredientSettings(pick(self.branch.dropout, self.dropout),
                                  pick(self.branch.weight_decay, self.weight_decay),
                                  self.branch_lr * pick(self.branch.lr_scale, 1.0), pick(self.branch.drop_edge, 0.0))

    def trunk_view(self) -> ViewConfig:
        """The trunk's view: ``trunk.view``, or ``cluster`` for partition recipes, else the recipe's own view
        (other view keys, such as ``view.parts``, carry over; a partition's balance and halo do not)."""
        kind = self.trunk.view or ("cluster" if self.view.kind in PARTITION_KINDS else self.view.kind)
        if kind == self.view.kind:
            return self.view
        return dataclasses.replace(self.view, kind=kind, balance="none", halo=0)

    def replace(self, **changes: Any) -> Recipe:
        """A copy with top-level fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


_MAX_NAME = 100
MAX_SEED = 2**32 - 1  # every derived seed (seed * 1000 + k + 1) then fits torch's and numpy's generators
_BOUNDS = {"hidden": 1 << 16, "layers": 128, "heads": 64, "epochs": 1_000_000, "patience": 1_000_000}


def _is_file_name(name: str) -> bool:
    """Whether ``name`` is one plain file-name component (the run directory is named after it): not empty,
    no path separator or control character, not hidden (so neither ``.`` nor ``..``), not overlong."""
    return (0 < len(name) <= _MAX_NAME and not name.startswith(".") and "/" not in name and "\\" not in name
            and name.isprintable())


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error names a bad value, it does not print a huge one."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(choices)}; got {_shown(value)}")


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against a field's type hint; convert lists to tuples and ints to floats."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise LadleError(f"recipe key '{key}' must be a mapping, got {_shown(value)}")
        return _build(hint, value, prefix=f"{key}.")
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            if option is type(None) and value is None:
                return None
            try:
                return _coerce(key, value, option)
            except LadleError:
                continue
        raise LadleError(f"recipe key '{key}' has a value of the wrong type: {_shown(value)}")
    if origin is tuple:
        (item_hint, _ellipsis) = typing.get_args(hint)
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):  # one value: a list of one
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise LadleError(f"recipe key '{key}' must be a list, got {_shown(value)}")
        return tuple(_coerce(key, item, item_hint) for item in value)
    if hint is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)  # ints, and strings: YAML 1.1 reads 1e-3 (no dot) as a string
        except ValueError:
            raise LadleError(f"recipe key '{key}' must be of type float, got {_shown(value)}") from None
        except OverflowError:  # an int beyond float's range
            number = math.inf
        if not math.isfinite(number):
            raise LadleError(f"recipe key '{key}' must be a finite number, got {_shown(value)}")
        return number
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        name = getattr(hint, "__name__", str(hint))
        raise LadleError(f"recipe key '{key}' must be of type {name}, got {_shown(value)}")
    return value


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise LadleError(
            f"unknown recipe key '{prefix}{unknown[0]}' (known keys here: {', '.join(sorted(known))})"
        )
    kwargs = {k: _coerce(prefix + k, v, hints[k]) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except ValueError as error:
        message = str(error)
        raise LadleError(message if message.startswith(prefix) else f"{prefix}{message}") from None


def _merge(base: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c = value`` in a nested dict, creating sections on the way."""
    *sections, last = dotted.split(".")
    node = base
    for section in sections:
        child = node.setdefault(section, {})
        if not isinstance(child, dict):
            raise LadleError(f"recipe key '{section}' is not a section; cannot set '{dotted}'")
        node = child
    node[last] = value


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["epochs=50", "view.kind=metis"]`` -> nested dict; values parsed as YAML scalars."""
    result: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise LadleError(f"override '{pair}' is not of the form key=value")
        try:
            value = yaml.load(raw, Loader=RecipeLoader) if raw else ""  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError as error:
            raise LadleError(f"override '{_shown(pair)[1:-1]}' is not valid YAML: {str(error).splitlines()[0]}") from None
        _merge(result, key.strip(), value)
    return result


def _deep_update(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


def load_recipe(recipe: str | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Recipe:
    """Load a recipe by name or path (``None``: the embedded default) and apply overrides."""
    values = read_recipe_file(recipe) if recipe is not None else {}
    if isinstance(overrides, dict):
        extra = overrides
    else:
        extra = parse_overrides(list(overrides or []))
    base = Recipe().to_dict()
    _deep_update(base, values)
    _deep_update(base, extra)
    return recipe_from_dict(base)


def override_recipe(values: dict[str, Any], overrides: list[str]) -> Recipe:
    """The recipe ``values`` (a nested dict, e.g. a ``run.json``'s) with ``key=value`` overrides applied."""
    base = _deep_update(Recipe().to_dict(), values)
    return recipe_from_dict(_deep_update(base, parse_overrides(overrides)))


def recipe_from_dict(values: dict[str, Any]) -> Recipe:
    """Build and validate a :class:`Recipe` from a (possibly partial) nested dict."""
    base = Recipe().to_dict()
    _deep_update(base, values)
    return _build(Recipe, base)


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe options the commands share: ``key=value`` overrides, ``--recipe``, ``--seed``, ``--data-root``."""
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    parser.add_argument("--recipe", help="recipe name in recipes/ or a .yaml path (default: the embedded default)")
    parser.add_argument("--seed", type=int, help="base seed (same as the override seed=S)")
    parser.add_argument("--data-root", help="dataset root folder (default $LADLE_DATA, ../shared/datasets, ./data)")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """The recipe named by :func:`add_recipe_arguments`' options."""
    overrides = list(args.overrides) + ([f"seed={args.seed}"] if args.seed is not None else [])
    return load_recipe(args.recipe, overrides)


VIEW_KINDS = ("full", "metis", "random", "cluster", "saint-node", "saint-edge", "saint-rw", "neighbor")
PARTITION_KINDS = ("metis", "random")
SAINT_KINDS = ("saint-node", "saint-edge", "saint-rw")
SAMPLERS = ("ladle", "pyg")
FALLBACKS = ("full", "none")  # what the launcher trains when a view failed (ladle.train.view_check)
BALANCE_KINDS = ("none", "labels")


@dataclass(frozen=True)
class ViewConfig:
    """How each ingredient sees the graph (recipe key ``view``; nested keys like ``view.parts=32``)."""

    kind: str = "full"
    parts: int = 32  # cluster: number of METIS parts M (metis/random use K parts and ignore this)
    parts_per_batch: int = 4  # cluster: q parts merged per batch
    batch_size: int = 0  # saint-node: nodes / saint-edge: edges / saint-rw: roots / neighbor: seeds; 0 -> default
    subgraph_share: float = 0.25  # saint, batch_size 0: a subgraph aims at this share of the graph's nodes, ...
    subgraph_max_nodes: int = 8000  # ... at most this many (8,000: the GraphSAINT paper's Reddit budget)
    walk_length: int = 2  # saint-rw: steps of each random walk
    steps_per_epoch: int = 0  # cluster/saint/neighbor: batches per epoch; 0 -> cover the graph about once
    sample_coverage: int = 20  # saint: pre-sample until each node was drawn this often on average
    fanout: tuple[int, ...] = (25, 10)  # neighbor: neighbours sampled per node, per hop
    balance: str = "none"  # metis: "labels" balances each class's train labels across parts
    halo: int = 0  # metis/random: hops of read-only neighbourhood each part also stores (loss on its own nodes)
    sampler: str = "ladle"  # who draws cluster/saint/neighbor batches: ladle, or PyG's loaders (ladle.graph.pyg_views)
    fallback: str = "full"  # with a baseline, a view that failed on the graph is trained again on: full, or none

    def __post_init__(self) -> None:
        if self.kind not in VIEW_KINDS:
            raise ValueError(f"view.kind must be one of {', '.join(VIEW_KINDS)}; got {self.kind!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"view.sampler must be one of {', '.join(SAMPLERS)}; got {self.sampler!r}")
        if not 0 < self.subgraph_share <= 1:
            raise ValueError(f"view.subgraph_share must be in (0, 1], got {self.subgraph_share}")
        for key in ("parts", "parts_per_batch", "walk_length", "sample_coverage", "subgraph_max_nodes"):
            if getattr(self, key) < 1:
                raise ValueError(f"view.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("batch_size", "steps_per_epoch"):
            if getattr(self, key) < 0:
                raise ValueError(f"view.{key} must be >= 0 (0 = default), got {getattr(self, key)}")
        object.__setattr__(self, "fanout", tuple(self.fanout))
        if not self.fanout or min(self.fanout) < 1:
            raise ValueError(f"view.fanout must be a non-empty list of integers >= 1, got {list(self.fanout)}")
        _check_choice("view.balance", self.balance, BALANCE_KINDS)
        _check_choice("view.fallback", self.fallback, FALLBACKS)
        if self.balance != "none" and self.kind != "metis":
            raise ValueError(f"view.balance={self.balance} applies to view.kind=metis, not {self.kind}")
        if self.halo < 0:
            raise ValueError(f"view.halo must be >= 0 (hops; 0 = none), got {self.halo}")
        if self.halo and self.kind not in PARTITION_KINDS:
            raise ValueError(f"view.halo applies to view.kind={' or '.join(PARTITION_KINDS)}, not {self.kind}")
