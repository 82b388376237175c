"""Nothing foreign runs, nothing silently mixed: a pickle-free dataset cache, recipe names that stay in
their folder, finite numbers only, shards keyed by the dataset files with the data root checked every
time, the cache listed and pruned, ingredients checked against the run's own recipe, damaged checkpoints
retrained on resume, skipped ingredients reported, and a stale ``checkpoints/latest`` named."""
from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TRUNKLESS, copy_run, run_in_process

from ladle.core.errors import LadleError, run_cli
from ladle.core.recipe import ViewConfig, load_recipe
from ladle.core.rundir import resolve_run_dir, update_latest
from ladle.core.storage import load_state, save_state
from ladle.graph.datasets import dataset_identity, load_dataset
from ladle.graph.shards import load_shard, prepare_shards, shard_key
from ladle.graph.views import build_view
from ladle.nn.models import build_model
from ladle.prepare import cache_entries
from ladle.prepare import main as prepare_main
from ladle.soup.pipeline import soup_run
from ladle.train.launch import resume_run, train_ingredients

RANDOM_2 = ["view.kind=random"]


class _Payload:
    """Unpickling this creates ``marker``: a harmless stand-in for code run from a planted cache file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test alone (so planting and pruning touch nothing else)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("LADLE_CACHE", str(folder))
    return folder


def _same_graph(data, reference) -> bool:
    return all(torch.equal(data[key], reference[key])
               for key in ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask"))


def _entry(cache: Path, name: str) -> Path:
    (entry,) = (cache / "datasets").glob(f"{name}-*")
    return entry


# ------------------------------------------------------------------ 1. the dataset cache runs nothing


def test_planted_pickles_in_the_dataset_cache_never_run(cache: Path, data_root: Path, cora_data,
                                                        tmp_path: Path) -> None:
    assert _same_graph(load_dataset("cora", data_root), cora_data)
    marker = tmp_path / "pwned"
    for folder in [p for p in (cache / "datasets").rglob("*") if p.is_dir()]:
        for target in (folder / "data.pt", folder / "processed" / "data.pt"):  # where PyG looks for its output
            target.parent.mkdir(exist_ok=True)
            torch.save({"x": _Payload(marker)}, target)
    for array in (cache / "datasets").rglob("*.npy"):  # an object array: np.load would need pickle
        np.save(array, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    assert not marker.exists()
    again = load_dataset("cora", data_root)
    assert not marker.exists()
    assert _same_graph(again, cora_data)  # the refused entry was read again from the dataset files
    assert all(np.load(a, allow_pickle=False).dtype != object for a in _entry(cache, "cora").glob("*.npy"))


def test_a_corrupt_cache_entry_is_rebuilt_not_blamed_on_the_raw_files(cache: Path, data_root: Path,
                                                                      cora_data) -> None:
    load_dataset("cora", data_root)
    for file in [*(cache / "datasets").rglob("*.pt"), *(cache / "datasets").rglob("*.npy")]:
        file.write_bytes(file.read_bytes()[:100])
    assert _same_graph(load_dataset("cora", data_root), cora_data)


def test_damaged_dataset_files_are_named_as_such(cache: Path, data_root: Path, tmp_path: Path) -> None:
    copy = tmp_path / "root"
    shutil.copytree(data_root / "Cora", copy / "Cora", ignore=shutil.ignore_patterns("processed"))
    graph = copy / "Cora" / "raw" / "ind.cora.graph"
    graph.write_bytes(graph.read_bytes()[:50])
    with pytest.raises(LadleError, match="damaged or incomplete: replace them") as error:
        load_dataset("cora", copy)
    assert "/raw or pass --data-root" not in str(error.value)


def test_prepare_force_clears_the_dataset_cache(cache: Path, data_root: Path, cora_data) -> None:
    load_dataset("cora", data_root)
    labels = _entry(cache, "cora") / "y.npy"
    np.save(labels, np.zeros(cora_data.num_nodes, dtype=np.int64))  # well formed, wrong: only --force notices
    assert int(load_dataset("cora", data_root).y.max()) == 0
    args = [*RANDOM_2, "-k", "2", "--data-root", str(data_root)]
    assert run_cli(prepare_main, [*args, "--force"]) == 0
    assert _same_graph(load_dataset("cora", data_root), cora_data)
    assert torch.equal(load_shard(cache / "shards" / shard_key(load_recipe(None, [*TRUNKLESS, *RANDOM_2]), 2, data_root) / "graph")
                       .data.y, cora_data.y)


# ------------------------------------------------------------------ 4. a recipe name stays in its folder


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/absolute", "a/b", "", ".hidden", "..", "a\\b", "a\nb",
                                  "x" * 101])
def test_recipe_name_must_be_a_plain_file_name(name: str, tmp_path: Path) -> None:
    with pytest.raises(LadleError, match="name must be a plain file name"):
        load_recipe(None, {"name": name})
    shared = tmp_path / "shared.yaml"
    shared.write_text(f"name: {name!r}\n")
    with pytest.raises(LadleError, match="name must be a plain file name"):
        load_recipe(str(shared))


def test_escaping_name_writes_nothing(data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = run_in_process("ladle.train", "-k", "1", *TRUNKLESS, "epochs=1", "name=../../escaped", "--data-root",
                            str(data_root))
    assert result.returncode == 2, result.stderr
    assert "name must be a plain file name" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == [work] and not list(work.iterdir())


# ------------------------------------------------------------------ 5. finite numbers only


@pytest.mark.parametrize("override", ["lr=nan", "lr=inf", "lr=-inf", "lr=.nan", "weight_decay=nan",
                                      "weight_decay=.inf", "dropout=nan"])
def test_non_finite_numbers_are_refused(override: str) -> None:
    key = override.partition("=")[0]
    with pytest.raises(LadleError, match=f"recipe key '{key}' must be a finite number"):
        load_recipe(None, [*TRUNKLESS, override])


def test_non_finite_numbers_in_a_file_or_a_synthetic_spec(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr: .inf\n")
    with pytest.raises(LadleError, match="recipe key 'lr' must be a finite number"):
        load_recipe(str(recipe))
    with pytest.raises(LadleError, match="synthetic option 'homophily' needs a finite number"):
        load_dataset("synthetic:nodes=100,homophily=nan")


def test_nan_learning_rate_writes_nothing(data_root: Path, tmp_path: Path) -> None:
    result = run_in_process("ladle.train", "-k", "1", *TRUNKLESS, "epochs=1", "lr=nan", "--data-root", str(data_root),
                            "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert "recipe key 'lr' must be a finite number, got 'nan'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ 6. shards keyed by the data, the root checked


@pytest.fixture
def cached_shards(data_root: Path) -> Path:
    """Cora's shards (random view, K=2) in the session cache."""
    return prepare_shards(load_recipe(None, [*TRUNKLESS, *RANDOM_2]), 2, data_root).path


def test_a_bad_root_is_noticed_even_with_cached_shards(cached_shards: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, *RANDOM_2])
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(LadleError, match="is not a directory"):
        prepare_shards(recipe, 2, a_file)
    with pytest.raises(LadleError, match="does not exist"):
        prepare_shards(recipe, 2, tmp_path / "nowhere")
    assert run_cli(prepare_main, [*RANDOM_2, "-k", "2", "--data-root", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: data root {a_file} is not a directory (pass --data-root or set LADLE_DATA)"


def test_another_copy_of_the_dataset_is_read(cached_shards: Path, data_root: Path, tmp_path: Path) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, *RANDOM_2])
    copy = tmp_path / "copy"
    shutil.copytree(data_root / "Cora", copy / "Cora", ignore=shutil.ignore_patterns("processed"))
    assert shard_key(recipe, 2, copy) == cached_shards.name  # same files (copied with their mtimes): same shards
    x = copy / "Cora" / "raw" / "ind.cora.x"
    os.utime(x, ns=(time.time_ns(), time.time_ns()))  # the same bytes, but files ladle has not seen
    touched = prepare_shards(recipe, 2, copy)
    assert touched.path != cached_shards and touched.meta["inputs"]["data"] == dataset_identity("cora", copy)
    assert torch.equal(load_shard(touched.graph()).data.x, load_shard(cached_shards / "graph").data.x)
    x.write_bytes(x.read_bytes()[:200])  # another copy whose files are broken: read, not skipped
    with pytest.raises(LadleError, match="damaged or incomplete"):
        prepare_shards(recipe, 2, copy)


# ------------------------------------------------------------------ 7. the cache listed and pruned; recipe paths


def test_list_and_prune_the_cache(cache: Path, data_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for k in (2, 3):
        assert run_cli(prepare_main, [*RANDOM_2, "-k", str(k), "--data-root", str(data_root)]) == 0
    shards = {prepare_shards(load_recipe(None, [*TRUNKLESS, *RANDOM_2]), k, data_root).path.name: k for k in (2, 3)}
    now = time.time()
    for name, k in shards.items():  # K=2 last used three days ago, K=3 an hour ago, the dataset now
        stamp = now - (3 * 86400 if k == 2 else 3600)
        os.utime(cache / "shards" / name, (stamp, stamp))
    capsys.readouterr()
    assert run_cli(prepare_main, ["--list"]) == 0
    listing = capsys.readouterr().out
    assert "dataset cora: 2708 nodes" in listing and "view random, K=2" in listing and "view random, K=3" in listing
    assert "MB in 3 entries" in listing
    assert run_cli(prepare_main, ["--prune", "--older-than", "2d"]) == 0
    assert "view random, K=2" in capsys.readouterr().out
    assert sorted(p.name for p in (cache / "shards").iterdir()) == [n for n, k in shards.items() if k == 3]
    dataset = [e for e in cache_entries(cache) if e.what.startswith("dataset")][0]
    assert run_cli(prepare_main, ["--prune", "--max-size", str(dataset.size + 1)]) == 0  # LRU: the shards go
    assert [e.path for e in cache_entries(cache)] == [dataset.path]
    for bad, message in ((["--prune"], "--prune needs --older-than"),
                         (["--prune", "--max-size", "lots"], "--max-size must be a size"),
                         (["--prune", "--older-than", "soon"], "--older-than must be an age"),
                         (["--max-size", "1G"], "go with --prune")):
        capsys.readouterr()
        assert run_cli(prepare_main, bad) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_recipe_path_that_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "looks.yaml").mkdir()
    for path in (tmp_path, tmp_path / "looks.yaml"):
        with pytest.raises(LadleError, match="is a directory, not a recipe file"):
            load_recipe(str(path))


# ------------------------------------------------------------------ 3. every ingredient checked against run.json


@pytest.fixture(scope="module")
def finished_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run: two Cora ingredients on the full graph (hidden 64), 3 epochs each."""
    return train_ingredients(load_recipe(None, [*TRUNKLESS, "view.kind=full", "epochs=3"]), ingredients=2, workers=1,
                             data_root=data_root, run_dir=tmp_path_factory.mktemp("security") / "run").run_dir


def test_a_foreign_first_ingredient_is_the_one_named_and_skipped(finished_run: Path, data_root: Path,
                                                                 tmp_path: Path, cora_data) -> None:
    run = copy_run(finished_run, tmp_path)
    meta = json.loads((run / "ingredient-00.json").read_text())
    meta["recipe"]["hidden"] = 32  # ingredient-00 and its JSON copied in from a run with another width
    (run / "ingredient-00.json").write_text(json.dumps(meta))
    foreign = build_model(load_recipe(None, [*TRUNKLESS, "hidden=32"]), cora_data.num_features, cora_data.num_classes)
    save_state(run / "ingredient-00.safetensors", foreign.state_dict())
    with pytest.raises(LadleError) as error:
        soup_run(run, method="uniform", data_root=data_root, write=False)
    assert "ingredient-00.safetensors does not match the run's recipe (hidden 32, run.json 64)" in str(error.value)
    assert "ingredient-01" not in str(error.value)
    report = soup_run(run, method="uniform", skip_bad=True, data_root=data_root)
    assert list(report["skipped"]) == ["ingredient-00"]
    assert [row["name"] for row in report["ingredients"]] == ["ingredient-01"]
    soup, genuine = load_state(run / "soup-uniform.safetensors"), load_state(run / "ingredient-01.safetensors")
    assert soup.keys() == genuine.keys() and all(torch.equal(soup[key], genuine[key]) for key in soup)
    assert json.loads((run / "soup-uniform.json").read_text())["recipe"]["hidden"] == 64


# ------------------------------------------------------------------ 7. resume, the report and latest say what they see


def test_resume_trains_a_truncated_checkpoint_again(finished_run: Path, data_root: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    run = copy_run(finished_run, tmp_path)
    weights = run / "ingredient-01.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    untouched = (run / "ingredient-00.safetensors").stat().st_mtime_ns
    with caplog.at_level(logging.WARNING):
        result = resume_run(run, workers=1, data_root=data_root)
    assert not result.failed and [meta["name"] for meta in result.ingredients] == ["ingredient-00", "ingredient-01"]
    assert "ingredient-01 will be trained again: checkpoint" in caplog.text and "corrupt or truncated" in caplog.text
    expected = load_state(finished_run / "ingredient-01.safetensors")
    retrained = load_state(weights)
    assert all(torch.equal(expected[key], retrained[key]) for key in expected)
    assert (run / "ingredient-00.safetensors").stat().st_mtime_ns == untouched


def test_the_report_lists_what_skip_bad_left_out(finished_run: Path, data_root: Path, tmp_path: Path) -> None:
    run = copy_run(finished_run, tmp_path)
    weights = run / "ingredient-01.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    soup_run(run, method="uniform", skip_bad=True, data_root=data_root)
    why = json.loads((run / "report.json").read_text())["skipped"]["ingredient-01"]
    assert "ingredient-01.safetensors is corrupt or truncated" in why
    assert f"- ingredient-01: {why}" in (run / "report.md").read_text()


def test_a_real_latest_directory_is_named_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "checkpoints"
    stale = root / "latest"
    stale.mkdir(parents=True)
    (stale / "run.json").write_text("{}")
    (root / "new").mkdir()
    with caplog.at_level(logging.WARNING):
        update_latest(root, root / "new")
    assert [r.getMessage() for r in caplog.records] == [f"{stale} is a real directory, not updated: remove it"]
    assert stale.is_dir() and not stale.is_symlink()
    with pytest.raises(LadleError, match="latest is a real directory, not a link to the newest run: remove it"):
        resolve_run_dir(None, root)
    assert resolve_run_dir(stale, root) == stale.resolve()  # named with --run-dir, it is used


def test_recipe_aliases_are_refused_and_bad_values_are_cut(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"  # each level doubles: 30 levels would stand for a billion items
    bomb.write_text("a0: &a0 [1, 1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]\n" for i in range(1, 30)))
    with pytest.raises(LadleError, match=r"not valid YAML: aliases \(\*name\) are not allowed in a recipe"):
        load_recipe(str(bomb))
    with pytest.raises(LadleError, match="not valid YAML: aliases"):
        load_recipe(None, ["hidden=&x [1, *x]"])
    with pytest.raises(LadleError) as error:
        load_recipe(None, ["hidden=" + "x" * 100_000])
    assert len(str(error.value)) < 200 and str(error.value).endswith("...")


@pytest.mark.parametrize("kind", ["saint-node", "saint-rw"])
def test_a_saint_batch_is_capped_at_the_graph(cora_data, kind: str) -> None:
    view = build_view(cora_data, ViewConfig(kind=kind, batch_size=100_000_000), 0, 1, 0)
    assert view.budget == cora_data.num_nodes
    assert next(iter(view.batches(0))).num_nodes <= cora_data.num_nodes


def test_a_folder_of_the_users_own_files_is_not_a_run_directory(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "report.md").write_text("my notes")
    result = run_in_process("ladle.train", "-k", "1", *TRUNKLESS, "epochs=1", "--run-dir", str(folder))
    assert result.returncode == 2 and "holds files but no ladle run (report.md): choose a new or empty" in result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["report.md"] and (folder / "report.md").read_text() == "my notes"
