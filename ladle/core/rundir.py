"""The run directory: the one module that names its files.

``checkpoints/<run>/`` holds ``run.json`` (the run's settings and status), ``init.safetensors`` (the
shared initial weights), ``trunk.safetensors`` + ``trunk.json`` (the shared trunk the ingredients
branch from, when the recipe has one), ``partition.safetensors`` (partition views), ``shards`` (a link
to the prepared shards), per ingredient ``ingredient-XX.safetensors`` + ``ingredient-XX.json`` (and
``ingredient-XX.progress.safetensors`` while it trains), ``baseline.*``, ``averaged.*``,
``soup-<method>.*``, the soup report (``report.json``, ``report.md``, ``accuracy.png``, ``alpha.png``)
or a varrate run's ``model.safetensors``, ``varrate.json`` and ``accuracy-bytes.png``; the training
curves (:mod:`ladle.train.curves`): ``metrics-<name>.csv`` per process, merged into ``metrics.csv``, and with
``--log tensorboard`` event files under ``tensorboard-logs/<curve>/``.
``checkpoints/latest`` points at the newest run.

A run directory has one owner at a time (:mod:`ladle.core.runlock`).
Everything read back is checked against ``run.json``'s recipe (:func:`ladle.nn.saved.expected_shapes`).
"""
from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ladle.core.errors import LadleError
from ladle.core.files import read_json
from ladle.core.recipe import Recipe, recipe_from_dict

log = logging.getLogger(__name__)

CHECKPOINTS = Path("checkpoints")
BASELINE = "baseline"
AVERAGED = "averaged"
TRUNK = "trunk"
CONTINUED = "trunk-continued"  # the trunk trained on for the branches' epochs: the parallel phase's counterfactual
FAILED_VIEW = "failed-view"  # the folder of a run's models on a view that failed (ladle.train.view_check)


def ingredient_name(k: int) -> str:
    """``ingredient-03`` for k = 3."""
    return f"ingredient-{k:02d}"


def soup_name(method: str) -> str:
    """``soup-gis`` for the method ``gis``: the soup's name in reports and files."""
    return f"soup-{method}"


@dataclass(frozen=True)
class RunDir:
    """Paths of the files of one run directory (nothing is created or read here, except :meth:`finished` and
    :meth:`metrics_parts`)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def run_json(self) -> Path:
        """The run's settings and status."""
        return self.path / "run.json"

    @property
    def lock(self) -> Path:
        """Who owns the run directory now (pid, command, start time), locked with ``flock`` while they do."""
        return self.path / "run.lock"

    @property
    def workers_lock(self) -> Path:
        """Held (shared) by every worker process of the owner while it lives (:func:`hold_as_worker`)."""
        return self.path / "workers.lock"

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
        """The link to the run's prepared shards (made by :meth:`ladle.graph.shards.ShardSet.link`)."""
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

    @property
    def metrics(self) -> Path:
        """Every model's per-epoch training curve, merged (:func:`ladle.train.curves.merge_metrics`)."""
        return self.path / "metrics.csv"

    def metrics_part(self, name: str) -> Path:
        """The curves one process logs while ``name`` trains, before they are merged into :attr:`metrics`."""
        return self.path / f"metrics-{name}.csv"

    def metrics_parts(self) -> list[Path]:
        """Every :meth:`metrics_part` in the folder, sorted by name."""
        return sorted(self.path.glob("metrics-*.csv"))

    @property
    def failed_view(self) -> Path:
        """Where the models of a view that failed on the graph are kept when the launcher trains them again on the
        whole graph (:mod:`ladle.train.view_check`)."""
        return self.path / FAILED_VIEW

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files, one folder per curve (``--log tensorboard``)."""
        return self.path / "tensorboard-logs"


@contextmanager
def new_run_dir(prefix: str, checkpoints_root: Path = CHECKPOINTS) -> Iterator[Path]:
    """A new folder ``checkpoints_root/<prefix>-<date>-<time>``, suffixed ``-1``, ``-2``... when taken, created here
    (one ``mkdir`` claims it, so commands started in the same second each get their own), for the block; removed
    again when the block fails before anything was written into it."""
    base = checkpoints_root / f"{prefix}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    try:
        checkpoints_root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LadleError(f"cannot create {checkpoints_root}: {error.strerror} (choose a --run-dir)") from None
    path, n = base, 1
    while True:
        try:
            path.mkdir()
            break
        except FileExistsError:
            path, n = Path(f"{base}-{n}"), n + 1
        except OSError as error:
            raise LadleError(f"cannot create run directory {path}: {error.strerror} (choose a --run-dir)") from None
    try:
        yield path
    except BaseException:
        with suppress(OSError):
            path.rmdir()  # only when empty: a run that wrote its files keeps them (to resume)
        raise


def given_or_new_run_dir(run_dir: str | Path | None, prefix: str,
                         checkpoints_root: Path = CHECKPOINTS) -> AbstractContextManager[Path]:
    """``run_dir`` as given, else a new folder claimed by :func:`new_run_dir`, for the block."""
    return nullcontext(Path(run_dir)) if run_dir is not None else new_run_dir(prefix, checkpoints_root)


def averaging_run_dir(recipe_name: str, average_every: int, checkpoints_root: Path = CHECKPOINTS) -> Path:
    """The default folder of a periodic-averaging run."""
    return checkpoints_root / f"{recipe_name}-averaged-every-{average_every}"


def update_latest(checkpoints_root: Path, run_dir: Path) -> None:
    """Point ``checkpoints_root/latest`` at ``run_dir`` (a relative symlink, replaced atomically); say so
    when it cannot (a real directory of that name is never replaced)."""
    link = checkpoints_root / "latest"
    if link.is_dir() and not link.is_symlink():
        log.warning("%s is a real directory, not updated: remove it", link)
        return
    temp = checkpoints_root / f".latest.{os.getpid()}"
    temp.unlink(missing_ok=True)
    try:
        target = os.path.relpath(run_dir.resolve(), checkpoints_root.resolve())
        temp.symlink_to(target, target_is_directory=True)
        os.replace(temp, link)
    except OSError as error:
        temp.unlink(missing_ok=True)
        log.warning("%s not updated: %s", link, error.strerror)


def make_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` (and its parents), refused in one line when it cannot be created or written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LadleError(f"cannot create run directory {run_dir}: {error.strerror} (choose another --run-dir)") from None
    if not os.access(run_dir, os.W_OK):
        raise LadleError(f"run directory {run_dir} is not writable (choose another --run-dir)")


def resolve_run_dir(run_dir: str | Path | None, checkpoints_root: Path = CHECKPOINTS) -> Path:
    """An existing run directory: the argument, else ``checkpoints/latest`` (a link, never a stale real folder)."""
    path = Path(run_dir) if run_dir is not None else checkpoints_root / "latest"
    if run_dir is None and path.is_dir() and not path.is_symlink():
        raise LadleError(f"{path} is a real directory, not a link to the newest run: remove it, or pass --run-dir")
    if not path.is_dir():
        hint = "train one with python -m ladle.train" if run_dir is None else "check --run-dir"
        raise LadleError(f"run directory {path} not found ({hint})")
    if not RunDir(path).run_json.is_file():
        raise LadleError(f"{path} is not a ladle run (no run.json)")
    return path.resolve()


def read_run(run_dir: Path) -> dict[str, Any]:
    """A ``ladle.train`` run's ``run.json``, refused in one line when damaged or missing what every reader needs
    (its recipe, K, init, and the dataset's sizes)."""
    path = RunDir(run_dir).run_json
    run = read_json(path, "it cannot be repaired: train the run again")
    dataset = run.get("dataset")
    problems = [key for key, ok in (
        ("recipe", isinstance(run.get("recipe"), dict)),
        ("ingredients", isinstance(run.get("ingredients"), int) and run["ingredients"] >= 1),
        ("init", run.get("init") in ("shared", "independent")),
        ("dataset", isinstance(dataset, dict) and all(isinstance(dataset.get(key), int) and dataset[key] >= 1
                                                     for key in ("features", "classes"))),
    ) if not ok]
    if problems:
        raise LadleError(f"{path} is not a ladle.train run.json this version can read (bad or missing: "
                         f"{', '.join(problems)}); train the run again")
    return run


def check_same_run(run_dir: Path, run: dict[str, Any]) -> None:
    """Refuse to train ``run`` (``recipe``, ``ingredients``, ``init``, ``baseline``) into a directory whose
    ``run.json`` holds another run (only ``--resume`` continues one), or that holds files of anything but a
    ladle run (a user's folder: nothing of it is replaced)."""
    files = RunDir(run_dir)
    if not files.run_json.is_file():
        if run_dir.is_dir():
            _refuse_foreign(run_dir, "ladle run", files.init, files.partition, files.shards)  # before run.json
        return
    existing = read_json(files.run_json)
    differences = [f"{key} {run[key]!r}, run.json {existing.get(key)!r}"
                   for key in ("ingredients", "init", "baseline") if existing.get(key) != run[key]]
    recipe = recipe_difference(run["recipe"], asked_recipe(existing))
    differences += [recipe] if recipe else []
    if differences:
        raise LadleError(f"run directory {run_dir} already holds another run ({'; '.join(differences)}): "
                         "finish it with --resume, or choose another --run-dir")
    if existing.get("view_fallback"):  # its models are the whole graph's now: a new run would branch from its trunk
        raise LadleError(f"run directory {run_dir} holds this run, trained on the whole graph after its "
                         f"{existing['view_fallback'].get('view', 'view')} view failed: finish it with --resume, or "
                         "choose another --run-dir")


def check_varrate_dir(run_dir: Path) -> None:
    """Refuse a ``--run-dir`` for ``ladle.varrate`` that is a file, holds a ``ladle.train`` run, or holds
    anything but a varrate run's files (an earlier varrate run there is replaced)."""
    if not _existing_folder(run_dir):
        return
    if RunDir(run_dir).run_json.exists():
        raise LadleError(f"run directory {run_dir} holds a ladle.train run (run.json); a varrate run goes in a "
                         "folder of its own (choose another --run-dir)")
    files = RunDir(run_dir)
    _refuse_foreign(run_dir, "varrate run", files.varrate_model, files.varrate_json, files.report_md, files.metrics,
                    files.bytes_plot, files.tensorboard, *files.metrics_parts())


def check_averaging_dir(run_dir: Path) -> None:
    """Refuse a ``--run-dir`` for ``ladle.train --average-every`` that is a file or holds anything but a ladle.train
    run (averaging is written beside it, to compare) or an earlier averaging run (replaced; its training curves
    are ``metrics.csv`` only where its ``averaged.json`` is)."""
    files = RunDir(run_dir)
    if _existing_folder(run_dir) and not files.run_json.exists():
        curves = [files.metrics, *files.metrics_parts()] if files.meta(AVERAGED).exists() else []
        _refuse_foreign(run_dir, "ladle run", files.weights(AVERAGED), files.meta(AVERAGED), files.tensorboard,
                        *curves)


def _existing_folder(run_dir: Path) -> bool:
    """Whether ``run_dir`` exists; a file there is refused."""
    if run_dir.exists() and not run_dir.is_dir():
        raise LadleError(f"run directory {run_dir} is not a directory (choose another --run-dir)")
    return run_dir.is_dir()


def _refuse_foreign(run_dir: Path, what: str, *ours: Path) -> None:
    """Refuse ``run_dir`` if it holds anything but ``ours`` and its locks: a user's folder, nothing of it replaced."""
    files = RunDir(run_dir)
    known = {path.name for path in (files.lock, files.workers_lock, *ours)}
    foreign = sorted(entry.name for entry in run_dir.iterdir() if entry.name not in known)
    if foreign:
        raise LadleError(f"run directory {run_dir} holds files but no {what} ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}): choose a new or empty --run-dir")


# ---------------------------------------------------------------- everything read back matches run.json


def recipe_difference(found: dict[str, Any], expected: dict[str, Any]) -> str:
    """'' when two recipes are the same once defaults are filled in, else each difference: ``hidden 32,
    run.json 64``."""
    if not isinstance(found, dict):
        return f"a recipe that is not a mapping: {type(found).__name__}"
    try:
        ours, theirs = (_flat(recipe_from_dict(values).to_dict()) for values in (found, expected))
    except LadleError as error:
        return f"a recipe this version cannot read: {error}"
    return "; ".join(f"{key} {ours.get(key)!r}, run.json {theirs.get(key)!r}"
                     for key in sorted(ours.keys() | theirs.keys()) if ours.get(key) != theirs.get(key))


def asked_recipe(run: dict[str, Any]) -> dict[str, Any]:
    """The recipe a run was started with: ``run.json``'s, or, where the launcher trained on the whole graph instead
    of a view that failed (:mod:`ladle.train.view_check`), the one recorded before it did."""
    return run.get("asked_recipe", run.get("recipe", {}))


def run_difference(run: dict[str, Any], recipe: Recipe | None, flags: dict[str, tuple[Any, Any]]) -> str:
    """'' when ``recipe`` (None: not given) and each flag's given value (None: not given) agree with the
    recorded ones of ``run`` (its ``run.json``); else each difference: ``hidden 32, run.json 64; --ingredients 5,
    run.json 2``."""
    differences = [recipe_difference(recipe.to_dict(), asked_recipe(run))] if recipe is not None else []
    differences += [f"{flag} {given!r}, run.json {recorded!r}" for flag, (given, recorded) in flags.items()
                    if given is not None and given != recorded]
    return "; ".join(text for text in differences if text)


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested recipe dict with dotted keys (``view.kind``)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
