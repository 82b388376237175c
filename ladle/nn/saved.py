"""What a run saved, read back checked: every checkpoint must hold the keys and shapes of a model built
from the run's ``run.json`` recipe, and every ingredient its recipe; any of its models loaded as a module
(:func:`load_model`) or applied to a graph (:func:`predict`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.data import Data

from ladle.core.errors import LadleError
from ladle.core.files import read_json
from ladle.core.recipe import recipe_from_dict
from ladle.core.rundir import (
    RunDir,
    ingredient_name,
    read_run,
    recipe_difference,
    resolve_run_dir,
)
from ladle.core.storage import StateDict, load_state
from ladle.graph.datasets import (
    dataset_identity,
    load_dataset,
    normalize_rows,
    resolve_data_root,
)
from ladle.graph.given import graph_identity
from ladle.graph.inputs import graph_inputs
from ladle.nn.custom import CustomModel, ModelFactory, check_model_class
from ladle.nn.models import GNN, build_model

log = logging.getLogger(__name__)


def expected_shapes(run: dict[str, Any], model_class: ModelFactory | None = None) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of the weights of a model of ``run``'s recipe (its ``run.json``; ``model_class`` for your
    own model), which every checkpoint of the run must hold; built on the meta device, so nothing is allocated
    and no RNG drawn."""
    with torch.device("meta"):
        model = build_model(recipe_from_dict(run["recipe"]), int(run["dataset"]["features"]),
                            int(run["dataset"]["classes"]), model_class)
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


IN_MEMORY = "a graph given in memory"


def data_record(dataset: str, data_root: str | Path | None, graph: Data | None = None) -> dict[str, Any]:
    """What ``run.json`` records of the data a run trains on: the identity of the dataset's files
    (:func:`~ladle.graph.datasets.dataset_identity`) and the root they were read from, or of the ``graph``
    given in memory (:func:`~ladle.graph.given.graph_identity`)."""
    if graph is not None:
        return {"identity": graph_identity(graph), "root": IN_MEMORY}
    return {"identity": dataset_identity(dataset, data_root), "root": str(resolve_data_root(data_root))}


def check_same_data(run: dict[str, Any], run_dir: Path, data_root: str | Path | None, allow_other: bool,
                    graph: Data | None = None) -> None:
    """Refuse to resume or soup a run on other data than it trained on (another copy, other labels): the
    ingredients would be scored, or trained on, a graph they never saw. ``allow_other`` lets it through."""
    recorded = run.get("data")
    if not isinstance(recorded, dict) or allow_other:
        return
    if recorded.get("root") == IN_MEMORY and graph is None:
        raise LadleError(f"run {run_dir} was trained on {IN_MEMORY} (identity {recorded.get('identity')}): give it "
                         "again (data=...), or --allow-other-data to read the dataset of its recipe")
    now = data_record(run["recipe"]["dataset"], data_root, graph)
    if now["identity"] != recorded.get("identity"):
        was, given = (record["root"] if record.get("root") == IN_MEMORY
                      else f"the {run['recipe']['dataset']} files of {record.get('root')}" for record in (recorded, now))
        raise LadleError(f"run {run_dir} was trained on {was} (identity {recorded.get('identity')}), not on {given} "
                         f"(identity {now['identity']}): pass the run's data (--data-root), or --allow-other-data if "
                         "they are the same data")


def check_weights(path: Path, expected: dict[str, tuple[int, ...]]) -> StateDict:
    """Load a checkpoint of the run, refused unless it holds exactly the keys and shapes of the run's recipe."""
    state = load_state(path)
    for key, shape in expected.items():
        if key not in state:
            raise LadleError(f"{path} does not match the run's recipe (no {key})")
        if tuple(state[key].shape) != shape:
            raise LadleError(f"{path} does not match the run's recipe ({key} has shape {tuple(state[key].shape)}, "
                             f"the recipe gives {shape})")
    extra = sorted(state.keys() - expected.keys())
    if extra:
        raise LadleError(f"{path} does not match the run's recipe (unexpected {extra[0]})")
    return state


def verify_finished(files: RunDir, name: str, expected: dict[str, tuple[int, ...]]) -> bool:
    """Whether ``name`` is finished and its weights load with the run's keys and shapes; a damaged one is
    logged and counts as unfinished, so ``--resume`` trains it again."""
    try:
        if not files.finished(name):
            return False
        check_weights(files.weights(name), expected)
    except LadleError as error:
        log.warning("%s will be trained again: %s", name, error)
        return False
    return True


@dataclass
class Ingredients:
    """The finished ingredients of a run that match its ``run.json``, and those left out."""

    names: list[str]
    states: list[StateDict]
    metas: list[dict[str, Any]]
    missing: list[str]
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why (``--skip-bad``)


def load_ingredients(run_dir: Path, skip_bad: bool = False, model_class: ModelFactory | None = None) -> Ingredients:
    """Load every finished ingredient, each checked against ``run.json``'s recipe (its own recipe, and the
    keys and shapes of a model built from it, by ``model_class`` for your own model); name missing ones; refuse
    (or skip, with why) the others."""
    files = RunDir(run_dir)
    run = read_run(run_dir)
    expected = expected_shapes(run, model_class)
    bundle = Ingredients([], [], [], [])
    for k in range(int(run["ingredients"])):
        name = ingredient_name(k)
        weights, meta_path = files.weights(name), files.meta(name)
        if not weights.exists() and not meta_path.exists():
            bundle.missing.append(name)
            continue
        try:
            meta = read_json(meta_path)
            if meta.get("status") != "done":
                bundle.missing.append(name)
                continue
            difference = recipe_difference(meta.get("recipe", {}), run["recipe"])
            if difference:
                raise LadleError(f"{weights} does not match the run's recipe ({difference})")
            state = check_weights(weights, expected)
        except LadleError as error:
            if not skip_bad:
                raise LadleError(f"{error} (or pass --skip-bad to soup the rest)") from None
            log.warning("skipping %s: %s", name, error)
            bundle.skipped[name] = str(error)
            continue
        bundle.names.append(name)
        bundle.states.append(state)
        bundle.metas.append(meta)
    if not bundle.states:
        raise LadleError(f"no finished ingredient in {run_dir} (missing: {', '.join(bundle.missing) or 'none'}"
                         f"{', skipped: ' + ', '.join(bundle.skipped) if bundle.skipped else ''})")
    if bundle.missing:
        log.warning("souping %d of %d ingredients; missing or unfinished: %s", len(bundle.states),
                    run["ingredients"], ", ".join(bundle.missing))
    return bundle


def load_model(run_dir: str | Path | None = None, name: str | None = None,
               model: ModelFactory | None = None) -> nn.Module:
    """A model a run saved, ready to use: a soup (``soup-<method>``), ``ingredient-XX``, ``trunk``,
    ``trunk-continued``, ``baseline`` or ``averaged`` (None: the soup the run's report chose, the best on
    validation), its weights checked against the run's recipe, in eval mode, with that recipe as
    ``model.recipe``. ``run_dir`` None: ``checkpoints/latest``. A run of your own model needs its class as
    ``model`` and gives back an instance of it (``forward(x, edge_index)``); ladle's own models take
    :class:`~ladle.graph.inputs.GraphInputs` (or use :func:`predict`)."""
    loaded = _load(run_dir, name, model)
    return loaded.module if isinstance(loaded, CustomModel) else loaded


def _load(run_dir: str | Path | None, name: str | None, model_class: ModelFactory | None) -> GNN | CustomModel:
    """:func:`load_model`, your own model still behind ladle's ``forward(inputs)``; its ``recipe`` set."""
    path = resolve_run_dir(run_dir)
    run, files = read_run(path), RunDir(path)
    if name is None:
        if not files.report_json.is_file():
            raise LadleError(f"{path} has no soup report yet: soup it (python -m ladle.soup --run-dir {path}) or name "
                             f"a model (it has: {_saved_models(files)})")
        chosen = read_json(files.report_json).get("parallel_phase")
        if not chosen:
            raise LadleError(f"{path}'s soup report chose no soup (its soups were all fitted on validation nodes, "
                             f"never chosen): name a model (it has: {_saved_models(files)})")
        name = str(chosen["best_soup"])
    weights = files.weights(name)
    if not weights.is_file():
        raise LadleError(f"{path} has no model {name!r} (it has: {_saved_models(files)})")
    recipe = recipe_from_dict(run["recipe"])
    check_model_class(recipe.model, model_class)
    state = check_weights(weights, expected_shapes(run, model_class))
    with torch.random.fork_rng(devices=[]):  # the weights are replaced: leave the caller's RNG as it was
        model = build_model(recipe, int(run["dataset"]["features"]), int(run["dataset"]["classes"]), model_class)
    model.load_state_dict(state)
    model.recipe = recipe
    if isinstance(model, CustomModel):
        model.module.recipe = recipe
    return model.eval()


def _saved_models(files: RunDir) -> str:
    """The models a run directory holds (its weights but the init, the partition and training states)."""
    names = sorted(p.name.removesuffix(".safetensors") for p in files.path.glob("*.safetensors")
                   if p.name not in (files.init.name, files.partition.name) and ".progress." not in p.name)
    return ", ".join(names) or "none"


def predict(run_dir: str | Path | None = None, data: Data | None = None, name: str | None = None,
            data_root: str | Path | None = None, model: ModelFactory | None = None) -> Tensor:
    """Logits of a run's model (:func:`load_model`) for every node of ``data``, a PyG ``Data`` with ``x`` and
    ``edge_index`` whose features are prepared as ladle prepares the run's (:func:`~ladle.graph.datasets.load_dataset`
    with the recipe's ``features``); None: the run's own dataset, loaded from ``data_root``. ``model``: the class of
    a run of your own model."""
    model = _load(run_dir, name, model)
    recipe = model.recipe
    if data is None:
        data = load_dataset(recipe.dataset, data_root, recipe.split, recipe.features)
    elif data.x is None or data.edge_index is None or data.x.dim() != 2:
        raise LadleError("predict needs a graph with node features x (2-D) and edge_index")
    elif recipe.features == "normalize":  # as the run's graph was (ladle.graph.given.user_graph)
        data = Data(x=normalize_rows(data.x), edge_index=data.edge_index, num_nodes=data.num_nodes)
    if data.x.size(1) != model.in_channels:
        raise LadleError(f"the graph has {data.x.size(1)} features per node, the model takes {model.in_channels}")
    with torch.no_grad():
        return model(graph_inputs(data, recipe.model))
