"""The run directory: the one module that names its files.

``checkpoints/<run>/`` holds ``run.json`` (the run's settings and status), ``init.safetensors`` (the
shared initial weights), ``trunk.safetensors`` + ``trunk.json`` (the shared trunk the ingredients
branch from, when the recipe has one), ``partition.safetensors`` (partition views), ``shards`` (a link
to the prepared shards), per ingredient ``ingredient-XX.safetensors`` + ``ingredient-XX.json`` (and
``ingredient-XX.progress.safetensors`` while it trains), ``baseline.*``, ``averaged.*``,
``soup-<method>.*``, the soup report (``report.json``, ``report.md``, ``accuracy.png``, ``alpha.png``)
or a varrate run's ``model.safetensors``, ``varrate.json`` and ``accuracy-bytes.png``.
``checkpoints/latest`` points at the newest run.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ladle.checkpoints import StateDict, load_state, read_json
from ladle.errors import LadleError

log = logging.getLogger(__name__)

CHECKPOINTS = Path("checkpoints")
BASELINE = "baseline"
AVERAGED = "averaged"
TRUNK = "trunk"


def ingredient_name(k: int) -> str:
    """``ingredient-03`` for k = 3."""
    return f"ingredient-{k:02d}"


def soup_name(method: str) -> str:
    """``soup-gis`` for the method ``gis``: the soup's name in reports and files."""
    return f"soup-{method}"


@dataclass(frozen=True)
class RunDir:
    """Paths of the files of one run directory (nothing is created or read here, except :meth:`finished`)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def run_json(self) -> Path:
        """The run's settings and status."""
        return self.path / "run.json"

    @property
    def init(self) -> Path:
        """The shared initial weights."""
        return self.path / "init.safetensors"

    @property
    def partition(self) -> Path:
        """The part id of every node (partition views), computed once for all workers."""
        return self.path / "partition.safetensors"

    @property
    def shards(self) -> Path:
        """The link to the run's prepared shards (made by :meth:`ladle.shards.ShardSet.link`)."""
        return self.path / "shards"

    def weights(self, name: str) -> Path:
        """The weights of a model of the run (an ingredient, ``baseline``, ``averaged``, a soup)."""
        return self.path / f"{name}.safetensors"

    def meta(self, name: str) -> Path:
        """The JSON metadata next to :meth:`weights`."""
        return self.path / f"{name}.json"

    def progress(self, name: str) -> Path:
        """The resumable training state of a model still training."""
        return self.path / f"{name}.progress.safetensors"

    def finished(self, name: str) -> bool:
        """Whether ``name`` has weights and metadata that says ``done``."""
        meta = self.meta(name)
        return self.weights(name).is_file() and meta.is_file() and read_json(meta).get("status") == "done"

    @property
    def report_json(self) -> Path:
        """Soup report: everything measured, as JSON."""
        return self.path / "report.json"

    @property
    def report_md(self) -> Path:
        """The report as Markdown (soup or varrate)."""
        return self.path / "report.md"

    @property
    def accuracy_plot(self) -> Path:
        """Soup report: test accuracy of ingredients, soups and references."""
        return self.path / "accuracy.png"

    @property
    def alpha_plot(self) -> Path:
        """Soup report: validation accuracy against alpha for each interpolation step."""
        return self.path / "alpha.png"

    @property
    def bytes_plot(self) -> Path:
        """Varrate report: test accuracy against the bytes sent."""
        return self.path / "accuracy-bytes.png"

    @property
    def varrate_model(self) -> Path:
        """A varrate run's best-validation weights."""
        return self.path / "model.safetensors"

    @property
    def varrate_json(self) -> Path:
        """A varrate run's metadata (bytes and timings per epoch)."""
        return self.path / "varrate.json"


def new_run_dir(prefix: str, checkpoints_root: Path = CHECKPOINTS) -> Path:
    """``checkpoints_root/<prefix>-<date>-<time>``, suffixed ``-1``, ``-2``... when taken (not created)."""
    base = checkpoints_root / f"{prefix}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    return path


def averaging_run_dir(recipe_name: str, average_every: int, checkpoints_root: Path = CHECKPOINTS) -> Path:
    """The default folder of a periodic-averaging run."""
    return checkpoints_root / f"{recipe_name}-averaged-every-{average_every}"


def update_latest(checkpoints_root: Path, run_dir: Path) -> None:
    """Point ``checkpoints_root/latest`` at ``run_dir`` (a relative symlink, replaced atomically)."""
    link = checkpoints_root / "latest"
    temp = checkpoints_root / f".latest.{os.getpid()}"
    temp.unlink(missing_ok=True)
    try:
        target = os.path.relpath(run_dir.resolve(), checkpoints_root.resolve())
        temp.symlink_to(target, target_is_directory=True)
        os.replace(temp, link)
    except OSError:
        temp.unlink(missing_ok=True)


def resolve_run_dir(run_dir: str | Path | None, checkpoints_root: Path = CHECKPOINTS) -> Path:
    """An existing run directory: the argument, else ``checkpoints/latest``."""
    path = Path(run_dir) if run_dir is not None else checkpoints_root / "latest"
    if not path.is_dir():
        hint = "train one with python -m ladle.train" if run_dir is None else "check --run-dir"
        raise LadleError(f"run directory {path} not found ({hint})")
    if not RunDir(path).run_json.is_file():
        raise LadleError(f"{path} is not a ladle run (no run.json)")
    return path.resolve()


@dataclass
class Ingredients:
    """The finished ingredients of a run, compatible with each other."""

    names: list[str]
    states: list[StateDict]
    metas: list[dict[str, Any]]
    missing: list[str]
    skipped: list[str]


def load_ingredients(run_dir: Path, skip_bad: bool = False) -> Ingredients:
    """Load every finished ingredient; name missing ones; refuse (or skip) corrupt or mismatched ones."""
    files = RunDir(run_dir)
    run = read_json(files.run_json)
    names, states, metas, missing, skipped = [], [], [], [], []
    reference: tuple[dict[str, Any], dict[str, tuple[int, ...]]] | None = None
    for k in range(int(run["ingredients"])):
        name = ingredient_name(k)
        weights, meta_path = files.weights(name), files.meta(name)
        if not weights.exists() and not meta_path.exists():
            missing.append(name)
            continue
        try:
            meta = read_json(meta_path)
            if meta.get("status") != "done":
                missing.append(name)
                continue
            state = load_state(weights)
            shapes = {key: tuple(v.shape) for key, v in state.items()}
            if reference is None:
                reference = (meta["recipe"], shapes)
            elif meta["recipe"] != reference[0] or shapes != reference[1]:
                raise LadleError(f"{weights} does not match the other ingredients (another recipe or architecture)")
        except LadleError as error:
            if not skip_bad:
                raise LadleError(f"{error} (or pass --skip-bad to soup the rest)") from None
            log.warning("skipping %s: %s", name, error)
            skipped.append(name)
            continue
        names.append(name)
        states.append(state)
        metas.append(meta)
    if not states:
        raise LadleError(f"no finished ingredient in {run_dir} (missing: {', '.join(missing) or 'none'})")
    if missing:
        log.warning("souping %d of %d ingredients; missing or unfinished: %s", len(states), run["ingredients"],
                    ", ".join(missing))
    return Ingredients(names, states, metas, missing, skipped)
