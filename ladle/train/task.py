"""What one worker trains: an :class:`IngredientTask` (an ingredient, the baseline, the trunk or the trunk
continued) and its files."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ladle.core.errors import LadleError
from ladle.core.recipe import Recipe, ViewConfig, recipe_from_dict
from ladle.core.rundir import BASELINE, CONTINUED, TRUNK, RunDir, ingredient_name

if TYPE_CHECKING:  # a type only: the command line reads this module before it imports torch
    from ladle.nn.custom import ModelFactory


def check_ingredients(ingredients: int) -> None:
    """Refuse a number of ingredients below 1 (a user error)."""
    if ingredients < 1:
        raise LadleError(f"--ingredients must be >= 1, got {ingredients}")


INGREDIENT = "ingredient"
ROLES = (INGREDIENT, BASELINE, TRUNK, CONTINUED)
INITS = ("shared", "independent")
SAVE_EVERY = 10  # epochs between resumable training-state checkpoints, unless a run says otherwise


@dataclass
class IngredientTask:
    """What one worker needs to train one model of a run; ``role`` says which:

    - ``ingredient`` ``k`` of ``num_ingredients``, on its view (from the trunk when the recipe has one);
    - ``baseline``: one full-graph model, the trunk's and a branch's epochs together;
    - ``trunk``: trained once on :meth:`Recipe.trunk_view`, before the ingredients that branch from it;
    - ``trunk-continued``: the trunk trained on, on its own view, for a branch's epochs, as a branch is:
      what one worker makes of them without the K - 1 others (a branch's steps on a sampled view; on a partition
      recipe's ClusterGCN view, one step per batch of parts where a part's branch takes one an epoch).
    """

    k: int | None
    num_ingredients: int
    run_dir: Path
    init: str  # "shared" | "independent"
    save_every: int = SAVE_EVERY  # epochs between resumable progress checkpoints (0: never)
    log: tuple[str, ...] = ()  # metric loggers besides the CSV (ladle.train.curves.LOGGERS)
    role: str = ""  # empty: ``ingredient`` when ``k`` is given, else ``baseline``
    model_class: ModelFactory | None = None  # your own model's class (``model: custom``), pickled to the worker

    def __post_init__(self) -> None:
        if not self.role:
            self.role = INGREDIENT if self.k is not None else BASELINE
        if self.role not in ROLES or (self.role == INGREDIENT) != (self.k is not None):
            raise ValueError(f"a task is one of {', '.join(ROLES)}, with k for an ingredient only; got "
                             f"role {self.role!r}, k {self.k}")

    @property
    def name(self) -> str:
        return ingredient_name(self.k) if self.k is not None else self.role

    @property
    def seed_index(self) -> int:
        """Its index in the seed rule (:func:`ladle.core.seeds.worker_seed`): k, or -1, -2, -3."""
        return self.k if self.k is not None else {BASELINE: -1, TRUNK: -2, CONTINUED: -3}[self.role]

    @property
    def files(self) -> RunDir:
        return RunDir(self.run_dir)

    @property
    def progress_path(self) -> Path:
        return self.files.progress(self.name)


@dataclass(frozen=True)
class RunSpec:
    """What a run trains, as its ``run.json`` records it: the recipe, ``ingredients`` (K), their ``init``
    (one shared draw or one each), whether a full-graph ``baseline`` is trained, how often training state is
    saved (``save_every`` epochs, 0: never) and the curve loggers besides the CSV (``log``). ``model_class``, the
    class of your own model, is given again at every command: ``run.json`` says ``model: custom``, never which."""

    recipe: Recipe
    ingredients: int
    init: str = "shared"
    baseline: bool = False
    save_every: int = SAVE_EVERY
    log: tuple[str, ...] = ()
    model_class: ModelFactory | None = None

    def __post_init__(self) -> None:
        check_ingredients(self.ingredients)
        if self.init not in INITS:
            raise LadleError(f"init must be 'shared' or 'independent', got {self.init!r}")
        if self.init == "independent" and self.recipe.trunk.epochs:
            raise LadleError("--independent-init contradicts trunk.epochs > 0: every ingredient starts from the "
                             "trunk (drop the flag, or set trunk.epochs=0)")
        object.__setattr__(self, "log", tuple(self.log))

    def definition(self) -> dict[str, Any]:
        """What makes two runs the same run (a run directory holds one)."""
        return {"recipe": self.recipe.to_dict(), "ingredients": self.ingredients, "init": self.init,
                "baseline": self.baseline}

    def to_json(self) -> dict[str, Any]:
        """The entries of ``run.json`` this spec owns."""
        return self.definition() | {"save_every": self.save_every, "log": list(self.log)}

    @classmethod
    def from_json(cls, run: dict[str, Any], model_class: ModelFactory | None = None) -> RunSpec:
        """The spec a ``run.json`` records (and the class of its own model, when it has one). A run written before
        the view had its subgraph keys keeps the subgraphs it sampled: :class:`ViewConfig`'s defaults."""
        recipe = dict(run["recipe"])
        recipe["view"] = {"subgraph_share": ViewConfig.subgraph_share,
                          "subgraph_max_nodes": ViewConfig.subgraph_max_nodes, **recipe.get("view", {})}
        return cls(recipe_from_dict(recipe), int(run["ingredients"]), run["init"], bool(run.get("baseline")),
                   int(run.get("save_every", SAVE_EVERY)), tuple(run.get("log", ())), model_class)

    def task(self, k: int | None, run_dir: Path, role: str = "", init: str = "shared") -> IngredientTask:
        """One task of this run: ingredient ``k``, or the ``role`` of a reference model."""
        return IngredientTask(k, self.ingredients, run_dir, init, self.save_every, self.log, role, self.model_class)

    def trunk_task(self, run_dir: Path) -> IngredientTask:
        """The trunk: trained once from the shared init, before the ingredients that branch from it."""
        return self.task(None, run_dir, TRUNK)

    def tasks(self, run_dir: Path) -> list[IngredientTask]:
        """What trains after the trunk: ingredients ``0..K-1``, the trunk continued when the recipe has a trunk,
        then the baseline (shared init) when the run has one."""
        tasks = [self.task(k, run_dir, init=self.init) for k in range(self.ingredients)]
        if self.recipe.trunk.epochs:
            tasks.append(self.task(None, run_dir, CONTINUED))
        if self.baseline:
            tasks.append(self.task(None, run_dir))
        return tasks
