"""Whether a run's view failed on its graph, and what the launcher trains instead.

A view fails when no model trained on it and scored on the whole graph (the trunk continued, and the branches of a
view that is not a partition; never the trunk, short and far below by design) does what the whole graph asks. Two
rules, either enough: each validates more than :data:`VIEW_GAP_POINTS` below the run's full-graph baseline, when it
has one (then no soup of them can be expected to reach it: a soup gains under a point over its best-validation branch
on average, bench/RESULTS.md); or each classifies fewer than :data:`VIEW_AGREEMENT_MIN` of its training nodes the same
in its batches as in the whole graph (``view_agreement``, :func:`ladle.train.loop.view_agreement`): it learned
batches unlike the graph, which needs no baseline to see. When a worker has held the whole graph (the baseline's, or
the branches' of a sampled view), the launcher then trains the trunk and the branches again on it (view ``full``,
the trunk too: :func:`fallback_recipe`), and keeps the first ones aside; else it says so.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ladle.core.recipe import PARTITION_KINDS, Recipe, ViewConfig
from ladle.core.rundir import BASELINE, TRUNK
from ladle.train.task import INGREDIENT

VIEW_GAP_POINTS = 2.0  # the best model of a view this far below the baseline on validation: the view failed
VIEW_AGREEMENT_MIN = 0.9  # below this, on every model of a view: it failed (tuning graphs 0.95-1.00, failed 0.22-0.83)


def view_failure(recipe: Recipe, metas: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """What says ``recipe``'s view failed, from the finished models' metadata by name, or None: it did not, the view
    is already ``view.fallback`` (``full``) or that is ``none``, or nothing on it was scored on the whole graph.

    Against a baseline: ``view``, the best model on it (``best``), its and the baseline's validation accuracy and
    the gap in points; else from the agreement: the model that agrees most (``best``), its ``agreement`` and the
    ``agreement_min`` it fell below."""
    if recipe.view.fallback in ("none", recipe.view.kind):
        return None
    on_graph = {name: meta for name, meta in metas.items()
                if name not in (BASELINE, TRUNK) and meta.get("metrics_on") == "graph"}
    views = {"view": recipe.view.kind, "trunk_view": recipe.trunk_view().kind}
    baseline = metas.get(BASELINE)
    scored = {name: meta["val_acc"] for name, meta in on_graph.items() if "val_acc" in meta}
    if baseline is not None and "val_acc" in baseline and scored:
        best = _best(scored)
        gap = 100 * (baseline["val_acc"] - scored[best])
        if gap > VIEW_GAP_POINTS:
            return views | {"best": best, "best_val_acc": scored[best], "baseline_val_acc": baseline["val_acc"],
                            "gap_points": gap}
    agreements = {name: meta["view_agreement"] for name, meta in on_graph.items()
                  if meta.get("view_agreement") is not None}
    if agreements:
        best = _best(agreements)
        if agreements[best] < VIEW_AGREEMENT_MIN:
            return views | {"best": best, "agreement": agreements[best], "agreement_min": VIEW_AGREEMENT_MIN}
    return None


def _best(figures: Mapping[str, float]) -> str:
    """The name with the highest figure, the first by name on a tie."""
    return max(sorted(figures), key=figures.__getitem__)


def branches_hold_the_graph(metas: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether the run's branches were scored on the whole graph (a sampled view: each worker held it), so training
    them on it instead needs no more than it had; a partition's branches hold their part alone."""
    branches = [meta for meta in metas.values() if meta.get("role") == INGREDIENT]
    return bool(branches) and all(meta.get("metrics_on") == "graph" for meta in branches)


def fallback_recipe(recipe: Recipe) -> Recipe:
    """``recipe`` with every ingredient and the trunk on ``view.fallback`` (the whole graph); all else as it was, but
    for a partition recipe's trunk (if it has one), which then trains as the baseline does (``trunk.epochs + epochs``
    at ``lr``, keeping its best): its branches only fine-tune (``branch.lr`` well under ``lr``), so the trunk is the
    model, and its epochs were counted for a view of several batches an epoch, where the whole graph makes one step."""
    trunk = dataclasses.replace(recipe.trunk, view="")
    if recipe.view.kind in PARTITION_KINDS and recipe.trunk.epochs > 0:
        trunk = dataclasses.replace(trunk, epochs=recipe.trunk.epochs + recipe.epochs, lr=recipe.lr,
                                    schedule="constant", keep="best")
    return recipe.replace(view=ViewConfig(kind=recipe.view.fallback), trunk=trunk)
