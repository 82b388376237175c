"""Trunk, then branches: ingredients start from the trunk's exact weights, a run resumes across the trunk
bitwise-identically, no trunk is today's run, keys are validated, and the report shows the basin."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS, run_in_process, train_then_kill

from ladle.core.recipe import load_recipe
from ladle.core.rundir import CONTINUED, TRUNK
from ladle.core.storage import load_state, save_state
from ladle.nn.models import build_model
from ladle.soup.pipeline import soup_run
from ladle.soup.report import (
    CUT_SHARE,
    format_markdown,
    format_table,
    partition_line,
    resolution_line,
)
from ladle.train.launch import train_ingredients
from ladle.train.loop import MIN_SELECTION_NODES, plan, train_task
from ladle.train.task import INGREDIENT, IngredientTask

# A branch learning rate so small that Adam's steps vanish below float32 resolution: branches end where they start.
FROZEN_BRANCHES = ["trunk.epochs=5", "epochs=2", "branch.lr=1e-30", "branch.keep=last", "soup.method=gis"]


@pytest.fixture(scope="module")
def frozen_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three METIS-part ingredients branched from a 5-epoch trunk with vanishing branch steps, souped."""
    run_dir = tmp_path_factory.mktemp("frozen") / "run"
    # the frozen branches validate as the 5-epoch trunk does, far below the baseline: no fallback to the whole graph
    recipe = load_recipe(None, ["view.kind=metis", "view.balance=labels", "view.fallback=none", *FROZEN_BRANCHES])
    run = train_ingredients(recipe, ingredients=3, workers=1, run_dir=run_dir, baseline=True, data_root=data_root,
                            threads=1)
    assert not run.failed and run.trunk is not None
    soup_run(run_dir, data_root=data_root, test_barrier=True)
    return run_dir


def test_branches_start_from_the_trunks_exact_weights(frozen_run: Path) -> None:
    trunk, init = load_state(frozen_run / "trunk.safetensors"), load_state(frozen_run / "init.safetensors")
    assert any(not torch.equal(trunk[key], init[key]) for key in trunk), "the trunk did not train"
    for k in range(3):
        meta = json.loads((frozen_run / f"ingredient-{k:02d}.json").read_text())
        assert meta["start"] == "trunk" and meta["keep"] == "last" and meta["plan"]["lr"] == 1e-30
        state = load_state(frozen_run / f"ingredient-{k:02d}.safetensors")
        for key in trunk:
            assert torch.allclose(state[key], trunk[key], rtol=0, atol=1e-20), (k, key)
    run = json.loads((frozen_run / "run.json").read_text())
    assert run["trunk"]["epochs_run"] == 5 and run["trunk"]["peak_rss_mb"] > 0 and run["trunk"]["train_seconds"] > 0
    assert run["trunk"]["view"]["kind"] == "cluster"  # derived for a partition recipe
    baseline = json.loads((frozen_run / "baseline.json").read_text())
    assert baseline["plan"]["epochs"] == 5 + 2  # the same total epochs as trunk + branches


def test_report_gives_the_barrier_of_every_step_and_the_distances(frozen_run: Path) -> None:
    report = json.loads((frozen_run / "report.json").read_text())
    basin = report["basin"]
    assert basin["start"] == "trunk" and len(basin["steps"]) == 3  # the trunk first, then every ingredient
    assert all(step["barrier"] == 0.0 for step in basin["steps"])  # one model three times: no sag anywhere
    assert all(step["test_barrier"] == 0.0 for step in basin["steps"]) and basin["max_test_barrier"] == 0.0
    assert all(row["from_trunk"] < 1e-12 for row in basin["distances"])
    gis = next(soup for soup in report["soups"] if soup["method"] == "gis")
    assert gis["kept"][0] == "trunk"
    markdown = (frozen_run / "report.md").read_text()
    assert "## Basin" in markdown and "| step | ingredient | alpha | barrier | test barrier |" in markdown
    assert ("one basin: every interpolation step's barrier is <= 1 point (largest 0.0; on the test nodes, along the "
            "same path, the largest is 0.0)") in markdown
    assert "| soup | test | mean ingredient | best ingredient | trunk | ensemble |" in markdown
    assert "| trunk (ref) |" in markdown and "distance from trunk" in markdown


def test_the_report_gives_the_share_of_edges_the_parts_cut(frozen_run: Path, cora_data) -> None:
    report = json.loads((frozen_run / "report.json").read_text())
    parts = load_state(frozen_run / "partition.safetensors")["parts"]
    src, dst = cora_data.edge_index
    cut = int((parts[src] != parts[dst]).sum())
    assert report["partition"] == {"parts": 3, "edges": cora_data.num_edges, "cut_edges": cut, "halo": 0}
    share = cut / cora_data.num_edges
    assert f"Partition: the 3 parts cut {share:.0%} of the graph's {cora_data.num_edges:,} edges (halo 0)." in (
        frozen_run / "report.md").read_text()
    noted = [line for line in format_table(report).splitlines() if line.startswith("note: the 3 parts cut")]
    assert len(noted) == (share > CUT_SHARE)  # the table notes it only where the parts cut most edges
    dense = {**report, "partition": {"parts": 8, "edges": 181908, "cut_edges": 157270, "halo": 0}}
    assert ("note: the 8 parts cut 86% of the graph's 181,908 edges (halo 0); each branch trained on its part without "
            "the edges that leave it (view.halo adds its in-neighbours)") in format_table(dense).splitlines()
    assert partition_line({**report, "partition": None}) == ""


def test_the_report_says_what_one_test_node_is_worth(frozen_run: Path, cora_data) -> None:
    report = json.loads((frozen_run / "report.json").read_text())
    assert report["test_nodes"] == int(cora_data.test_mask.sum()) == 1000
    assert resolution_line(report) == "" and "one node" not in format_table(report)  # Cora: 0.1 points a node
    webkb = {**report, "test_nodes": 37, "validation": {**report["validation"], "of": 59}}
    note = ("note: the test split has 37 nodes, one node 2.7 points of accuracy (validation: 59 nodes, 1.7 points): a "
            "difference of a node or two between models is no measurement")
    assert note in format_table(webkb).splitlines() and note in format_markdown(webkb).splitlines()
    assert resolution_line({**report, "test_nodes": 201}) == "" and resolution_line({**report, "test_nodes": 200})


def test_no_trunk_is_todays_run(data_root: Path, tmp_path: Path) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, "view.kind=full", "epochs=3", "soup.method=gis"])
    run = train_ingredients(recipe, ingredients=2, workers=1, run_dir=tmp_path / "run", data_root=data_root,
                            threads=1)
    assert run.trunk is None and not (tmp_path / "run" / "trunk.safetensors").exists()
    assert "trunk" not in json.loads((tmp_path / "run" / "run.json").read_text())
    meta = run.ingredients[0]
    assert meta["start"] == "shared" and meta["keep"] == "best"
    assert meta["plan"] == {"epochs": 3, "lr": 0.01, "schedule": "constant", "keep": "best", "patience": 100,
                            "warmup": 0}
    report = soup_run(tmp_path / "run", data_root=data_root)
    assert report["basin"]["start"] == "init" and len(report["basin"]["steps"]) == 1
    assert report["basin"]["max_test_barrier"] is None and "test_barrier" not in report["basin"]["steps"][0]  # only when asked
    assert all(ref["name"] != "trunk" for ref in report["references"])
    best = max(report["ingredients"], key=lambda row: (row["val_acc"], -row["val_loss"]))["name"]
    assert report["soups"][0]["kept"][0] == best


def test_branch_warmup_rises_linearly_into_the_schedule_for_branches_and_the_trunk_continued(tmp_path: Path) -> None:
    recipe = load_recipe(None, ["branch.warmup=4", "branch.schedule=cos", "epochs=100", "lr=0.01"])
    for role in (INGREDIENT, CONTINUED):
        schedule = plan(recipe, IngredientTask(0 if role == INGREDIENT else None, 2, tmp_path, "shared", role=role))
        assert [schedule.lr_at(epoch) for epoch in range(4)] == pytest.approx(
            [0.005 * (1 + math.cos(math.pi * e / 100)) * (e + 1) / 5 for e in range(4)])
        assert schedule.lr_at(4) == pytest.approx(0.005 * (1 + math.cos(math.pi * 4 / 100)))
    assert plan(recipe, IngredientTask(None, 2, tmp_path, "shared", role=TRUNK)).lr_at(0) == 0.01  # not the trunk


def test_a_cosine_trunk_decays_to_zero_over_its_own_epochs(tmp_path: Path) -> None:
    recipe = load_recipe(None, ["trunk.epochs=20", "trunk.lr=0.02", "trunk.schedule=cos", "epochs=100"])
    trunk = plan(recipe, IngredientTask(None, 2, tmp_path, "shared", role=TRUNK))
    assert [trunk.lr_at(epoch) for epoch in (0, 10, 19)] == pytest.approx(
        [0.02, 0.01, 0.01 * (1 + math.cos(math.pi * 19 / 20))])
    assert plan(recipe, IngredientTask(0, 2, tmp_path, "shared")).lr_at(19) == 0.01  # branches keep their own


def test_the_baseline_trains_beside_the_trunk_and_outlives_its_failure(data_root: Path, tmp_path: Path) -> None:
    """The baseline needs no trunk, so it trains beside it: a trunk that fails (a NaN loss) stops the branches, not
    the baseline."""
    recipe = load_recipe(None, ["trunk.epochs=3", "trunk.lr=1e30", "epochs=2"])
    run = train_ingredients(recipe, ingredients=2, workers=1, run_dir=tmp_path / "run", baseline=True,
                            data_root=data_root, threads=1)
    assert run.failed == [TRUNK] and not run.ingredients and run.trunk is None
    assert run.baseline is not None and run.baseline["status"] == "done" and run.baseline["epochs_run"] == 5
    assert json.loads((tmp_path / "run" / "trunk.json").read_text())["status"] == "failed"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["failed"] == [TRUNK]


def test_the_branches_start_once_the_trunk_is_done_while_the_baseline_trains(data_root: Path, tmp_path: Path) -> None:
    """With two workers the baseline (1 + 300 full-graph epochs) trains beside the 1-epoch trunk, and the branches
    do not wait for it: they start on the trunk's worker as soon as the trunk has finished."""
    recipe = load_recipe(None, ["trunk.epochs=1", "epochs=300", "patience=300", "view.kind=full"])
    run = train_ingredients(recipe, ingredients=1, workers=2, run_dir=tmp_path / "run", baseline=True,
                            data_root=data_root, threads=1)
    assert not run.failed and run.baseline is not None and run.trunk is not None
    first_branch = min(meta["started_at"] for meta in [*run.ingredients, run.continued])
    assert run.trunk["ended_at"] <= first_branch < run.baseline["ended_at"]


def test_a_part_with_few_validation_nodes_keeps_its_last_weights(cora_data, tmp_path: Path) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, "view.kind=metis", "epochs=3", "patience=1"])
    torch.manual_seed(recipe.seed)
    save_state(tmp_path / "init.safetensors", build_model(recipe, cora_data.num_features, 7).state_dict())
    meta = train_task(recipe, cora_data, IngredientTask(0, 16, tmp_path, "shared"))  # about 31 val nodes
    assert meta["view_val_nodes"] < MIN_SELECTION_NODES
    assert meta["keep"] == "last" and f"< {MIN_SELECTION_NODES}" in meta["keep_reason"]
    assert meta["epochs_run"] == 3  # no early stopping without selection


@pytest.mark.parametrize("override, message", [
    ("trunk.keep=swa", "trunk.keep must be one of best, last; got 'swa'"),
    ("trunk.view=metis", "trunk.view must be empty (derived) or one of full, cluster"),
    ("trunk.epochs=-1", "trunk.epochs must be >= 0 (0 = no trunk), got -1"),
    ("branch.schedule=linear", "branch.schedule must be one of constant, cos; got 'linear'"),
    ("trunk.schedule=step", "trunk.schedule must be one of constant, cos; got 'step'"),
    ("branch.keep=first", "branch.keep must be one of best, last, swa; got 'first'"),
    ("branch.lr=0", "branch.lr must be finite and > 0"),
    ("branch.warmup=-1", "branch.warmup must be >= 0 epochs, got -1"),
    ("branch.distill=-1", "branch.distill must be finite and >= 0, got -1"),
    ("trunk.depth=2", "unknown recipe key 'trunk.depth'"),
])
def test_bad_trunk_and_branch_keys_exit_2_naming_the_key(override: str, message: str, tmp_path: Path) -> None:
    result = run_in_process("ladle.train", override, "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_independent_init_with_a_trunk_is_refused(tmp_path: Path) -> None:
    result = run_in_process("ladle.train", "trunk.epochs=5", "--independent-init", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "--independent-init contradicts trunk.epochs > 0" in result.stderr


TRUNK_ARGS = ["--ingredients", "2", "--workers", "1", "--save-every", "5", "view.kind=cluster", "trunk.epochs=12",
              "epochs=4", "branch.schedule=cos", "branch.keep=swa"]


def test_sigkill_in_the_trunk_then_resume_is_bitwise_identical(data_root: Path, tmp_path: Path) -> None:
    reference = run_in_process("ladle.train", *TRUNK_ARGS, "--data-root", str(data_root), "--run-dir",
                               str(tmp_path / "reference"))  # only the killed run needs a process of its own
    assert reference.returncode == 0, reference.stderr
    run_dir = tmp_path / "killed"
    train_then_kill([*TRUNK_ARGS, "--data-root", str(data_root)], run_dir, "trunk.progress.safetensors")
    assert not (run_dir / "trunk.safetensors").exists()
    resumed = run_in_process("ladle.train", "--resume", "--run-dir", str(run_dir), "--data-root", str(data_root))
    assert resumed.returncode == 0, resumed.stderr
    for name in ("trunk", "ingredient-00", "ingredient-01"):
        expected = load_state(tmp_path / "reference" / f"{name}.safetensors")
        actual = load_state(run_dir / f"{name}.safetensors")
        assert all(torch.equal(expected[key], actual[key]) for key in expected), name
        assert not (run_dir / f"{name}.progress.safetensors").exists()
    assert json.loads((run_dir / "run.json").read_text())["trunk"]["epochs_run"] == 12

    # A finished trunk is reused, not retrained: drop one ingredient and resume.
    trunk_written = (run_dir / "trunk.safetensors").stat().st_mtime_ns
    for suffix in (".safetensors", ".json"):
        (run_dir / f"ingredient-01{suffix}").unlink()
    again = run_in_process("ladle.train", "--resume", "--run-dir", str(run_dir), "--data-root", str(data_root))
    assert again.returncode == 0, again.stderr
    assert (run_dir / "trunk.safetensors").stat().st_mtime_ns == trunk_written
    expected = load_state(tmp_path / "reference" / "ingredient-01.safetensors")
    actual = load_state(run_dir / "ingredient-01.safetensors")
    assert all(torch.equal(expected[key], actual[key]) for key in expected)
