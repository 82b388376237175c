"""Bytes a rank sends in a collective, in one convention for every mode that communicates: the ring
algorithms NCCL and gloo use for large messages.

Ring all-reduce of ``n`` items of ``b`` bytes on ``K`` ranks: the buffer is split into ``K`` chunks of
``n // K`` or ``n // K + 1`` items (the first ``n % K`` get one more); in the reduce-scatter rank ``r``
sends every chunk but ``(r + 1) % K``, in the all-gather every chunk but ``(r + 2) % K``. So rank ``r``
sends ``b (2 n - c[(r+1) % K] - c[(r+2) % K])`` bytes, ``2 (K - 1) / K`` of the buffer when ``K``
divides ``n``, and all ranks together exactly ``2 (K - 1) n b``. Ring broadcast from ``src``: every
rank but the last of the ring (``(src - 1) % K``) sends the buffer once, ``(K - 1) n b`` in all.
Barriers and the process group's own handshakes carry no payload and are not counted.
"""
from __future__ import annotations


def ring_chunks(numel: int, world: int) -> list[int]:
    """The items in each of the ``world`` chunks of a ring collective (the first ``numel % world`` get one more)."""
    base, extra = divmod(numel, world)
    return [base + (1 if i < extra else 0) for i in range(world)]


def ring_allreduce_bytes(numel: int, element_size: int, world: int, rank: int) -> int:
    """Bytes ``rank`` sends in a ring all-reduce of ``numel`` items of ``element_size`` bytes on ``world`` ranks."""
    if world <= 1:
        return 0
    chunks = ring_chunks(numel, world)
    return element_size * (2 * numel - chunks[(rank + 1) % world] - chunks[(rank + 2) % world])


def ring_broadcast_bytes(nbytes: int, world: int, rank: int, src: int = 0) -> int:
    """Bytes ``rank`` sends in a ring broadcast of ``nbytes`` from ``src``: all of it, unless it ends the ring."""
    return 0 if world <= 1 or rank == (src - 1) % world else nbytes
