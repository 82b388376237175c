"""The command lines as a user meets them: bad input gives one line and exit code 2, no traceback."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_in_process, run_module

BAD_TRAIN_INPUTS = [
    (["--data-root", "/nonexistent/ladle-data"], "data root /nonexistent/ladle-data does not exist"),
    (["dataset=nope"], "unknown dataset 'nope'"),
    (["bogus=1"], "unknown recipe key 'bogus'"),
    (["epochs=many"], "recipe key 'epochs' must be of type int"),
    (["--ingredients", "0"], "--ingredients must be >= 1"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--ingredients", "3000", "view.kind=metis"], "cannot split 2708 nodes into 3000 parts"),
    (["--recipe", "missing-recipe"], "recipe 'missing-recipe' not found"),
]


@pytest.mark.parametrize("args, message", BAD_TRAIN_INPUTS)
def test_train_rejects_bad_input_with_one_line(data_root: Path, tmp_path: Path, args: list[str],
                                               message: str) -> None:
    extra = [] if "--data-root" in args else ["--data-root", str(data_root)]
    run = run_module if args == BAD_TRAIN_INPUTS[0][0] else run_in_process  # one as a user meets it, the rest fast
    result = run("ladle.train", *args, *extra, "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_soup_without_a_run_says_what_to_do(tmp_path: Path) -> None:
    result = run_module("ladle.soup", "--run-dir", str(tmp_path / "none"))
    assert result.returncode == 2
    assert "run directory" in result.stderr and "Traceback" not in result.stderr


def test_overrides_may_stand_anywhere_among_the_flags(data_root: Path, tmp_path: Path) -> None:
    result = run_module("ladle.train", "dataset=cora", "--ingredients", "1", "epochs=1", "trunk.epochs=0",
                        "--data-root", str(data_root), "view.kind=full", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    recipe = json.loads((tmp_path / "run" / "run.json").read_text())["recipe"]
    assert (recipe["epochs"], recipe["trunk"]["epochs"], recipe["view"]["kind"]) == (1, 0, "full")
