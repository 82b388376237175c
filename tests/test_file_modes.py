"""Files a run writes follow the umask like any other program's: 0644 under 022, 0600 under 077."""
from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ladle.core.files import atomic_open, write_json
from ladle.core.recipe import load_recipe
from ladle.core.storage import save_state
from ladle.soup.pipeline import soup_run
from ladle.train.launch import train_ingredients


@pytest.fixture
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test under the umask it is parametrised with, then restore the old one."""
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], indirect=True, ids=oct)
def test_atomic_writes_follow_the_umask(umask: int, tmp_path: Path) -> None:
    save_state(tmp_path / "w.safetensors", {"w": torch.ones(3)})
    write_json(tmp_path / "meta.json", {"a": 1})
    with atomic_open(tmp_path / "deep" / "notes.md", "w") as stream:
        stream.write("hello\n")
    for name in ("w.safetensors", "meta.json", "deep/notes.md"):
        assert mode(tmp_path / name) == 0o666 & ~umask, name
    assert mode(tmp_path / "deep") == 0o777 & ~umask
    assert not list(tmp_path.rglob("*.tmp"))


def test_failed_write_leaves_no_temp_file(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), atomic_open(tmp_path / "x.bin") as stream:
        stream.write(b"half")
        raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077], indirect=True, ids=oct)
def test_a_trained_and_souped_run_follows_the_umask(umask: int, data_root: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    recipe = load_recipe("cora-gcn", ["epochs=3"])
    run_dir = train_ingredients(recipe, ingredients=2, workers=1, run_dir=tmp_path / "run",
                                data_root=data_root).run_dir
    soup_run(run_dir, method="uniform", data_root=data_root)
    files = [p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    names = {p.name for p in files}
    assert {"ingredient-00.safetensors", "report.json", "report.md", "accuracy.png"} <= names, names
    assert {p.name: oct(mode(p)) for p in files} == {p.name: oct(0o666 & ~umask) for p in files}
    assert mode(run_dir) == 0o777 & ~umask
