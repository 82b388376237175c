"""Console scripts: declared in pyproject, installed by pip, and the same command lines as ``python -m``."""
from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from importlib.metadata import EntryPoint, distributions
from pathlib import Path

import pytest
import tomllib
from conftest import PROJECT

SCRIPTS = {
    "ladle-train": "ladle.train.cli",
    "ladle-soup": "ladle.soup.cli",
    "ladle-prepare": "ladle.prepare",
    "ladle-varrate": "ladle.varrate.cli",
}


def declared_scripts() -> dict[str, str]:
    """``[project.scripts]`` of the project's pyproject.toml."""
    return tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]["scripts"]


def test_pyproject_declares_one_script_per_command() -> None:
    assert set(declared_scripts()) == set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_entry_point_help_matches_the_module_form(name: str, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    entry = EntryPoint(name, declared_scripts()[name], "console_scripts").load()
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exited:
        entry()
    assert exited.value.code == 0
    script_help = capsys.readouterr().out
    with pytest.raises(SystemExit):
        importlib.import_module(SCRIPTS[name]).main(["--help"])
    assert script_help.startswith("usage:") and script_help == capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("pip") is None, reason="pip is not installed in this environment")
def test_pip_installs_working_scripts(tmp_path: Path, data_root: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for folder in ("ladle", "recipes"):
        shutil.copytree(PROJECT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(PROJECT / name, source / name)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(source)], check=True, capture_output=True,
                   timeout=300)
    installed = {entry.name: entry.value for dist in distributions(path=[str(target)])
                 for entry in dist.entry_points if entry.group == "console_scripts"}
    assert installed == declared_scripts()

    env = {**os.environ, "PYTHONPATH": str(target)}
    helped = subprocess.run([str(target / "bin" / "ladle-train"), "--help"], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=300)
    assert helped.returncode == 0 and "--ingredients" in helped.stdout, helped.stderr
    missing = subprocess.run([str(target / "bin" / "ladle-soup"), "--run-dir", str(tmp_path / "none")],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert missing.returncode == 2
    assert "run directory" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1

    # the shipped recipes are package data: found from a folder with no recipes/ of its own
    listed = subprocess.run([str(target / "bin" / "ladle-train"), "--list-recipes"], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=300)
    shipped = sorted(path.stem for path in (PROJECT / "recipes").glob("*.yaml"))
    assert [line.split()[0] for line in listed.stdout.splitlines()] == shipped, listed.stderr
    assert all(str(target / "ladle" / "recipes") in line for line in listed.stdout.splitlines())
    trained = subprocess.run([str(target / "bin" / "ladle-train"), "--recipe", "default", "-k", "1", "trunk.epochs=1",
                              "epochs=1", "--data-root", str(data_root), "--run-dir", str(tmp_path / "run")],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert trained.returncode == 0, trained.stderr
    assert (tmp_path / "run" / "ingredient-00.safetensors").is_file()
