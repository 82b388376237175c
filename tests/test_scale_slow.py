"""Slow end-to-end check at scale (``make test-slow``; skipped by default): a 100k-node graph through
prepare, partition ingredients and the soup, as a user would run it."""
from __future__ import annotations

from pathlib import Path

import pytest

from ladle.config import load_recipe
from ladle.launch import train_ingredients
from ladle.soup import soup_run

pytestmark = pytest.mark.slow

SYNTHETIC = "synthetic:nodes=100000,degree=10,features=64,classes=10"


def test_100k_nodes_partition_run_soups_above_its_ingredients(tmp_path: Path) -> None:
    recipe = load_recipe(None, [f"dataset={SYNTHETIC}", "view.kind=metis", "epochs=15"])
    run = train_ingredients(recipe, ingredients=4, workers=2, run_dir=tmp_path / "run", save_every=0)
    assert not run.failed
    assert all(meta["peak_rss_mb"] < 2048 for meta in run.ingredients), run.summary_table()
    report = soup_run(run.run_dir, method="gis", search="fast")
    soup = report["soups"][0]
    assert soup["test_acc"] > report["mean_ingredient"]["test_acc"] + 0.05, report["mean_ingredient"]
