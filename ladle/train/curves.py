"""Training curves: one row per epoch of every model a run trains, to a CSV always and to TensorBoard on request.

The loggers follow torchtune's metric loggers: ``log(row)`` once an epoch, ``close()`` at the end
(:class:`MetricLogger`). Each process writes its own ``metrics-<name>.csv`` (:meth:`RunDir.metrics_part`),
so no two processes share a file, and the launcher merges them into the run's ``metrics.csv`` when it
ends, then removes them (:func:`merge_metrics`). A model that resumes at epoch ``e`` keeps the rows of
epochs before ``e`` and drops the rest, so no epoch appears twice; TensorBoard hides the events at ``e`` or later
(``SummaryWriter(purge_step=e)``). Columns: :data:`COLUMNS`; ``val_acc``/``val_loss`` are empty at an
epoch without validation; ``seconds`` is the model's training time so far, resumed time included.
"""
from __future__ import annotations

import csv
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ladle.core.errors import LadleError
from ladle.core.files import atomic_open, check_regular
from ladle.core.rundir import RunDir

if TYPE_CHECKING:  # a type only: the command line checks loggers before it imports torch
    from ladle.nn.scoring import Metrics

COLUMNS = ("run", "name", "role", "k", "epoch", "train_loss", "val_acc", "val_loss", "lr", "seconds")
ROLES = ("ingredient", "baseline", "trunk", "trunk-continued", "averaged", "varrate")
LOGGERS = ("tensorboard",)  # extra loggers for --log; the CSV is always written
SCALARS = ("train_loss", "val_acc", "val_loss", "lr")  # what TensorBoard plots against the epoch
log = logging.getLogger(__name__)


class MetricLogger(Protocol):
    """Where a model's per-epoch rows go (torchtune's metric-logger shape)."""

    def log(self, row: dict[str, Any]) -> None:
        """Record one epoch's row (keys from :data:`COLUMNS`)."""

    def close(self) -> None:
        """Flush and release the logger's files."""


def check_loggers(names: Sequence[str]) -> None:
    """Refuse an unknown logger name, or TensorBoard when it is not installed, before any work starts."""
    for name in names:
        if name not in LOGGERS:
            raise LadleError(f"unknown --log {name!r} (one of: {', '.join(LOGGERS)}; the CSV is always written)")
    if "tensorboard" in names:
        summary_writer()


def summary_writer() -> type:
    """torch's ``SummaryWriter`` class, or a one-line error naming the extra to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise LadleError("--log tensorboard needs TensorBoard: pip install 'ladle[tensorboard]'") from None
    return SummaryWriter


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a metrics CSV (a half-written last line, from a crash, is dropped); a damaged file is a
    :class:`LadleError` naming it."""
    check_regular(path)
    try:
        with open(path, newline="") as stream:
            rows = [row for row in csv.DictReader(stream) if row.get("seconds") not in (None, "")]
        for row in rows:
            int(row["epoch"])
    except (csv.Error, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise LadleError(f"training curves {path} are damaged ({type(error).__name__})") from None
    return rows


def _readable_rows(path: Path, fallback: str) -> list[dict[str, str]] | None:
    """:func:`read_rows`, or None (``fallback`` says what happens instead, in a warning) when damaged."""
    try:
        return read_rows(path)
    except LadleError as error:
        log.warning("%s; %s", error, fallback)
        return None


def _cell(value: Any) -> Any:
    """A CSV cell: empty for None or a non-finite float, else the value (floats round-trip exactly)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return value


class CSVLogger:
    """Rows appended to one CSV file, one ``write`` and a flush per row; ``resume_epoch``: the rows of
    earlier epochs already in the file are kept (the file is first rewritten atomically without the rest)."""

    def __init__(self, path: Path, resume_epoch: int = 0) -> None:
        earlier = _readable_rows(path, "its earlier epochs are left out") if path.exists() else None
        kept = [row for row in earlier or [] if int(row["epoch"]) < resume_epoch]
        with atomic_open(path, "w") as stream:
            writer = csv.DictWriter(stream, COLUMNS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(kept)
        self._stream = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._stream, COLUMNS, lineterminator="\n", extrasaction="ignore")

    def log(self, row: dict[str, Any]) -> None:
        self._writer.writerow({key: _cell(row.get(key)) for key in COLUMNS})
        self._stream.flush()

    def close(self) -> None:
        self._stream.close()


class TensorBoardLogger:
    """Scalars :data:`SCALARS` against the epoch, one event folder per curve under ``log_dir`` (so
    TensorBoard overlays the ingredients); events of a resumed curve at ``resume_epoch`` or later are purged."""

    def __init__(self, log_dir: Path, resume_epoch: int = 0) -> None:
        self._writer_class = summary_writer()
        self.log_dir, self.resume_epoch = Path(log_dir), resume_epoch
        self._writers: dict[str, Any] = {}

    def log(self, row: dict[str, Any]) -> None:
        curve = curve_name(row)
        if curve not in self._writers:
            self._writers[curve] = self._writer_class(str(self.log_dir / curve), purge_step=self.resume_epoch)
        for key in SCALARS:
            if _cell(row.get(key)) != "":
                self._writers[curve].add_scalar(key, float(row[key]), int(row["epoch"]))

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


def curve_name(row: dict[str, Any]) -> str:
    """The name of the curve a row belongs to: ``name``, with ``-<k>`` when one process logs several ks
    under one name (the averaging trainers)."""
    k = row.get("k")
    return str(row["name"]) if k is None or row.get("role") == "ingredient" else f"{row['name']}-{int(k):02d}"


class EpochLogger:
    """The curves one process logs into a run directory: fixed ``name`` and ``role``, a row per
    :meth:`epoch` to the CSV and to each logger named in ``log``."""

    def __init__(self, run_dir: Path, name: str, role: str, log: Sequence[str] = (), resume_epoch: int = 0) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        files = RunDir(run_dir)
        self.run, self.name, self.role = files.path.name, name, role
        self.loggers: list[MetricLogger] = [CSVLogger(files.metrics_part(name), resume_epoch)]
        if "tensorboard" in log:
            self.loggers.append(TensorBoardLogger(files.tensorboard, resume_epoch))

    def epoch(self, epoch: int, *, k: int | None, train_loss: float | None, val: Metrics | None, lr: float,
              seconds: float) -> None:
        """Log one epoch (``val`` None: not validated this epoch)."""
        row = {"run": self.run, "name": self.name, "role": self.role, "k": k, "epoch": epoch,
               "train_loss": train_loss, "val_acc": None if val is None else val.acc,
               "val_loss": None if val is None else val.loss, "lr": lr, "seconds": seconds}
        for logger in self.loggers:
            logger.log(row)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def merge_metrics(run_dir: Path) -> Path | None:
    """Merge every ``metrics-<name>.csv`` of the run into ``metrics.csv`` and remove them: a part's rows replace
    that model's rows from the part's first epoch on (a resumed model), ``run`` is set to the folder's name,
    rows are sorted by name, k and epoch. None (nothing written) when no model has logged yet. A damaged part
    is named in a warning and left in place."""
    files = RunDir(run_dir)
    parts = {part: _readable_rows(part, "left out of the merged curves") for part in files.metrics_parts()}
    merged = {part: rows for part, rows in parts.items() if rows is not None}
    if not merged:
        return files.metrics if files.metrics.is_file() else None
    new = [row for rows in merged.values() for row in rows]
    first: dict[str, int] = {}
    for row in new:
        first[row["name"]] = min(first.get(row["name"], int(row["epoch"])), int(row["epoch"]))
    earlier = _readable_rows(files.metrics, "rewritten from the parts alone") if files.metrics.is_file() else None
    rows = [row for row in earlier or [] if int(row["epoch"]) < first.get(row["name"], math.inf)] + new
    rows = [row | {"run": files.path.name} for row in rows]
    rows.sort(key=lambda row: (row["name"], int(row["k"] or -1), int(row["epoch"])))
    with atomic_open(files.metrics, "w") as stream:
        writer = csv.DictWriter(stream, COLUMNS, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    for part in merged:
        part.unlink(missing_ok=True)
    return files.metrics
