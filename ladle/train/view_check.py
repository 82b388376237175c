"""Whether a run's view failed on its graph, and what the launcher trains instead.

A view fails when every model trained on it and scored on the whole graph (the trunk continued, and the branches of
a view that is not a partition) validates more than :data:`VIEW_GAP_POINTS` below the run's full-graph baseline:
then no soup of them can be expected to reach it (a soup gains under a point over its best-validation branch on
average, bench/RESULTS.md). The trunk is not counted: a short trunk is far below by design. A run with a baseline
has shown that one worker holds the whole graph, so the launcher then trains the trunk and the branches again on it
(view ``full``, the trunk too), and keeps the first ones aside.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ladle.core.recipe import Recipe, ViewConfig
from ladle.core.rundir import BASELINE, TRUNK

VIEW_GAP_POINTS = 2.0  # the best model of a view this far below the baseline on validation: the view failed


def view_failure(recipe: Recipe, metas: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """What says ``recipe``'s view failed, from the finished models' metadata by name (``view``, the best model on
    it, its and the baseline's validation accuracy, the gap in points), or None: it did not, the view is already
    ``view.fallback`` (``full``) or that is ``none``, or nothing on it was scored on the whole graph beside a
    baseline."""
    baseline = metas.get(BASELINE)
    if recipe.view.fallback in ("none", recipe.view.kind) or baseline is None or "val_acc" not in baseline:
        return None
    scored = {name: meta["val_acc"] for name, meta in metas.items()
              if name not in (BASELINE, TRUNK) and meta.get("metrics_on") == "graph" and "val_acc" in meta}
    if not scored:
        return None
    best = max(sorted(scored), key=scored.__getitem__)
    gap = 100 * (baseline["val_acc"] - scored[best])
    if gap <= VIEW_GAP_POINTS:
        return None
    return {"view": recipe.view.kind, "trunk_view": recipe.trunk_view().kind, "best": best,
            "best_val_acc": scored[best], "baseline_val_acc": baseline["val_acc"], "gap_points": gap}


def fallback_recipe(recipe: Recipe) -> Recipe:
    """``recipe`` with every ingredient and the trunk on ``view.fallback`` (the whole graph); all else as it was."""
    return recipe.replace(view=ViewConfig(kind=recipe.view.fallback), trunk=dataclasses.replace(recipe.trunk, view=""))

