"""Training curves: metrics.csv holds one row per model-epoch that agrees with the checkpoints' JSON, survives
a resume without duplicates, TensorBoard reads the event files back, and progress bars stay quiet off a terminal."""
from __future__ import annotations

import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TRUNKLESS, run_in_process, run_module, train_until_crash

from ladle.core.errors import LadleError
from ladle.core.recipe import load_recipe
from ladle.soup.methods import chosen_methods
from ladle.soup.pipeline import planned_scorings, soup_run
from ladle.train.curves import COLUMNS, check_loggers, merge_metrics
from ladle.train.loop import train_task
from ladle.train.task import IngredientTask

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
NO_TENSORBOARD = "tensorboard is not installed (pip install 'ladle[tensorboard]')"


def rows_of(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as stream:
        reader = csv.DictReader(stream)
        assert tuple(reader.fieldnames or ()) == COLUMNS
        return list(reader)


def curve(rows: list[dict[str, str]], name: str) -> list[dict[str, str]]:
    return [row for row in rows if row["name"] == name]


def no_progress_bars(stderr: str) -> bool:
    """Whether captured stderr is free of tqdm's bars (``\\r`` redraws, ``| 3/12 [``)."""
    return "\r" not in stderr and "it/s]" not in stderr and "%|" not in stderr


@pytest.fixture(scope="module")
def cli_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """``ladle.train`` as a user runs it (stderr not a terminal): 2 ingredients and the baseline, early stopping
    on, TensorBoard too when installed."""
    run_dir = tmp_path_factory.mktemp("metrics") / "run"
    extra = ["--log", "tensorboard"] if HAS_TENSORBOARD else []
    result = run_module("ladle.train", "-k", "2", "--workers", "1", "--baseline", *TRUNKLESS, "--run-dir", str(run_dir),
                        "--data-root", str(data_root), *extra, "view.kind=saint-rw", "epochs=40", "patience=8")
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_metrics_csv_has_one_row_per_model_epoch_matching_the_json(cli_run) -> None:
    run_dir, _ = cli_run
    rows = rows_of(run_dir / "metrics.csv")
    metas = {name: json.loads((run_dir / f"{name}.json").read_text())
             for name in ("ingredient-00", "ingredient-01", "baseline")}
    assert len(rows) == sum(meta["epochs_run"] for meta in metas.values())
    assert any(meta["epochs_run"] < 40 for meta in metas.values())  # early stopping cut a curve short
    for name, meta in metas.items():
        mine = curve(rows, name)
        assert [int(row["epoch"]) for row in mine] == list(range(meta["epochs_run"]))
        assert {row["run"] for row in mine} == {run_dir.name}
        assert {row["role"] for row in mine} == {"baseline" if name == "baseline" else "ingredient"}
        assert {row["k"] for row in mine} == {"" if meta["k"] is None else str(meta["k"])}
        val = [float(row["val_acc"]) for row in mine]
        # the view validates on the whole graph: the JSON's val_acc is the CSV's best, at the best epoch
        assert max(val) == meta["view_val_acc"] == meta["val_acc"]
        assert val[meta["best_epoch"]] == meta["val_acc"] and val.index(max(val)) == meta["best_epoch"]
        losses = [float(row["train_loss"]) for row in mine]
        assert all(math.isfinite(loss) and loss > 0 for loss in losses) and losses[-1] < losses[0]
        assert {float(row["lr"]) for row in mine} == {0.01}
        seconds = [float(row["seconds"]) for row in mine]
        assert seconds == sorted(seconds) and seconds[-1] <= meta["train_seconds"]
    assert not list(run_dir.glob("metrics-*.csv"))  # the per-process files were merged, then removed


def test_progress_bars_are_quiet_off_a_terminal(cli_run, data_root: Path) -> None:
    run_dir, train = cli_run
    assert no_progress_bars(train.stderr), train.stderr[-500:]
    soup = run_module("ladle.soup", "--run-dir", str(run_dir), "--data-root", str(data_root),
                      "--method", "gis")
    assert soup.returncode == 0, soup.stderr
    assert no_progress_bars(soup.stderr), soup.stderr[-500:]


@pytest.mark.skipif(not HAS_TENSORBOARD, reason=NO_TENSORBOARD)
def test_tensorboard_event_files_read_back_as_the_csv(cli_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = cli_run
    rows = rows_of(run_dir / "metrics.csv")
    for name in ("ingredient-00", "ingredient-01", "baseline"):
        events = EventAccumulator(str(run_dir / "tensorboard-logs" / name))
        events.Reload()
        assert set(events.Tags()["scalars"]) == {"train_loss", "val_acc", "val_loss", "lr"}
        mine = curve(rows, name)
        for tag in ("train_loss", "val_acc"):
            scalars = events.Scalars(tag)
            assert [s.step for s in scalars] == [int(row["epoch"]) for row in mine]
            assert [s.value for s in scalars] == pytest.approx([float(row[tag]) for row in mine], rel=1e-6)


def test_resume_keeps_earlier_rows_and_writes_each_epoch_once(cora_data, tmp_path: Path, monkeypatch,
                                                               one_thread) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, "view.kind=saint-rw", "epochs=12", "patience=100"])
    whole = train_task(recipe, cora_data, IngredientTask(0, 2, tmp_path / "whole", "independent", 5))
    task = IngredientTask(0, 2, tmp_path / "resumed", "independent", 5)
    train_until_crash(recipe, cora_data, task, 8, monkeypatch)  # at epoch 7
    part = tmp_path / "resumed" / "metrics-ingredient-00.csv"
    assert [row["epoch"] for row in rows_of(part)] == [str(e) for e in range(7)]  # epochs 5, 6 will run again
    resumed = train_task(recipe, cora_data, task)
    assert resumed["epochs_run"] == whole["epochs_run"] == 12
    merge_metrics(tmp_path / "resumed")
    merge_metrics(tmp_path / "whole")
    again, once = rows_of(tmp_path / "resumed" / "metrics.csv"), rows_of(tmp_path / "whole" / "metrics.csv")
    assert [row["epoch"] for row in again] == [str(e) for e in range(12)]
    for column in ("train_loss", "val_acc", "val_loss"):  # resuming is bitwise, so are the curves
        assert [row[column] for row in again] == [row[column] for row in once]


def test_averaging_logs_every_trainer_and_the_average(data_root: Path, tmp_path: Path) -> None:
    extra = ["--log", "tensorboard"] if HAS_TENSORBOARD else []
    result = run_module("ladle.train", "--average-every", "4", "-k", "2", *TRUNKLESS, "--run-dir", str(tmp_path / "avg"),
                        "--data-root", str(data_root), *extra, "view.kind=random", "epochs=10")
    assert result.returncode == 0, result.stderr
    assert no_progress_bars(result.stderr), result.stderr[-500:]
    meta = json.loads((tmp_path / "avg" / "averaged.json").read_text())
    rows = rows_of(tmp_path / "avg" / "metrics.csv")
    assert len(rows) == 2 * meta["epochs_run"] == 20
    assert {(row["role"], row["k"]) for row in rows} == {("averaged", "0"), ("averaged", "1")}
    validated = [row for row in rows if row["val_acc"]]
    assert sorted({int(row["epoch"]) for row in validated}) == [3, 7, 9]  # every 4 epochs, and the last
    assert max(float(row["val_acc"]) for row in validated) == meta["val_acc"]
    if HAS_TENSORBOARD:
        assert {p.name for p in (tmp_path / "avg" / "tensorboard-logs").iterdir()} == {"averaged-00", "averaged-01"}


def test_varrate_logs_the_run_curve(data_root: Path, tmp_path: Path) -> None:
    result = run_in_process("ladle.varrate", "--ranks", "2", "--eval-every", "3", "--run-dir", str(tmp_path / "vr"),
                            "--data-root", str(data_root), "epochs=9")
    assert result.returncode == 0, result.stderr
    meta = json.loads((tmp_path / "vr" / "varrate.json").read_text())
    rows = rows_of(tmp_path / "vr" / "metrics.csv")
    assert [int(row["epoch"]) for row in rows] == list(range(meta["epochs_run"])) == list(range(9))
    assert {row["role"] for row in rows} == {"varrate"}
    assert [float(row["train_loss"]) for row in rows] == [row["loss"] for row in meta["history"]]
    assert [row["epoch"] for row in rows if row["val_acc"]] == ["2", "5", "8"]
    assert max(float(row["val_acc"]) for row in rows if row["val_acc"]) == meta["val_acc"]


def test_soup_scoring_bar_counts_every_scoring(cli_run, data_root: Path) -> None:
    run_dir, _ = cli_run
    report = soup_run(run_dir, method="all", data_root=data_root, write=False)
    scored = len(report["ingredients"]) + sum(soup["evaluations"] for soup in report["soups"]
                                              if soup["method"] in ("greedy", "gis"))
    # greedy scores its second ingredient's mix, GIS the grid but its two ends (the soup, the ingredient: known)
    assert planned_scorings(chosen_methods("all"), 2, 21, fast=False) == scored == 2 + 1 + 19
    # the fast search: 5 points, 2 per halving (steps 1/8, 1/16, 1/32 < 1/20), less the two ends; the trunk scored once
    assert planned_scorings(chosen_methods("gis"), 3, 21, fast=True, trunk=True) == 4 + 3 * (5 + 2 * 3 - 2)


def test_unknown_or_missing_logger_is_one_line_exit_2(monkeypatch) -> None:
    with pytest.raises(LadleError, match="unknown --log 'wandb'"):
        check_loggers(["wandb"])
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if TensorBoard were not installed
    with pytest.raises(LadleError, match=r"pip install 'ladle\[tensorboard\]'"):
        check_loggers(["tensorboard"])
    result = run_in_process("ladle.train", "--log", "tensorboard", "epochs=1")  # TensorBoard still hidden
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --log tensorboard needs TensorBoard: pip install "
                                                  "'ladle[tensorboard]'"]
