"""What one worker trains: an :class:`IngredientTask` (an ingredient, the trunk or the baseline), its
seed and its files."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ladle.core.errors import LadleError
from ladle.core.rundir import BASELINE, TRUNK, RunDir, ingredient_name


def check_ingredients(ingredients: int) -> None:
    """Refuse a number of ingredients below 1 (a user error)."""
    if ingredients < 1:
        raise LadleError(f"--ingredients must be >= 1, got {ingredients}")


@dataclass
class IngredientTask:
    """What one worker needs to train one ingredient, or the full-graph baseline (``k`` None), or the
    trunk (``trunk``, ``k`` None: it reads the whole graph through :meth:`Recipe.trunk_view`)."""

    k: int | None
    num_ingredients: int
    run_dir: Path
    init: str  # "shared" | "independent"
    save_every: int = 10  # epochs between resumable progress checkpoints (0: never)
    trunk: bool = False
    log: tuple[str, ...] = ()  # metric loggers besides the CSV (ladle.train.curves.LOGGERS)

    @property
    def name(self) -> str:
        if self.trunk:
            return TRUNK
        return BASELINE if self.k is None else ingredient_name(self.k)

    @property
    def files(self) -> RunDir:
        return RunDir(self.run_dir)

    @property
    def progress_path(self) -> Path:
        return self.files.progress(self.name)


def ingredient_tasks(run_dir: Path, ingredients: int, init: str, baseline: bool,
                     save_every: int = 10, log: tuple[str, ...] = ()) -> list[IngredientTask]:
    """The tasks of a run: ingredients ``0..K-1``, then the baseline (shared init) when the run has one."""
    tasks = [IngredientTask(k, ingredients, run_dir, init, save_every, log=log) for k in range(ingredients)]
    if baseline:
        tasks.append(IngredientTask(None, ingredients, run_dir, "shared", save_every, log=log))
    return tasks


def trunk_task(run_dir: Path, ingredients: int, save_every: int = 10, log: tuple[str, ...] = ()) -> IngredientTask:
    """The trunk of a run: trained once from the shared init, before the ingredients that branch from it."""
    return IngredientTask(None, ingredients, run_dir, "shared", save_every, trunk=True, log=log)
