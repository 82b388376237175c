"""Soup methods: a few lines over state dicts each, with the decision rule in the docstring, and the
registry :data:`SOUPS` from method name to the function that makes that soup.

Uniform (mean of all), greedy (Wortsman et al. 2022) and greedy interpolation (Graph Ladling) are
here; when the ingredients branched from a trunk, greedy and greedy interpolation start from the
trunk (uniform averages the ingredients alone). :mod:`ladle.learned` registers the learned soups. A
new method is one function and one :func:`register` line; ``all`` is every registered method not
registered with ``in_all=False``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ladle.checkpoints import StateDict
from ladle.evaluation import Evaluator, Metrics, Scorer, SoupResult, average


def interpolate(soup: StateDict, ingredient: StateDict, alpha: float) -> StateDict:
    """``alpha * soup + (1 - alpha) * ingredient``; alpha = 1 returns the soup, 0 the ingredient, exactly."""
    if alpha == 1.0:
        return {k: v.clone() for k, v in soup.items()}
    if alpha == 0.0:
        return {k: v.clone() for k, v in ingredient.items()}
    return average([soup, ingredient], [alpha, 1.0 - alpha])


def uniform_soup(states: Sequence[StateDict]) -> StateDict:
    """The mean of all ingredients: no decision, no evaluation."""
    return average(states)


def greedy_soup(states: Sequence[StateDict], order: Sequence[int], score: Scorer, metric: str) -> SoupResult:
    """Wortsman et al.: walk ingredients in ``order`` (best-first); add one to the running mean only if the
    validation score (``metric``) does not drop (a tie is accepted: with ``acc``, the default, this is
    the paper's rule). Starts from the first."""
    kept = [order[0]]
    best = score(states[order[0]]).key(metric)
    evaluations = 1
    for i in order[1:]:
        candidate = score(average([states[j] for j in kept + [i]]))
        evaluations += 1
        if candidate.key(metric) >= best:
            kept.append(i)
            best = candidate.key(metric)
    return SoupResult("greedy", average([states[j] for j in kept]), evaluations, kept)


def alpha_grid(points: int) -> list[float]:
    """``points`` evenly spaced values of alpha in [0, 1], both ends included."""
    return [i / (points - 1) for i in range(points)]


def search_alpha(soup: StateDict, ingredient: StateDict, score: Scorer, metric: str, grid: int,
                 fast: bool) -> tuple[float, list[tuple[float, Metrics]]]:
    """Best alpha for ``alpha * soup + (1 - alpha) * ingredient``; ties go to the larger alpha.

    ``grid``: every point of an even grid. ``fast``: a 5-point coarse grid, then halving steps around
    the best point until the step is finer than the grid's, 2 evaluations a step.
    """
    tried: dict[float, Metrics] = {}

    def measure(alpha: float) -> None:
        alpha = round(min(1.0, max(0.0, alpha)), 6)
        if alpha not in tried:
            tried[alpha] = score(interpolate(soup, ingredient, alpha))

    def best() -> float:
        return max(tried, key=lambda a: (tried[a].key(metric), a))

    if not fast:
        for alpha in alpha_grid(grid):
            measure(alpha)
        return best(), sorted(tried.items())
    for alpha in alpha_grid(5):
        measure(alpha)
    step, target = 0.25, 1.0 / (grid - 1)
    while step > target:
        step /= 2
        centre = best()
        measure(centre - step)
        measure(centre + step)
    return best(), sorted(tried.items())


def greedy_interpolation_soup(states: Sequence[StateDict], order: Sequence[int], score: Scorer, metric: str,
                              grid: int = 21, fast: bool = False) -> SoupResult:
    """Graph Ladling's GIS: start from the first in ``order`` (the best); for each next one keep
    ``alpha * soup + (1 - alpha) * ingredient`` with the alpha of best validation score. alpha = 1
    (keep the soup) is always a candidate, so the validation score never drops. ``kept``: the
    ingredients the soup contains (a step with alpha = 0 discards those before it)."""
    soup = states[order[0]]
    evaluations, alphas, curves = 0, [], []
    weights = {order[0]: 1.0}  # each ingredient's share of the soup
    for i in order[1:]:
        alpha, tried = search_alpha(soup, states[i], score, metric, grid, fast)
        evaluations += len(tried)
        alphas.append(alpha)
        curves.append([(a, m.acc, m.loss) for a, m in tried])
        soup = interpolate(soup, states[i], alpha)
        weights = {j: alpha * w for j, w in weights.items()} | {i: 1.0 - alpha}
    kept = [j for j, w in weights.items() if w > 0]
    return SoupResult("gis", soup, evaluations, kept, alphas, curves)


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class SoupInputs:
    """What a soup method may use: the ingredients, best-first order, the validation scorer and settings,
    and the trunk the ingredients branched from (``None`` without one)."""

    states: Sequence[StateDict]
    order: Sequence[int]
    score: Scorer
    metric: str
    grid: int
    fast: bool
    evaluator: Evaluator
    seed: int
    trunk: StateDict | None = None


TRUNK_INDEX = -1  # how a soup's ``kept`` names the trunk


def _trunk_first(inputs: SoupInputs, soup: Callable[[Sequence[StateDict], Sequence[int]], SoupResult]) -> SoupResult:
    """Run a sequential soup with the trunk, when there is one, as its first candidate (then the
    ingredients best-first), so a soup can only leave the trunk where validation says the branches help;
    the trunk appears in ``kept`` as :data:`TRUNK_INDEX`."""
    if inputs.trunk is None:
        return soup(inputs.states, inputs.order)
    result = soup([inputs.trunk, *inputs.states], [0, *(i + 1 for i in inputs.order)])
    result.kept = [i - 1 if i else TRUNK_INDEX for i in result.kept]
    return result


SoupMethod = Callable[[SoupInputs], SoupResult]
SOUPS: dict[str, SoupMethod] = {}
ALL: list[str] = []  # what ``--method all`` runs, in registration order


def register(name: str, *, in_all: bool = True) -> Callable[[SoupMethod], SoupMethod]:
    """Register a soup method under ``name`` (``in_all``: part of ``--method all``)."""
    def add(method: SoupMethod) -> SoupMethod:
        SOUPS[name] = method
        if in_all:
            ALL.append(name)
        return method
    return add


@register("uniform")
def _uniform(inputs: SoupInputs) -> SoupResult:
    return SoupResult("uniform", uniform_soup(inputs.states), 0, list(range(len(inputs.states))))


@register("greedy")
def _greedy(inputs: SoupInputs) -> SoupResult:
    return _trunk_first(inputs, lambda states, order: greedy_soup(states, order, inputs.score, inputs.metric))


@register("gis")
def _gis(inputs: SoupInputs) -> SoupResult:
    return _trunk_first(inputs, lambda states, order: greedy_interpolation_soup(
        states, order, inputs.score, inputs.metric, inputs.grid, inputs.fast))
