"""Whether ingredients sit in one basin: the barrier along an interpolation path, and distances in weight space.

Weight averaging helps only when the validation accuracy stays up along the straight line between
the models (linear mode connectivity). The barrier measures how far it sags below the chord between
the path's ends; distances from the shared initial weights and from the soup say how far apart
training took the ingredients.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ladle.core.weights import distance, interpolate

State = Mapping[str, Tensor]


def barrier(alphas: Sequence[float], values: Sequence[float]) -> float:
    """The largest sag, in points, of an accuracy curve below the straight line between its two ends (>= 0).

    ``values[i]`` is the accuracy (a fraction in [0, 1]) at interpolation weight ``alphas[i]``; the
    ends are the smallest and largest alpha. A curve on or above its chord has barrier 0.
    """
    if len(alphas) != len(values):
        raise ValueError(f"barrier needs one value per alpha, got {len(alphas)} alphas and {len(values)} values")
    if len(alphas) < 2:
        raise ValueError(f"barrier needs at least 2 points on the path, got {len(alphas)}")
    alpha = torch.tensor(alphas, dtype=torch.float64)
    value = torch.tensor(values, dtype=torch.float64)
    order = torch.argsort(alpha)
    alpha, value = alpha[order], value[order]
    if bool((alpha.diff() == 0).any()):
        raise ValueError("barrier needs distinct alphas")
    fraction = (alpha - alpha[0]) / (alpha[-1] - alpha[0])
    chord = value[0] + fraction * (value[-1] - value[0])
    return max(0.0, 100 * float((chord - value).max()))


def path_barriers(path: Sequence[State], kept_alphas: Sequence[float], tried: Sequence[Sequence[float]],
                  accuracy: Callable[[State], float]) -> list[float]:
    """The barrier of each step of a greedy-interpolation path by another figure than the one that chose it (e.g.
    accuracy on the test nodes, whose thousands of nodes resolve a sag that a few hundred validation nodes do not).

    ``path``: the path's start, then each step's ingredient; ``tried[i]``: the alphas step ``i`` scored; the soup
    after step ``i`` is ``kept_alphas[i] * soup + (1 - kept_alphas[i]) * ingredient``.
    """
    soup, barriers = path[0], []
    for ingredient, kept, alphas in zip(path[1:], kept_alphas, tried):
        barriers.append(barrier(alphas, [accuracy(interpolate(soup, ingredient, alpha)) for alpha in alphas]))
        soup = interpolate(soup, ingredient, kept)
    return barriers


def ingredient_distances(inits: Sequence[State], soup: State, ingredients: Sequence[State]) -> list[dict[str, float]]:
    """Per ingredient, in order: its distance from the weights it started from (``from_init``: ``inits``, one per
    ingredient) and from the soup (``from_soup``)."""
    return [{"from_init": distance(state, start), "from_soup": distance(state, soup)}
            for state, start in zip(ingredients, inits, strict=True)]
