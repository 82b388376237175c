"""Lose nothing, run nothing foreign: pickle refusal, atomic writes, resume after SIGKILL, bad inputs."""
from __future__ import annotations

import errno
import os
import pathlib
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS, run_in_process, train_then_kill

from ladle.core.errors import LadleError
from ladle.core.files import read_json, write_json
from ladle.core.storage import load_state, save_state


class _Payload:
    """Unpickling this would create ``marker``: the classic code-execution checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_pickle_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    checkpoint = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(2), "payload": _Payload(marker)}, checkpoint)
    assert not marker.exists()
    with pytest.raises(LadleError, match="refused to load"):
        load_state(checkpoint)
    assert not marker.exists()


def test_plain_weights_only_pt_still_loads(tmp_path: Path) -> None:
    torch.save({"weight": torch.ones(3)}, tmp_path / "ok.pt")
    assert torch.equal(load_state(tmp_path / "ok.pt")["weight"], torch.ones(3))


def test_failed_write_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "weights.safetensors"
    save_state(target, {"w": torch.ones(4)})

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(LadleError, match="disk full"):
        save_state(target, {"w": torch.zeros(4)})
    with pytest.raises(LadleError, match="disk full"):
        write_json(tmp_path / "meta.json", {"a": 1})
    monkeypatch.undo()
    assert torch.equal(load_state(target)["w"], torch.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.safetensors"]  # no temp files left


TRAIN_ARGS = ["--ingredients", "2", "--workers", "1", "--save-every", "5", *TRUNKLESS, "view.kind=saint-rw", "epochs=20",
              "patience=20"]


def test_sigkill_then_resume_is_bitwise_identical(data_root: Path, tmp_path: Path) -> None:
    reference = run_in_process("ladle.train", *TRAIN_ARGS, "--data-root", str(data_root), "--run-dir",
                               str(tmp_path / "reference"))  # only the killed run needs a process of its own
    assert reference.returncode == 0, reference.stderr
    run_dir = tmp_path / "killed"
    train_then_kill([*TRAIN_ARGS, "--data-root", str(data_root)], run_dir, "ingredient-00.progress.safetensors")
    assert not (run_dir / "ingredient-01.safetensors").exists()
    resumed = run_in_process("ladle.train", "--resume", "--run-dir", str(run_dir), "--data-root", str(data_root))
    assert resumed.returncode == 0, resumed.stderr
    for name in ("ingredient-00", "ingredient-01"):
        expected = load_state(tmp_path / "reference" / f"{name}.safetensors")
        actual = load_state(run_dir / f"{name}.safetensors")
        assert all(torch.equal(expected[key], actual[key]) for key in expected), name
        assert not (run_dir / f"{name}.progress.safetensors").exists()


def test_resume_of_a_finished_run_trains_nothing(data_root: Path, tmp_path: Path) -> None:
    first = run_in_process("ladle.train", "--ingredients", "1", *TRUNKLESS, "epochs=3", "--data-root", str(data_root),
                           "--run-dir", str(tmp_path / "run"))
    assert first.returncode == 0, first.stderr
    before = (tmp_path / "run" / "ingredient-00.safetensors").stat().st_mtime_ns
    again = run_in_process("ladle.train", "--resume", "--run-dir", str(tmp_path / "run"), "--data-root",
                           str(data_root))
    assert again.returncode == 0 and (tmp_path / "run" / "ingredient-00.safetensors").stat().st_mtime_ns == before


def test_run_json_records_the_libraries_and_a_resume_with_others_says_so(data_root: Path, tmp_path: Path) -> None:
    import torch_geometric

    run_dir = tmp_path / "run"
    first = run_in_process("ladle.train", "--ingredients", "1", *TRUNKLESS, "epochs=3", "--data-root", str(data_root),
                           "--run-dir", str(run_dir))
    assert first.returncode == 0, first.stderr
    run = read_json(run_dir / "run.json")
    assert run["versions"]["torch"] == torch.__version__
    assert run["versions"]["torch-geometric"] == torch_geometric.__version__
    write_json(run_dir / "run.json", run | {"versions": run["versions"] | {"torch": "0.0.1"}})
    (run_dir / "ingredient-00.safetensors").unlink()  # something left to train
    resumed = run_in_process("ladle.train", "--resume", "--run-dir", str(run_dir), "--data-root", str(data_root))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming with other libraries than the run started with (torch 0.0.1 -> {torch.__version__})" in \
        resumed.stderr


def test_a_resume_trains_with_the_recorded_threads_whatever_workers_says(data_root: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's thread count changes its floats, so a resume keeps the run's (``run.json``'s ``threads``), not
    cores / the new ``--workers``."""
    from ladle.core.recipe import load_recipe
    from ladle.train.launch import resume_run, train_ingredients

    monkeypatch.setattr("ladle.train.launch.available_cores", lambda: 2)
    run = train_ingredients(load_recipe(None, [*TRUNKLESS, "view.kind=full", "epochs=2"]), ingredients=2, workers=1,
                            run_dir=tmp_path / "run", data_root=data_root)
    assert read_json(run.run_dir / "run.json")["threads"] == 2
    (run.run_dir / "ingredient-01.json").unlink()
    resume_run(run.run_dir, workers=2, data_root=data_root)
    assert read_json(run.run_dir / "ingredient-01.json")["threads"] == 2  # cores // workers would be 1
    with pytest.raises(LadleError, match="--workers must be >= 1, got 0"):
        resume_run(run.run_dir, workers=0, data_root=data_root)


def test_a_resume_that_retrains_only_the_trunk_prepares_its_pruned_shards(data_root: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from ladle.core.recipe import load_recipe
    from ladle.train.launch import resume_run, train_ingredients

    monkeypatch.setenv("LADLE_CACHE", str(tmp_path / "cache"))
    run = train_ingredients(load_recipe(None, ["view.kind=full", "trunk.epochs=2", "epochs=2"]), ingredients=1,
                            workers=1, run_dir=tmp_path / "run", data_root=data_root)
    trunk = run.run_dir / "trunk.safetensors"
    trunk.write_bytes(trunk.read_bytes()[:100])
    shutil.rmtree((run.run_dir / "shards").resolve())  # the cache entry pruned
    resume_run(run.run_dir, data_root=data_root)
    assert load_state(trunk) and read_json(run.run_dir / "trunk.json")["status"] == "done"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_run_resumed_without_cuda_is_one_line(data_root: Path, tmp_path: Path) -> None:
    from ladle.core.recipe import load_recipe
    from ladle.train.launch import resume_run, train_ingredients

    run = train_ingredients(load_recipe(None, [*TRUNKLESS, "view.kind=full", "epochs=1"]), ingredients=1, workers=1,
                            run_dir=tmp_path / "run", data_root=data_root)
    write_json(run.run_dir / "run.json", read_json(run.run_dir / "run.json") | {"device": "cuda"})
    (run.run_dir / "ingredient-00.json").unlink()
    with pytest.raises(LadleError, match="--device cuda but no CUDA device is visible"):
        resume_run(run.run_dir, data_root=data_root)


def test_nan_loss_fails_that_ingredient_and_keeps_the_run(data_root: Path, tmp_path: Path) -> None:
    from ladle.core.recipe import load_recipe
    from ladle.train.launch import train_ingredients

    run = train_ingredients(load_recipe(None, [*TRUNKLESS, "view.kind=full", "epochs=5", "lr=1.0e+30"]), ingredients=2,
                            workers=1, run_dir=tmp_path / "run", data_root=data_root)
    assert run.failed == ["ingredient-00", "ingredient-01"]
    assert "FloatingPointError" in (tmp_path / "run" / "ingredient-00.json").read_text()


BAD_INPUTS = [
    ("malformed YAML", ["--recipe", "{broken}"], "is not valid YAML"),
    ("run dir not writable", ["--run-dir", "{file}/run"], "cannot create run directory"),
    ("truncated checkpoint", ["soup", "{truncated}"], "is corrupt or truncated"),
]


@pytest.mark.parametrize("label, args, message", BAD_INPUTS, ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_rows(label: str, args: list[str], message: str, data_root: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("dataset: [cora\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    run_dir = tmp_path / "truncated-run"
    if label == "truncated checkpoint":
        made = run_in_process("ladle.train", "--ingredients", "2", *TRUNKLESS, "epochs=2", "--data-root", str(data_root),
                              "--run-dir", str(run_dir))
        assert made.returncode == 0, made.stderr
        weights = run_dir / "ingredient-01.safetensors"
        weights.write_bytes(weights.read_bytes()[:64])
        result = run_in_process("ladle.soup", "--run-dir", str(run_dir), "--data-root", str(data_root))
    else:
        filled = [a.format(broken=broken, file=a_file) for a in args]
        result = run_in_process("ladle.train", *filled, "--data-root", str(data_root))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
