"""What a rank's training exchanges remember from one step to the next: the sender's error-feedback
residuals (:class:`ErrorFeedback`) and, for selective exchange, the rows that travel (:class:`Route`) and the
receiver's stale halo (:class:`SelectiveExchange`). Evaluation exchanges use neither."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ladle.graph.partition import stream_generator
from ladle.varrate.compression import Compressor


@dataclass(eq=False)
class ErrorFeedback:
    """Error feedback (EF-SGD's rule, on the halo rows): per layer, one residual per row of the plan's send list.

    A sender compresses ``rows + residual`` and keeps as the new residual what that compression lost, so
    ``decoded + new residual = rows + old residual``: over steps, what the receivers got plus what is still
    held back is exactly what should have been sent. Residuals are plain tensors outside autograd.

    Only columns a payload can carry at this ratio are held back (:meth:`Compressor.sendable_columns`); the rest
    are dropped. Truncation's and int8's tail columns are never sent, so their residual would only grow, then
    burst out at the first step whose lower ratio sends them; truncation therefore gains nothing from feedback
    (it is exact on the columns it sends), int8 feeds back its rounding, the (unscaled) mask what it left out.
    """

    residuals: dict[int, Tensor] = field(default_factory=dict)

    def encode(self, compressor: Compressor, rows: Tensor, rate: float, key: int, layer: int, sent: Tensor | None,
               total: int) -> Tensor:
        """The payload of ``rows`` (positions ``sent`` of the ``total`` rows of the send list; None: all of them)
        plus their residuals; those residuals become what the payload loses."""
        with torch.no_grad():
            residual = self.residuals.get(layer)
            if residual is None:
                residual = self.residuals[layer] = rows.new_zeros(total, rows.size(1))
            corrected = rows + (residual if sent is None else residual[sent])
            payload = compressor.encode(corrected, rate, key)
            lost = corrected - compressor.decode(payload, rows.size(1), rate, key)
            lost[:, compressor.sendable_columns(rows.size(1), rate):] = 0
            if sent is None:
                self.residuals[layer] = lost
            else:
                residual[sent] = lost
        return payload


@dataclass(frozen=True, eq=False)
class Route:
    """The rows one exchange moves: positions in the plan's send list and in its halo (None: all of them), and
    how many go to (``send_counts``) and come from (``recv_counts``) each peer."""

    sent: Tensor | None
    received: Tensor | None
    send_counts: list[int]
    recv_counts: list[int]


def pick(counts: list[int], fraction: float, pairs: list[tuple[int, int]], seed: int, step: int,
         layer: int) -> tuple[Tensor, list[int]]:
    """Of rows grouped by peer (``counts[p]`` of peer ``p``), ``ceil(fraction * counts[p])`` at random per peer:
    their positions (sorted) and how many per peer. Peer ``p``'s draw comes from the stream of
    ``(seed, step, layer, *pairs[p])`` (``pairs[p]``: sender, receiver), so both ends of a pair draw the same rows."""
    positions, chosen, start = [], [], 0
    for count, (sender, receiver) in zip(counts, pairs):
        keep = math.ceil(fraction * count)
        generator = stream_generator(seed, step, layer, sender, receiver)
        positions.append(start + torch.randperm(count, generator=generator)[:keep].sort().values)
        chosen.append(keep)
        start += count
    return torch.cat(positions), chosen


@dataclass(eq=False)
class SelectiveExchange:
    """Selective exchange: a training exchange sends only ``fraction`` of the rows each peer needs (drawn from
    keys both ends share, so no indices travel); the receiver keeps its last copy of the others, as constants.

    A layer's first exchange sends every row, so every halo row has been received once.
    """

    fraction: float
    halos: dict[int, Tensor] = field(default_factory=dict)  # per layer: the last halo, detached

    def route(self, rank: int, send_counts: list[int], recv_counts: list[int], seed: int, step: int, layer: int,
              device: torch.device) -> Route:
        """The rows rank ``rank`` sends and receives at ``layer`` in step ``step`` (positions on ``device``)."""
        if layer not in self.halos:
            return Route(None, None, send_counts, recv_counts)
        peers = range(len(send_counts))
        sent, send_chosen = pick(send_counts, self.fraction, [(rank, p) for p in peers], seed, step, layer)
        received, recv_chosen = pick(recv_counts, self.fraction, [(p, rank) for p in peers], seed, step, layer)
        return Route(sent.to(device), received.to(device), send_chosen, recv_chosen)

    def merge(self, layer: int, rows: Tensor, route: Route) -> Tensor:
        """The halo of ``layer``: ``rows`` (received) at ``route.received``, the last copy elsewhere; it becomes
        the copy."""
        halo = rows
        if route.received is not None:
            halo = self.halos[layer].clone()
            halo[route.received] = rows
        self.halos[layer] = halo.detach()
        return halo
