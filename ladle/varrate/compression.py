"""Varrate's compression: operators that shrink the rows a rank sends, and the ratio over training (a schedule
fixed in advance, or ``adaptive``: driven by the training loss)."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ladle.core.errors import LadleError

SCHEDULES = ("full", "fixed", "linear", "step", "adaptive", "none")


def kept_columns(width: int, rate: float) -> int:
    """Columns a payload of ``width``-wide rows keeps at ratio ``rate``: ``int(width / rate)``, at least 1."""
    return max(1, min(width, int(width / rate)))


class Compressor(ABC):
    """Rows of width ``d`` at ratio ``r`` -> a smaller payload the receiver decodes back to width ``d``.

    Encoding and decoding are pure functions of ``(rows, rate, key)``: both ends of an exchange derive
    the same choices from the shared ``key``. At ``rate <= 1`` every compressor is lossless.
    """

    name: ClassVar[str]

    @abstractmethod
    def payload_columns(self, width: int, rate: float) -> int:
        """Columns of the payload of one row (its dtype is the one :meth:`encode` returns)."""

    @abstractmethod
    def encode(self, rows: Tensor, rate: float, key: int) -> Tensor:
        """The payload of ``rows`` (one payload row per input row)."""

    @abstractmethod
    def decode(self, payload: Tensor, width: int, rate: float, key: int) -> Tensor:
        """Float rows of width ``width`` from a payload :meth:`encode` made with the same ``rate``, ``key``."""

    def sendable_columns(self, width: int, rate: float) -> int:
        """``n``: payloads at ``(width, rate)`` carry only the first ``n`` columns, whatever the key (all by default)."""
        return width


class Truncate(Compressor):
    """The authors' scheme: send the first ``int(d / r)`` columns; the receiver pads the rest with zeros.

    A linear projection ``P``, so the backward pass (which sends ``P^T g``, the same columns of the
    gradient) gives the exact gradient of the compressed forward.
    """

    name = "truncate"

    def payload_columns(self, width: int, rate: float) -> int:
        return kept_columns(width, rate)

    def sendable_columns(self, width: int, rate: float) -> int:
        return kept_columns(width, rate)

    def encode(self, rows: Tensor, rate: float, key: int) -> Tensor:
        return rows[:, : kept_columns(rows.size(1), rate)]

    def decode(self, payload: Tensor, width: int, rate: float, key: int) -> Tensor:
        return F.pad(payload, (0, width - payload.size(1)))


class RandomMask(Compressor):
    """Send ``int(d / r)`` random columns, the same for every row and both ends (drawn from ``key``).

    The receiver scatters them back scaled by ``d / kept``, so the halo is unbiased over keys; like
    :class:`Truncate` it is linear and its backward is the exact gradient. ``scaled=False`` leaves the scale
    out (biased, but contractive: what error feedback needs, see :func:`build_compressor`).
    """

    name = "mask"

    def __init__(self, scaled: bool = True) -> None:
        self.scaled = scaled

    def payload_columns(self, width: int, rate: float) -> int:
        return kept_columns(width, rate)

    @staticmethod
    def columns(width: int, rate: float, key: int) -> Tensor:
        """The sorted column ids kept at ``(width, rate, key)``."""
        kept = kept_columns(width, rate)
        if kept == width:
            return torch.arange(width)
        generator = torch.Generator().manual_seed(key)
        return torch.randperm(width, generator=generator)[:kept].sort().values

    def encode(self, rows: Tensor, rate: float, key: int) -> Tensor:
        if kept_columns(rows.size(1), rate) == rows.size(1):
            return rows
        return rows[:, self.columns(rows.size(1), rate, key).to(rows.device)]

    def decode(self, payload: Tensor, width: int, rate: float, key: int) -> Tensor:
        if payload.size(1) == width:
            return payload
        out = payload.new_zeros(payload.size(0), width)
        scale = width / payload.size(1) if self.scaled else 1.0
        out[:, self.columns(width, rate, key).to(payload.device)] = payload * scale
        return out


class Int8(Compressor):
    """Per-row absmax int8 quantisation (plus a float32 scale per row) of the first ``int(4d / r)`` columns.

    Four int8 values cost one float32, so at ``r >= 4`` the payload is as large as :class:`Truncate`'s
    and carries 4x the columns at lower precision; ``1 < r < 4`` sends all ``d`` columns in int8.
    The rounding has no gradient: the backward pass quantises the gradient the same way
    (straight-through). Payload rows are bytes: ``kept`` int8 values then the 4 bytes of the scale.
    """

    name = "int8"

    @staticmethod
    def kept(width: int, rate: float) -> int:
        """Quantised columns at ``(width, rate)``."""
        return kept_columns(width, rate / 4)

    def payload_columns(self, width: int, rate: float) -> int:
        return width if rate <= 1 else self.kept(width, rate) + 4

    def sendable_columns(self, width: int, rate: float) -> int:
        return width if rate <= 1 else self.kept(width, rate)

    def encode(self, rows: Tensor, rate: float, key: int) -> Tensor:
        if rate <= 1:
            return rows
        columns = rows[:, : self.kept(rows.size(1), rate)]
        scale = (columns.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny).float()
        quantised = torch.round(columns / scale).to(torch.int8)
        return torch.cat([quantised.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)

    def decode(self, payload: Tensor, width: int, rate: float, key: int) -> Tensor:
        if rate <= 1:
            return payload
        kept = payload.size(1) - 4
        scale = payload[:, kept:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # fresh storage: aligned
        values = payload[:, :kept].contiguous().view(torch.int8).float() * scale
        return F.pad(values, (0, width - kept))


COMPRESSORS: dict[str, type[Compressor]] = {c.name: c for c in (Truncate, RandomMask, Int8)}


def build_compressor(name: str, error_feedback: bool = False) -> Compressor:
    """The compressor called ``name`` (``truncate``, ``mask`` or ``int8``).

    Under ``error_feedback`` the mask is unscaled: error feedback needs ``|x - C(x)| < |x|``, and the
    ``d / kept`` scale makes the kept columns' error ``(d / kept - 1)`` times the value, so residuals would grow.
    (Truncation offers error feedback nothing: see :class:`~ladle.varrate.memory.ErrorFeedback`.)
    """
    if name not in COMPRESSORS:
        raise LadleError(f"unknown compressor {name!r} (one of: {', '.join(COMPRESSORS)})")
    return RandomMask(scaled=False) if name == "mask" and error_feedback else COMPRESSORS[name]()


@dataclass(frozen=True)
class RateSchedule:
    """The compression ratio ``r_t`` of each epoch; ``None`` means no exchange at all (``none``).

    ``full``: 1. ``fixed``: ``rate_max`` throughout. ``linear``: from ``rate_max`` at epoch 0 to
    ``rate_min`` at epoch ``fraction * (epochs - 1)`` (the last epoch when ``fraction`` is 1), then ``rate_min``.
    ``step``: the ``steps`` ratios in turn, each for an equal share of ``fraction`` of the epochs, the last one
    to the end and at least from that same epoch on (default: four geometric steps from ``rate_max`` to
    ``rate_min``, e.g. 64, 16, 4, 1). ``adaptive``: ``rate_max``, halved (down to ``rate_min``) whenever the
    training loss has not improved by ``tolerance`` x its first value for ``patience`` epochs (:class:`RateController`).
    ``tail``: the last ``tail`` epochs of any schedule exchange exactly (ratio 1), e.g. ``none`` with an exact tail.
    """

    kind: str = "adaptive"
    rate_max: float = 64.0
    rate_min: float = 1.0
    fraction: float = 1.0
    steps: tuple[float, ...] = ()
    patience: int = 10
    tolerance: float = 0.01
    tail: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise LadleError(f"--schedule must be one of {', '.join(SCHEDULES)}; got {self.kind!r}")
        if not 1 <= self.rate_min <= self.rate_max < math.inf:
            raise LadleError(f"rates must satisfy 1 <= --rate-min <= --rate-max, finite; got {self.rate_min}, "
                             f"{self.rate_max}")
        if not 0 < self.fraction <= 1:
            raise LadleError(f"--rate-fraction must be in (0, 1]; got {self.fraction}")
        if not all(1 <= rate < math.inf for rate in self.steps):
            raise LadleError(f"--rate-steps must all be >= 1 and finite; got {list(self.steps)}")
        if self.patience < 1:
            raise LadleError(f"--rate-patience must be >= 1 epoch; got {self.patience}")
        if not 0 <= self.tolerance < 1:
            raise LadleError(f"--rate-tolerance must be in [0, 1); got {self.tolerance}")
        if self.tail < 0:
            raise LadleError(f"--exact-tail must be >= 0 epochs; got {self.tail}")

    def levels(self) -> tuple[float, ...]:
        """The plateaus of the ``step`` schedule."""
        if self.steps:
            return self.steps
        ratio = self.rate_min / self.rate_max
        return tuple(self.rate_max * ratio ** (i / 3) for i in range(4))

    def final(self) -> float | None:
        """The ratio the schedule ends at (``None`` for ``none`` without an exact tail)."""
        return 1.0 if self.tail else self._last()

    def in_tail(self, epoch: int, epochs: int) -> bool:
        """Whether ``epoch`` of ``epochs`` is one of the exact last ``tail``."""
        return epoch >= epochs - self.tail

    def _last(self) -> float | None:
        """The ratio the schedule itself ends at, before any exact tail."""
        if self.kind == "none":
            return None
        if self.kind == "full":
            return 1.0
        if self.kind == "fixed":
            return self.rate_max
        return self.levels()[-1] if self.kind == "step" else self.rate_min

    def rate(self, epoch: int, epochs: int) -> float | None:
        """The ratio of ``epoch`` (0-based) of ``epochs``; ``adaptive`` has none in advance
        (:class:`RateController`)."""
        if self.kind == "adaptive":
            raise ValueError("the adaptive ratio follows the training loss: use RateController")
        if self.in_tail(epoch, epochs):
            return 1.0
        if self.kind in ("none", "full", "fixed"):
            return self._last()
        end = self.fraction * (epochs - 1)  # the epoch from which the schedule is at its last ratio
        if epoch >= end:
            return self._last()
        if self.kind == "linear":
            return self.rate_max + (self.rate_min - self.rate_max) * epoch / end
        levels = self.levels()
        return levels[min(len(levels) - 1, int(epoch / (self.fraction * epochs) * len(levels)))]

    def describe(self) -> dict[str, Any]:
        """JSON-able settings."""
        return {**asdict(self), "steps": list(self.levels()) if self.kind == "step" else []}


@dataclass
class RateController:
    """The ratio of each epoch of one run, and since when it is final (for early stopping).

    Fixed schedules read :meth:`RateSchedule.rate`. ``adaptive`` starts at ``rate_max``; :meth:`observe` takes each
    epoch's training loss and halves the ratio (not below ``rate_min``) once ``patience`` epochs in a row have not
    brought the loss ``tolerance`` x the first epoch's loss below its best; the best is kept across a halving.
    The step is a share of the first loss, not of the current one: a training loss decays roughly like a power
    law, so it keeps falling by a few percent of itself for hundreds of epochs and a relative test would
    hardly ever fire. Fed the all-reduced loss, which every rank holds bit for bit, every rank takes the same ratios.
    """

    schedule: RateSchedule
    epochs: int
    current: float = field(init=False)
    first: float | None = None
    best: float = math.inf
    stale: int = 0
    settled: int | None = None  # the first epoch at the final ratio

    def __post_init__(self) -> None:
        self.current = self.schedule.rate_max

    def rate(self, epoch: int) -> float | None:
        """The ratio of ``epoch``; call once per epoch, in order."""
        schedule = self.schedule
        if schedule.kind != "adaptive":
            rate = schedule.rate(epoch, self.epochs)
        else:
            rate = 1.0 if schedule.in_tail(epoch, self.epochs) else self.current
        if self.settled is None and rate == self.schedule.final():
            self.settled = epoch
        return rate

    def observe(self, loss: float) -> None:
        """Take the epoch's training loss (``adaptive`` only; other schedules ignore it)."""
        if self.schedule.kind != "adaptive":
            return
        if self.first is None:
            self.first = loss
        if loss < self.best - self.schedule.tolerance * abs(self.first):
            self.best, self.stale = loss, 0
            return
        self.stale += 1
        if self.stale >= self.schedule.patience and self.current > self.schedule.rate_min:
            self.current, self.stale = max(self.schedule.rate_min, self.current / 2), 0

    def epochs_final(self, epoch: int) -> int:
        """Epochs up to ``epoch`` (inclusive) spent at the final ratio."""
        return 0 if self.settled is None else epoch + 1 - self.settled
