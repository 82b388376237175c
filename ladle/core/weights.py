"""Weight arithmetic on state dicts: weighted means and interpolation, the one spelling of both."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch import Tensor

from ladle.core.storage import StateDict


def average(states: Sequence[StateDict], weights: Sequence[float] | None = None) -> StateDict:
    """Weighted mean of state dicts (uniform when ``weights`` is None); integer buffers from the first."""
    weights = [1.0 / len(states)] * len(states) if weights is None else list(weights)
    merged: StateDict = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            merged[key] = sum(w * s[key] for w, s in zip(weights, states))  # type: ignore[assignment]
        else:
            merged[key] = first.clone()
    return merged


def interpolate(soup: StateDict, ingredient: StateDict, alpha: float) -> StateDict:
    """``alpha * soup + (1 - alpha) * ingredient``; alpha = 1 returns the soup, 0 the ingredient, exactly."""
    if alpha == 1.0:
        return {k: v.clone() for k, v in soup.items()}
    if alpha == 0.0:
        return {k: v.clone() for k, v in ingredient.items()}
    return average([soup, ingredient], [alpha, 1.0 - alpha])


def running_mean(mean: StateDict, state: StateDict, count: int) -> StateDict:
    """The running mean after adding ``state`` as the ``count``-th term (integer buffers: the latest)."""
    if count == 1:
        return {k: v.clone() for k, v in state.items()}
    return {k: m + (state[k] - m) / count if m.is_floating_point() else state[k].clone() for k, m in mean.items()}


def distance(state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor]) -> float:
    """Euclidean distance between two models' floating-point tensors (integer buffers are skipped)."""
    if state_a.keys() != state_b.keys():
        raise ValueError(f"the states hold different tensors: {sorted(set(state_a) ^ set(state_b))}")
    total = 0.0
    for key, a in state_a.items():
        b = state_b[key]
        if a.shape != b.shape:
            raise ValueError(f"tensor {key!r} has shape {list(a.shape)} in one state and {list(b.shape)} in the other")
        if a.is_floating_point():
            total += float((a.double() - b.double()).pow(2).sum())
    return math.sqrt(total)
