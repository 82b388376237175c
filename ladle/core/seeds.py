"""The one seed rule: every model a run trains draws its randomness from the run's seed and its own index."""
from __future__ import annotations


def worker_seed(base_seed: int, k: int) -> int:
    """The seed of model ``k`` of a run seeded ``base_seed``: ingredient or varrate rank ``k >= 0``, the
    baseline ``k = -1``, the trunk ``k = -2``, the trunk's continuation ``k = -3``."""
    return base_seed * 1_000 + k + 1
