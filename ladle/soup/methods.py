"""Soup methods: a few lines over state dicts each, with the decision rule in the docstring, and the
registry :data:`SOUPS` from method name to the function that makes that soup.

Uniform (mean of all), greedy (Wortsman et al. 2022) and greedy interpolation (Graph Ladling) are
here; when the ingredients branched from a trunk, greedy and greedy interpolation start from the
trunk (uniform averages the ingredients alone). :mod:`ladle.soup.learned` registers the learned soups.
A new method is one function and one :func:`register` line with its traits; its name is written there
only; ``all`` is every method registered with ``in_all``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ladle.core.errors import LadleError
from ladle.core.storage import StateDict
from ladle.core.weights import average
from ladle.nn.scoring import Metrics
from ladle.soup.evaluator import (
    AlphaScorer,
    Evaluator,
    Interpolation,
    Scorer,
    SoupResult,
)


def uniform_soup(states: Sequence[StateDict]) -> StateDict:
    """The mean of all ingredients: no decision, no evaluation."""
    return average(states)


def greedy_soup(states: Sequence[StateDict], order: Sequence[int], score: Scorer, metric: str,
                scores: Sequence[Metrics] | None = None) -> SoupResult:
    """Wortsman et al.: walk ingredients in ``order`` (best-first); add one to the running mean only if the
    validation score (``metric``) does not drop (a tie is accepted: with ``acc``, the default, this is
    the paper's rule). Starts from the first. ``scores``: each state's score by ``score``, when already known."""
    kept = [order[0]]
    best = (score(states[order[0]]) if scores is None else scores[order[0]]).key(metric)
    evaluations = int(scores is None)
    for i in order[1:]:
        candidate = score(average([states[j] for j in kept + [i]]))
        evaluations += 1
        if candidate.key(metric) >= best:
            kept.append(i)
            best = candidate.key(metric)
    return SoupResult(average([states[j] for j in kept]), evaluations, kept, order=list(order))


def alpha_grid(points: int) -> list[float]:
    """``points`` evenly spaced values of alpha in [0, 1], both ends included."""
    return [i / (points - 1) for i in range(points)]


def search_alpha(score: AlphaScorer, metric: str, grid: int, fast: bool,
                 known: dict[float, Metrics] | None = None) -> tuple[float, list[tuple[float, Metrics]]]:
    """Best alpha for ``alpha * soup + (1 - alpha) * ingredient`` (``score``: of each alpha); ties go to the
    larger alpha.

    ``grid``: every point of an even grid. ``fast``: a 5-point coarse grid, then halving steps around
    the best point until the step is finer than the grid's, 2 evaluations a step. ``known``: scores already
    measured (alpha = 1: the soup, 0: the ingredient), taken as they are.
    """
    tried: dict[float, Metrics] = dict(known or {})

    def measure(alpha: float) -> None:
        alpha = round(min(1.0, max(0.0, alpha)), 6)
        if alpha not in tried:
            tried[alpha] = score(alpha)

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


def greedy_interpolation_soup(states: Sequence[StateDict], order: Sequence[int], interpolation: Interpolation,
                              metric: str, grid: int = 21, fast: bool = False,
                              scores: Sequence[Metrics] | None = None) -> SoupResult:
    """Graph Ladling's GIS: start from the first in ``order`` (the best); for each next one keep
    ``alpha * soup + (1 - alpha) * ingredient`` with the alpha of best validation score. alpha = 1
    (keep the soup) is always a candidate, so the validation score never drops. ``kept``: the
    ingredients the soup contains (a step with alpha = 0 discards those before it). ``scores``: each
    state's validation score, when already known: a step then scores neither end again (alpha = 1 is the
    soup so far, 0 the ingredient, exactly). The next soup is the kept mix's weights, from ``interpolation``'s
    mixes (which may carry what they know of them to the next step)."""
    soup = states[order[0]]
    current = None if scores is None else scores[order[0]]
    evaluations, alphas, curves = 0, [], []
    weights = {order[0]: 1.0}  # each ingredient's share of the soup
    for i in order[1:]:
        known = {} if scores is None or current is None else {0.0: scores[i], 1.0: current}
        mixes = interpolation(soup, states[i])
        alpha, tried = search_alpha(mixes.score, metric, grid, fast, known)
        evaluations += len(tried) - len(known)
        alphas.append(alpha)
        curves.append([(a, m.acc, m.loss) for a, m in tried])
        current = dict(tried)[alpha]
        soup = mixes.weights(alpha)
        weights = {j: alpha * w for j, w in weights.items()} | {i: 1.0 - alpha}
    kept = [j for j, w in weights.items() if w > 0]
    return SoupResult(soup, evaluations, kept, alphas, curves, order=list(order))


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class SoupInputs:
    """What a soup method may use: the ingredients, their validation scores and best-first order, the validation
    scorer (of weights, and of the mixes of two weights: ``interpolation``) and settings, and the trunk the
    ingredients branched from with its score (``None`` without one)."""

    states: Sequence[StateDict]
    scores: Sequence[Metrics]
    order: Sequence[int]
    score: Scorer
    interpolation: Interpolation
    metric: str
    grid: int
    fast: bool
    evaluator: Evaluator
    seed: int
    trunk: StateDict | None = None
    trunk_score: Metrics | None = None


TRUNK_INDEX = -1  # how a soup's ``kept`` names the trunk


Sequential = Callable[[Sequence[StateDict], Sequence[int], Sequence[Metrics]], SoupResult]  # (states, order, scores)


def _trunk_first(inputs: SoupInputs, soup: Sequential) -> SoupResult:
    """Run a sequential soup with the trunk, when there is one, as its first candidate (then the
    ingredients best-first), so a soup can only leave the trunk where validation says the branches help;
    the trunk appears in ``kept`` and ``order`` as :data:`TRUNK_INDEX`. Measured against the trunk ranked among
    the ingredients by validation (bench/RESULTS.md, *Greedy soups that start from the trunk*)."""
    if inputs.trunk is None:
        return soup(inputs.states, inputs.order, inputs.scores)
    trunk_score = inputs.score(inputs.trunk) if inputs.trunk_score is None else inputs.trunk_score
    result = soup([inputs.trunk, *inputs.states], [0, *(i + 1 for i in inputs.order)], [trunk_score, *inputs.scores])
    result.kept, result.order = ([i - 1 if i else TRUNK_INDEX for i in indices]
                                 for indices in (result.kept, result.order))
    return result


Planner = Callable[[int, int, bool], int]  # (candidates, grid points, fast search) -> validation scorings


@dataclass(frozen=True)
class SoupMethod:
    """A registered soup method and its traits, read by the CLI, the pipeline and the report.

    ``in_all``: part of ``--method all``. ``inference_only``: scores candidates by whole-graph inference
    alone (no validation neighbourhood built), so it runs on a graph scored layer-wise. ``layerwise``: it
    never builds the validation neighbourhood (for graphs where that does not fit). ``fitted``: its
    weights are fitted on validation nodes, so a validation figure does not choose it as the best soup.
    ``scorings``: validation scorings it plans, for the progress bar (0 when it scores none here).
    ``scales``: cheap enough to stay in ``all`` on a large graph (:func:`scaled_methods`).
    """

    name: str
    make: Callable[[SoupInputs], SoupResult]
    in_all: bool = True
    inference_only: bool = False
    layerwise: bool = False
    fitted: bool = False
    scorings: Planner = lambda candidates, grid, fast: 0
    scales: bool = True

    def __call__(self, inputs: SoupInputs) -> SoupResult:
        result = self.make(inputs)
        result.method = self.name
        return result


SOUPS: dict[str, SoupMethod] = {}  # every method by name, in registration order
ALL_METHODS = "all"  # the --method value that runs every method registered with in_all


def register(name: str, **traits: Any) -> Callable[[Callable[[SoupInputs], SoupResult]], SoupMethod]:
    """Register a soup method under ``name`` with its traits (see :class:`SoupMethod`)."""
    def add(make: Callable[[SoupInputs], SoupResult]) -> SoupMethod:
        SOUPS[name] = SoupMethod(name, make, **traits)
        return SOUPS[name]
    return add


def method_names() -> list[str]:
    """What ``--method`` and ``soup.method`` accept."""
    return [*SOUPS, ALL_METHODS]


def chosen_methods(method: str) -> list[SoupMethod]:
    """The methods ``method`` names (``all``: every one registered with ``in_all``); an unknown name is refused."""
    if method == ALL_METHODS:
        return [soup for soup in SOUPS.values() if soup.in_all]
    if method not in SOUPS:
        raise LadleError(f"unknown soup method {method!r} (one of: {', '.join(method_names())})")
    return [SOUPS[method]]


def scaled_methods(methods: list[SoupMethod]) -> tuple[list[SoupMethod], list[str]]:
    """``all`` on a large graph: the methods that do not scale left out; return the rest and the names left out."""
    return [soup for soup in methods if soup.scales], [soup.name for soup in methods if not soup.scales]


def alpha_searches(grid: int, fast: bool) -> int:
    """Scorings of one alpha search: ``grid`` points, or the fast search's 5 points and 2 per halving of the step,
    less its two ends (already scored)."""
    halvings, step = 0, 0.25
    while step > 1.0 / (grid - 1):
        step, halvings = step / 2, halvings + 1
    return (5 + 2 * halvings if fast else grid) - 2


@register("uniform", inference_only=True)
def _uniform(inputs: SoupInputs) -> SoupResult:
    return SoupResult(uniform_soup(inputs.states), 0, list(range(len(inputs.states))))


@register("greedy", inference_only=True, scorings=lambda candidates, grid, fast: candidates - 1)
def _greedy(inputs: SoupInputs) -> SoupResult:
    return _trunk_first(inputs, lambda states, order, scores: greedy_soup(states, order, inputs.score, inputs.metric,
                                                                          scores))


@register("gis", inference_only=True,
          scorings=lambda candidates, grid, fast: (candidates - 1) * alpha_searches(grid, fast))
def _gis(inputs: SoupInputs) -> SoupResult:
    return _trunk_first(inputs, lambda states, order, scores: greedy_interpolation_soup(
        states, order, inputs.interpolation, inputs.metric, inputs.grid, inputs.fast, scores))
