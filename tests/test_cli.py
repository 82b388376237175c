"""The command lines as a user meets them: bad input gives one line and exit code 2, no traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PROJECT, run_in_process, run_module

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


@pytest.mark.parametrize("module, calls, codes", [
    ("ladle.train.cli", [["bogus=1"], ["--recipe", "nope"], ["--list-recipes"]], [2, 2, 0]),
    ("ladle.prepare", [["epochs=many"], ["--list"], ["--prune", "--max-size", "1G"]], [2, 0, 0]),
])
def test_help_bad_recipes_and_the_cache_answer_before_torch_is_imported(tmp_path: Path, module: str,
                                                                        calls: list[list[str]],
                                                                        codes: list[int]) -> None:
    """``--help``, a bad recipe key or name, ``--list-recipes`` and the cache's listing and pruning need no torch
    (3-4 s of imports)."""
    script = ("import sys\n"
              "import ladle.cli\n"  # the console scripts' module too
              "from ladle.core.errors import run_cli\n"
              f"from {module} import build_parser, main\n"
              "build_parser().format_help()\n"
              f"codes = [run_cli(main, args) for args in {calls!r}]\n"
              "print(codes, [name for name in ('torch', 'torch_geometric') if name in sys.modules])\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=PROJECT, timeout=60,
                            env={**os.environ, "LADLE_CACHE": str(tmp_path / "cache")})
    assert result.stdout.strip().splitlines()[-1] == f"{codes} []", result.stdout + result.stderr


def test_a_reader_that_closes_the_pipe_ends_a_command_quietly() -> None:
    """``python -m ladle.train --list-recipes | head -0``: exit 1, nothing on stderr (no traceback, no error)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "ladle.train", "--list-recipes"], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, cwd=PROJECT, timeout=60)
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (1, "")


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
