"""What one worker trains: an :class:`IngredientTask` (an ingredient, the baseline, the trunk or the trunk
continued) and its files."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ladle.core.errors import LadleError
from ladle.core.rundir import BASELINE, CONTINUED, TRUNK, RunDir, ingredient_name


def check_ingredients(ingredients: int) -> None:
    """Refuse a number of ingredients below 1 (a user error)."""
    if ingredients < 1:
        raise LadleError(f"--ingredients must be >= 1, got {ingredients}")


INGREDIENT = "ingredient"
ROLES = (INGREDIENT, BASELINE, TRUNK, CONTINUED)


@dataclass
class IngredientTask:
    """What one worker needs to train one model of a run; ``role`` says which:

    - ``ingredient`` ``k`` of ``num_ingredients``, on its view (from the trunk when the recipe has one);
    - ``baseline``: one full-graph model, the trunk's and a branch's epochs together;
    - ``trunk``: trained once on :meth:`Recipe.trunk_view`, before the ingredients that branch from it;
    - ``trunk-continued``: the trunk trained on, on its own view, for a branch's epochs, as a branch is:
      what one worker makes of the parallel phase's time without the K - 1 others.
    """

    k: int | None
    num_ingredients: int
    run_dir: Path
    init: str  # "shared" | "independent"
    save_every: int = 10  # epochs between resumable progress checkpoints (0: never)
    log: tuple[str, ...] = ()  # metric loggers besides the CSV (ladle.train.curves.LOGGERS)
    role: str = ""  # empty: ``ingredient`` when ``k`` is given, else ``baseline``

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


def ingredient_tasks(run_dir: Path, ingredients: int, init: str, baseline: bool, save_every: int = 10,
                     log: tuple[str, ...] = (), continued: bool = False) -> list[IngredientTask]:
    """The tasks of a run after its trunk: ingredients ``0..K-1``, then the trunk continued (``continued``:
    when the run has a trunk), then the baseline (shared init) when the run has one."""
    tasks = [IngredientTask(k, ingredients, run_dir, init, save_every, log) for k in range(ingredients)]
    if continued:
        tasks.append(IngredientTask(None, ingredients, run_dir, "shared", save_every, log, role=CONTINUED))
    if baseline:
        tasks.append(IngredientTask(None, ingredients, run_dir, "shared", save_every, log))
    return tasks


def trunk_task(run_dir: Path, ingredients: int, save_every: int = 10, log: tuple[str, ...] = ()) -> IngredientTask:
    """The trunk of a run: trained once from the shared init, before the ingredients that branch from it."""
    return IngredientTask(None, ingredients, run_dir, "shared", save_every, log, role=TRUNK)
