"""A cross-fitted validation figure for each soup, the one the best soup is chosen by.

Greedy and greedy interpolation choose on validation nodes (which ingredients to keep, which alphas), so their
validation accuracy is partly fitted and favours them over a soup that chooses nothing (uniform). Here every
method runs again on one seeded half of the validation nodes and the soup it makes is scored on the other half,
then the halves swap: each validation node is scored by a soup whose choices did not see it. The soups written are
still the ones made on all the validation nodes; only the choice between them reads this figure.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ladle.nn.scoring import Metrics
from ladle.soup.evaluator import Evaluator
from ladle.soup.methods import SoupInputs, SoupMethod


def cross_fitted(methods: Sequence[SoupMethod], inputs: SoupInputs, evaluator: Evaluator) -> dict[str, Metrics]:
    """Each method's held-out validation figure: made on one half (the ingredients and the trunk scored there, the
    method run on those scores), scored on the other, both ways; accuracy and loss pooled over all the nodes."""
    halves = evaluator.folds(inputs.seed)
    held_out: dict[str, list[tuple[Metrics, int]]] = {method.name: [] for method in methods}
    for fit, judge in (halves, halves[::-1]):
        with evaluator.scoring_on(fit):
            scores = [inputs.score(state) for state in inputs.states]
            trunk_score = None if inputs.trunk is None else inputs.score(inputs.trunk)
            order = sorted(range(len(scores)), key=lambda i: scores[i].key(inputs.metric), reverse=True)
            on_half = replace(inputs, scores=scores, order=order, trunk_score=trunk_score)
            made = {method.name: method(on_half).state for method in methods}
        with evaluator.scoring_on(judge):
            for name, state in made.items():
                held_out[name].append((evaluator.validation(state), judge.numel()))
    return {name: pooled(figures) for name, figures in held_out.items()}


def pooled(figures: Sequence[tuple[Metrics, int]]) -> Metrics:
    """Accuracy and mean loss over the union of disjoint node sets, from each set's figures and size."""
    total = sum(count for _, count in figures)
    return Metrics(sum(m.acc * count for m, count in figures) / total,
                   sum(m.loss * count for m, count in figures) / total)
