"""A view that fails on the graph: told from the models trained on it against the baseline, and trained again on the
whole graph by the launcher, the first models kept aside and the run's record saying why."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import STARVED_VIEW

from ladle.core.recipe import load_recipe
from ladle.core.rundir import BASELINE, CONTINUED, TRUNK, check_same_run, run_difference
from ladle.soup.pipeline import soup_run
from ladle.soup.report import format_table
from ladle.train.launch import resume_run, train_ingredients
from ladle.train.view_check import VIEW_GAP_POINTS, fallback_recipe, view_failure


def _meta(val_acc: float, on: str = "graph") -> dict[str, object]:
    return {"val_acc": val_acc, "metrics_on": on}


def test_a_view_fails_only_when_every_model_scored_on_the_whole_graph_is_far_below_the_baseline() -> None:
    recipe = load_recipe(None, ["view.kind=metis"])
    metas = {BASELINE: _meta(0.80), TRUNK: _meta(0.20), CONTINUED: _meta(0.75),
             "ingredient-00": _meta(0.95, on="part")}  # a part's own validation nodes say nothing of the graph
    failure = view_failure(recipe, metas)
    assert failure is not None and failure["best"] == CONTINUED and failure["view"] == "metis"
    assert failure["trunk_view"] == "cluster" and failure["gap_points"] == pytest.approx(5.0)
    assert failure["gap_points"] > VIEW_GAP_POINTS
    metas[CONTINUED] = _meta(0.785)  # within the gap: the short trunk's 20 % is not held against the view
    assert view_failure(recipe, metas) is None
    metas[CONTINUED] = _meta(0.75)
    assert view_failure(recipe.replace(view=recipe.view.__class__(kind="metis", fallback="none")), metas) is None
    assert view_failure(fallback_recipe(recipe), metas) is None  # the whole graph has nothing to fall back to
    assert view_failure(recipe, {TRUNK: _meta(0.2), CONTINUED: _meta(0.2)}) is None  # no baseline: nothing to tell
    fallen = fallback_recipe(load_recipe("physics-metis"))
    assert fallen.view.kind == fallen.trunk_view().kind == "full" and fallen.trunk.epochs == 100


def test_a_failed_view_is_trained_again_on_the_whole_graph(data_root: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    recipe = load_recipe(None, list(STARVED_VIEW))
    run = train_ingredients(recipe, ingredients=2, workers=1, run_dir=run_dir, baseline=True, data_root=data_root,
                            threads=1)
    assert not run.failed and run.view_fallback is not None
    failure = run.view_fallback
    assert failure["view"] == failure["trunk_view"] == "saint-rw" and failure["gap_points"] > VIEW_GAP_POINTS
    record = json.loads((run_dir / "run.json").read_text())
    assert record["asked_recipe"]["view"]["kind"] == "saint-rw" and record["recipe"]["view"]["kind"] == "full"
    assert record["view_fallback"] == failure and record["trunk"]["view"]["kind"] == "full"
    assert run_difference(record, recipe, {}) == ""  # the recipe asked for is still this run's (--resume, a rerun)
    check_same_run(run_dir, {"recipe": recipe.to_dict(), "ingredients": 2, "init": "shared", "baseline": True})
    aside = run_dir / "failed-view"
    for name in (TRUNK, CONTINUED, "ingredient-00", "ingredient-01"):  # the first models, kept aside
        first = json.loads((aside / f"{name}.json").read_text())
        assert first["view"]["kind"] == "saint-rw" and (aside / f"{name}.safetensors").is_file()
        again = json.loads((run_dir / f"{name}.json").read_text())
        assert again["view"]["kind"] == "full" and again["status"] == "done"
    assert json.loads((run_dir / "ingredient-00.json").read_text())["start"] == TRUNK
    assert not (aside / "baseline.json").exists() and run.baseline["epochs_run"] == 10  # trained once
    best_again = max(meta["val_acc"] for meta in (*run.ingredients, run.continued))
    assert best_again > failure["best_val_acc"] + 0.1  # Cora: the whole graph learns what three nodes a step do not

    again = resume_run(run_dir, workers=1, data_root=data_root)  # a finished fallback run has nothing left to do
    assert not again.failed and json.loads((run_dir / "run.json").read_text())["recipe"]["view"]["kind"] == "full"
    report = soup_run(run_dir, data_root=data_root)
    assert report["view"] == "full" and report["view_fallback"] == failure
    assert format_table(report).splitlines()[1].startswith(
        f"saint-rw failed on this graph ({failure['best']} on it validated {failure['gap_points']:.1f} points below "
        "the full-graph baseline): the launcher trained the trunk and the branches again on the whole graph")
