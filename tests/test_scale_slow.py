"""Slow end-to-end check at scale (``make test-slow``; skipped by default): a 100k-node graph of
ogbn-products' shape through ``ladle.prepare``, ``ladle.train`` and ``ladle.soup``, as a user runs them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TRUNKLESS, run_module

pytestmark = pytest.mark.slow

RECIPE = [*TRUNKLESS, "dataset=synthetic:nodes=100000,degree=26,features=100,classes=47", "view.kind=metis", "epochs=15",
          "patience=15"]


def test_100k_nodes_through_the_commands_soups_above_its_ingredients(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for module, args in (("ladle.prepare", [*RECIPE, "-k", "4"]),
                         ("ladle.train", [*RECIPE, "-k", "4", "--workers", "2", "--run-dir", str(run_dir)]),
                         ("ladle.soup", ["--run-dir", str(run_dir), "--method", "gis"])):
        done = run_module(module, *args, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    metas = [json.loads((run_dir / f"ingredient-{k:02d}.json").read_text()) for k in range(4)]
    assert all(meta["peak_rss_mb"] < 2048 for meta in metas), [meta["peak_rss_mb"] for meta in metas]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["validation"] == {"nodes": 10_000, "of": 10_000, "stderr": 0.0}  # under the sample size
    soup = report["soups"][0]
    assert soup["test_acc"] > report["mean_ingredient"]["test_acc"] + 0.05, report["mean_ingredient"]
    assert soup["test_acc"] >= report["best_ingredient"]["test_acc"] - 0.01, report["best_ingredient"]
