"""What a careless or hostile user does, refused or survived: a cache root that is not ladle's, another copy of
the data, a varrate run aimed at a train run, FIFOs and directories where files belong, a damaged trunk, shard
set or progress file, a short write, out-of-range sizes, contradicting ``--resume`` flags, and leftovers."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS, copy_run, run_in_process, train_until_crash

from ladle.core.errors import LadleError, run_cli
from ladle.core.files import atomic_open
from ladle.core.recipe import load_recipe
from ladle.core.runlock import lock_run_dir
from ladle.core.storage import load_state, save_state
from ladle.graph.datasets import load_dataset
from ladle.graph.shards import load_shard, prepare_shards
from ladle.nn.models import build_model
from ladle.prepare import main as prepare_main
from ladle.soup.pipeline import soup_run
from ladle.train.curves import merge_metrics
from ladle.train.launch import resume_run, train_ingredients
from ladle.train.loop import train_task
from ladle.train.task import IngredientTask

FULL = [*TRUNKLESS, "view.kind=full", "epochs=3"]
TRUNKED = ["view.kind=full", "trunk.epochs=3", "epochs=3"]  # a trunk, then branches and the trunk continued


@contextlib.contextmanager
def no_hang(seconds: int = 60) -> Iterator[None]:
    """Fail the test instead of hanging it (a FIFO read blocks forever)."""
    def stop(*_):
        raise TimeoutError(f"blocked for {seconds} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _one_line(result) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr.strip()


@pytest.fixture(scope="module")
def trunk_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run with a trunk: two Cora branches of it on the full graph, 3 epochs each."""
    return train_ingredients(load_recipe(None, TRUNKED), ingredients=2, workers=1, data_root=data_root,
                             run_dir=tmp_path_factory.mktemp("hostile") / "run").run_dir


# ------------------------------------------------------------------ 1. prune removes only what ladle wrote


def test_prune_leaves_folders_ladle_did_not_write(tmp_path: Path, data_root: Path, monkeypatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "looks-like-a-cache"
    shutil.copytree(data_root / "Cora", cache / "datasets" / "Cora")  # e.g. LADLE_CACHE set for LADLE_DATA
    monkeypatch.setenv("LADLE_CACHE", str(cache))
    assert run_cli(prepare_main, ["view.kind=random", "-k", "2", "--data-root", str(data_root)]) == 0
    capsys.readouterr()
    assert run_cli(prepare_main, ["--prune", "--max-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "left alone: 1 entries" in out and "datasets/Cora" in out and "removed 2 entries" in out, out
    assert sorted(p.name for p in (cache / "datasets").iterdir()) == ["Cora"]
    assert not list((cache / "shards").iterdir())
    assert (cache / "datasets" / "Cora" / "raw").is_dir()


@pytest.mark.parametrize("value", ["", " ", "."])
def test_an_empty_or_working_directory_cache_root_is_refused(value: str, tmp_path: Path, monkeypatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LADLE_CACHE", value)
    monkeypatch.chdir(tmp_path)
    assert run_cli(prepare_main, ["--list"]) == 2
    assert ("LADLE_CACHE is set but empty" if not value.strip() else "is the working directory") in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ 2. the run's data, and no other


def test_resume_and_soup_refuse_other_data(trunk_run: Path, data_root: Path, tmp_path: Path) -> None:
    run = copy_run(trunk_run, tmp_path)
    copy = tmp_path / "data"
    shutil.copytree(data_root / "Cora", copy / "Cora")  # the same files, elsewhere (mtimes kept): the same data
    assert soup_run(run, method="uniform", data_root=copy, write=False)["soups"]
    labels = next((copy / "Cora" / "raw").glob("*.y"))
    labels.write_bytes(labels.read_bytes())  # rewritten: another identity, as a copy with other labels has
    os.utime(labels, (1, 1))
    for attempt in (lambda: soup_run(run, method="uniform", data_root=copy, write=False),
                    lambda: resume_run(run, workers=1, data_root=copy)):
        with pytest.raises(LadleError, match=f"was trained on the cora files of {data_root} .*, not on the cora files "
                                             f"of {copy} .*--allow-other-data if they are the same data"):
            attempt()
    assert soup_run(run, method="uniform", data_root=copy, write=False, allow_other_data=True)["soups"]
    error = _one_line(run_in_process("ladle.soup", "--run-dir", str(run), "--data-root", str(copy)))
    assert f"not on the cora files of {copy}" in error
    assert json.loads((run / "run.json").read_text())["status"] == "done"


# ------------------------------------------------------------------ 4. varrate writes only its own folders


def test_varrate_refuses_another_kind_of_run_a_file_and_a_locked_folder(trunk_run: Path, tmp_path: Path) -> None:
    run = copy_run(trunk_run, tmp_path)
    before = {path.name: path.stat().st_mtime_ns for path in run.iterdir()}
    error = _one_line(run_in_process("ladle.varrate", "--ranks", "2", "--run-dir", str(run)))
    assert error == (f"error: run directory {run} holds a ladle.train run (run.json); a varrate run goes in a folder "
                     "of its own (choose another --run-dir)")
    assert {path.name: path.stat().st_mtime_ns for path in run.iterdir()} == before
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert "is not a directory" in _one_line(run_in_process("ladle.varrate", "--run-dir", str(a_file)))
    assert a_file.read_text() == "mine"
    empty = tmp_path / "varrate"
    empty.mkdir()
    with lock_run_dir(empty, "ladle.soup"):
        assert "is in use by pid" in _one_line(run_in_process("ladle.varrate", "--run-dir", str(empty)))


# ------------------------------------------------------------------ 8. only regular files are opened


def test_a_fifo_or_a_directory_in_place_of_a_file_is_refused_not_waited_on(trunk_run: Path, data_root: Path,
                                                                           tmp_path: Path) -> None:
    run = copy_run(trunk_run, tmp_path)
    (run / "ingredient-00.json").unlink()
    os.mkfifo(run / "ingredient-00.json")
    (run / "ingredient-01.json").unlink()
    (run / "ingredient-01.json").mkdir()
    with no_hang(), pytest.raises(LadleError, match="ingredient-00.json is a FIFO, not a file ladle wrote"):
        soup_run(run, method="uniform", data_root=data_root, write=False)
    with no_hang(), pytest.raises(LadleError, match="no finished ingredient"):  # both skipped, each named
        soup_run(run, method="uniform", data_root=data_root, write=False, skip_bad=True)


def test_a_fifo_in_the_cache_is_read_around(data_root: Path, tmp_path: Path, monkeypatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LADLE_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe(None, [*FULL, "view.kind=random"])
    shards = prepare_shards(recipe, 2, data_root)
    meta = shards.path / "part-00" / "meta.json"
    reference_meta = meta.read_bytes()
    meta.unlink()
    os.mkfifo(meta)
    with no_hang():
        prepare_shards(recipe, 2, data_root)
    assert meta.read_bytes() == reference_meta
    reference = load_dataset("cora", data_root)
    (entry,) = (tmp_path / "cache" / "datasets").glob("cora-*")
    (entry / "y.npy").unlink()
    os.mkfifo(entry / "y.npy")
    with no_hang(), caplog.at_level(logging.WARNING):
        again = load_dataset("cora", data_root)
    assert "y.npy" in caplog.text and "reading the dataset files again" in caplog.text
    assert torch.equal(again.y, reference.y) and (entry / "y.npy").is_file()


# ------------------------------------------------------------------ 9. the trunk is checked like an ingredient


def test_a_damaged_trunk_is_trained_again_and_a_foreign_one_refused(trunk_run: Path, data_root: Path,
                                                                   tmp_path: Path, cora_data) -> None:
    run = copy_run(trunk_run, tmp_path)
    trunk = run / "trunk.safetensors"
    trunk.write_bytes(trunk.read_bytes()[:-64])
    result = resume_run(run, workers=1, data_root=data_root)
    assert not result.failed
    expected, retrained = load_state(trunk_run / "trunk.safetensors"), load_state(trunk)
    assert all(torch.equal(expected[key], retrained[key]) for key in expected)
    foreign = build_model(load_recipe(None, [*TRUNKED, "hidden=32"]), cora_data.num_features, cora_data.num_classes)
    save_state(trunk, foreign.state_dict())
    error = _one_line(run_in_process("ladle.soup", "--run-dir", str(run), "--data-root", str(data_root)))
    assert "trunk.safetensors does not match the run's recipe" in error and "--resume" in error, error


# ------------------------------------------------------------------ 10. damaged shards rebuilt, progress restarted


def test_damaged_shard_files_are_rebuilt(data_root: Path, tmp_path: Path, monkeypatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LADLE_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe(None, [*FULL, "view.kind=random"])
    shards = prepare_shards(recipe, 2, data_root)
    for damaged in (shards.path / "shards.json", shards.path / "part-01" / "meta.json", shards.path / "part-00" / "x.npy"):
        reference = damaged.read_bytes()
        damaged.write_bytes(reference[: len(reference) // 2])
        with caplog.at_level(logging.WARNING):
            again = prepare_shards(recipe, 2, data_root)
        assert f"the cached shards {shards.path} are incomplete or damaged; rebuilding them" in caplog.text, damaged
        if damaged.name == "shards.json":  # it records when and how fast it was built
            assert json.loads(damaged.read_text())["parts"] == json.loads(reference)["parts"]
        else:
            assert damaged.read_bytes() == reference
        caplog.clear()
    (again.path / "part-01" / "meta.json").write_text("{")
    with pytest.raises(LadleError, match="rebuild the shards with python -m ladle.prepare --force"):
        load_shard(again.part(1))


def test_a_truncated_progress_file_restarts_the_ingredient(cora_data, tmp_path: Path, monkeypatch,
                                                           caplog: pytest.LogCaptureFixture, one_thread) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, "view.kind=saint-rw", "epochs=8"])
    whole = train_task(recipe, cora_data, IngredientTask(0, 2, tmp_path / "whole", "independent", 3))
    task = IngredientTask(0, 2, tmp_path / "resumed", "independent", 3)
    train_until_crash(recipe, cora_data, task, 6, monkeypatch)  # at epoch 5, its progress saved after epoch 2
    task.progress_path.write_bytes(task.progress_path.read_bytes()[:-200])
    with caplog.at_level(logging.WARNING):
        again = train_task(recipe, cora_data, task)
    assert "training it from the start" in caplog.text
    assert again["val_acc"] == whole["val_acc"] and again["epochs_run"] == whole["epochs_run"]
    expected, found = load_state(tmp_path / "whole" / "ingredient-00.safetensors"), load_state(task.files.weights(task.name))
    assert all(torch.equal(expected[key], found[key]) for key in expected)


# ------------------------------------------------------------------ 11. a short write is a full disk


def test_a_short_write_is_reported_as_a_full_disk(tmp_path: Path) -> None:
    with pytest.raises(LadleError, match=r"disk full while writing .*x\.npy; free space and rerun"):
        with atomic_open(tmp_path / "x.npy") as stream:
            stream.write(b"a")
            raise OSError("3880564 requested and 1308640 written")  # numpy's short write: no errno
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ 12. out-of-range input: one line, nothing written


@pytest.mark.parametrize("override, message", [
    ("dataset=synthetic:nodes=100,classes=0", "synthetic graph needs classes >= 2"),
    ("seed=100000000000000000", "split and seed must be between 0 and 4294967295"),
    ("hidden=1000000000000", "hidden must be between 1 and 65536"),
    ("layers=100000000", "layers must be between 1 and 128"),
])
def test_out_of_range_sizes_are_refused_before_anything_is_written(override: str, message: str, tmp_path: Path,
                                                                   data_root: Path) -> None:
    error = _one_line(run_in_process("ladle.train", "-k", "1", override, "--run-dir", str(tmp_path / "run"),
                                 "--data-root", str(data_root)))
    assert message in error, error
    assert not (tmp_path / "run").exists()


def test_a_model_too_large_for_the_machine_is_refused_before_its_folder_exists(data_root: Path, tmp_path: Path,
                                                                               monkeypatch) -> None:
    monkeypatch.setattr("ladle.nn.models.total_memory", lambda: 2**20)  # a 1 MiB machine
    with pytest.raises(LadleError, match=r"has 92,231 parameters: 0.0 GiB .* above this machine's 0.0 GiB"):
        train_ingredients(load_recipe(None, FULL), ingredients=1, data_root=data_root, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_damaged_run_json_metrics_and_recipe_files_are_named(trunk_run: Path, data_root: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    run = copy_run(trunk_run, tmp_path)
    (run / "run.json").write_text("{}")
    for command in (("ladle.soup",), ("ladle.train", "--resume")):
        error = _one_line(run_in_process(*command, "--run-dir", str(run), "--data-root", str(data_root)))
        assert f"{run / 'run.json'} is not a ladle.train run.json this version can read" in error, error
    (run / "metrics-ingredient-00.csv").write_bytes(b"run,name,epoch\n\xff\xfe,\x00,x\n")
    with caplog.at_level(logging.WARNING):
        merge_metrics(run)
    assert "metrics-ingredient-00.csv are damaged" in caplog.text and (run / "metrics-ingredient-00.csv").exists()
    binary = tmp_path / "recipe.yaml"
    binary.write_bytes(bytes(range(256)))
    assert _one_line(run_in_process("ladle.train", "--recipe", str(binary))) == (
        f"error: recipe {binary} is not a text file (not UTF-8): give a YAML recipe")
    error = _one_line(run_in_process("ladle.varrate", "--recipe", str(binary)))
    assert str(binary) in error


def test_resume_refuses_flags_that_contradict_the_run(trunk_run: Path, data_root: Path, tmp_path: Path) -> None:
    run = copy_run(trunk_run, tmp_path)
    before = {path.name: path.stat().st_mtime_ns for path in run.iterdir()}
    error = _one_line(run_in_process("ladle.train", "--resume", "-k", "5", "hidden=32", "--run-dir", str(run)))
    assert error == ("error: --resume finishes the run as it was recorded, and these flags contradict it: "
                     "hidden 32, run.json 64; --ingredients 5, run.json 2. Drop them, or start a new run (another "
                     "--run-dir)"), error
    assert {path.name: path.stat().st_mtime_ns for path in run.iterdir()} == before
    same = run_in_process("ladle.train", "--resume", "-k", "2", *TRUNKED, "--device", "auto", "--run-dir", str(run),
                          "--data-root", str(data_root))  # flags that say what run.json says are accepted (auto: cpu)
    assert same.returncode == 0, same.stderr


# ------------------------------------------------------------------ 15. no leftovers


def test_a_killed_soups_temporary_file_is_removed_by_the_next_owner(trunk_run: Path, data_root: Path,
                                                                     tmp_path: Path) -> None:
    run = copy_run(trunk_run, tmp_path)
    (run / ".soup-uniform.safetensors.0123456789abcdef.tmp").write_bytes(b"")  # what a SIGKILL mid-write leaves
    soup_run(run, method="uniform", data_root=data_root)
    assert not list(run.glob(".*.tmp")) and (run / "soup-uniform.safetensors").is_file()
    assert not list(run.glob("metrics-*.csv")) and (run / "metrics.csv").is_file()


def test_a_soup_killed_among_its_writes_leaves_no_report_naming_other_weights(
        trunk_run: Path, data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report names the weights of the soup it chose: a write phase that stops after one soup of two leaves no
    report (``load_model`` then says to soup the run), never the last one beside new weights."""
    import ladle

    run = copy_run(trunk_run, tmp_path)
    soup_run(run, method="uniform", data_root=data_root)
    assert (run / "report.json").is_file()
    written: list[Path] = []

    def dies_after_one(path: Path, state: dict) -> None:
        if written:
            raise KeyboardInterrupt  # what a kill between two writes looks like to the files
        written.append(path)
        save_state(path, state)

    monkeypatch.setattr("ladle.soup.pipeline.save_state", dies_after_one)
    with pytest.raises(KeyboardInterrupt):
        soup_run(run, data_root=data_root)  # every method: uniform is written first
    assert written == [run / "soup-uniform.safetensors"] and not (run / "report.json").exists()
    with pytest.raises(LadleError, match="has no soup report yet: soup it"):
        ladle.load_model(run)
