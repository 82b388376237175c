"""The Ray backend: same weights as the local backend, retries after a raising task and a dead worker,
weights gathered to the driver, and a one-line error when Ray is not installed.

One local Ray cluster (2 CPUs) serves the whole module; the backend reuses it, and its worker processes keep
torch and PyG imported from one test to the next. The test that joins from a second driver comes last: its job's
workers take the cluster's CPUs, and Ray retires the module's idle workers for them (a later test would wait for
fresh ones: 15 s of imports on one core).
"""
from __future__ import annotations

import concurrent.futures as futures
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import STARVED_VIEW, TRUNKLESS

from ladle.core.errors import LadleError
from ladle.core.files import read_json
from ladle.core.recipe import Recipe, load_recipe
from ladle.core.storage import load_state
from ladle.train.launch import RunResult, train_ingredients

K = 4
OVERRIDES = [*TRUNKLESS, "dataset=cora", "view.kind=random", "epochs=5", "hidden=16", "seed=3"]


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local 2-CPU Ray cluster for the module; its GCS address."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def recipe() -> Recipe:
    return load_recipe(None, OVERRIDES)


@pytest.fixture(scope="module")
def local_run(recipe: Recipe, data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The reference: the same K ingredients on the local backend, one worker with one thread (as each Ray task)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ladle.train.launch.available_cores", lambda: 1)
        return train_ingredients(recipe, K, workers=1, run_dir=tmp_path_factory.mktemp("local") / "run",
                                 data_root=data_root, backend="local")


def _ray_run(recipe: Recipe, data_root: Path, run_dir: Path, address: str, **options: Any) -> RunResult:
    return train_ingredients(recipe, K, run_dir=run_dir, data_root=data_root, backend="ray",
                             ray_options={"address": address, "cpus": 1, "gpus": 0, **options})


def _assert_same_weights(run: RunResult, reference: RunResult) -> None:
    """Every ingredient of ``run`` finished and its tensors equal the reference's exactly."""
    assert not run.failed and [m["name"] for m in run.ingredients] == [m["name"] for m in reference.ingredients]
    for meta in reference.ingredients:
        ours, theirs = (load_state(r.run_dir / f"{meta['name']}.safetensors") for r in (run, reference))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs), meta["name"]
    assert read_json(run.run_dir / "run.json")["status"] == "done"


def test_ray_matches_local(recipe: Recipe, data_root: Path, tmp_path: Path, ray_address: str,
                           local_run: RunResult) -> None:
    run = _ray_run(recipe, data_root, tmp_path / "ray", ray_address)
    _assert_same_weights(run, local_run)
    assert {m["threads"] for m in run.ingredients} == {1}
    assert {m["pid"] for m in run.ingredients}.isdisjoint({os.getpid()})


def test_faults_retried_and_gathered(recipe: Recipe, data_root: Path, tmp_path: Path, ray_address: str,
                                     local_run: RunResult, monkeypatch: pytest.MonkeyPatch) -> None:
    """A raising first attempt and a killed worker are both retried; gathered weights still match."""
    markers = tmp_path / "faults"
    run_dir = tmp_path / "gathered"
    for mode, name in (("raise", "ingredient-01"), ("exit", "ingredient-02")):
        monkeypatch.setenv("LADLE_RAY_FAULT", f"{mode}:{name}:{markers}")
        run = _ray_run(recipe, data_root, run_dir / mode, ray_address, gather=True)
        assert (markers / f"{name}.{mode}").is_file(), "the injected fault did not fire"
        _assert_same_weights(run, local_run)
        assert not list((run_dir / mode).glob(".*.tmp"))
        # the training curves came back with the weights: a row per ingredient-epoch
        assert len((run_dir / mode / "metrics.csv").read_text().splitlines()) == 1 + K * 5


def test_metis_parts_read_their_shards_and_match_local(data_root: Path, tmp_path: Path, ray_address: str) -> None:
    """A METIS ingredient reads its part shard, the partition the driver prepared: the local backend's weights."""
    metis = load_recipe(None, [*OVERRIDES, "view.kind=metis"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ladle.train.launch.available_cores", lambda: 1)
        local = train_ingredients(metis, K, workers=1, run_dir=tmp_path / "local", data_root=data_root)
    run = _ray_run(metis, data_root, tmp_path / "ray", ray_address, gather=True)
    _assert_same_weights(run, local)
    assert {m["view"]["nodes"] for m in run.ingredients} == {m["view"]["nodes"] for m in local.ingredients}


def test_a_node_without_the_drivers_shards_prepares_the_same(data_root: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards out of a node's reach are prepared in its own cache, once for the node's worker processes (the others
    wait, then read the cache), and must be the driver's, digest and all."""
    from ladle.graph.shards import prepare_shards
    from ladle.train import ray_tasks
    from ladle.train.ray_tasks import ShardSource, node_shards, partition_digest

    metis = load_recipe(None, [*OVERRIDES, "view.kind=metis"])
    driver = ShardSource.of(prepare_shards(metis, K, data_root), K)
    assert driver.digest
    monkeypatch.setenv("LADLE_CACHE", str(tmp_path / "node-cache"))  # another node: an empty cache of its own
    preparations = []

    class CountedPool(futures.ProcessPoolExecutor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            preparations.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ray_tasks.futures, "ProcessPoolExecutor", CountedPool)
    unreachable = ShardSource(str(tmp_path / "elsewhere"), driver.key, driver.digest, K)
    with futures.ThreadPoolExecutor(2) as workers:  # two worker processes of one node, as far as the lock can tell
        found = list(workers.map(lambda _: node_shards(unreachable, metis, str(data_root)), range(2)))
    assert len(preparations) == 1
    for shards in found:
        assert shards.path.is_relative_to(tmp_path / "node-cache") and partition_digest(shards) == driver.digest
    tampered = ShardSource(str(tmp_path / "elsewhere"), driver.key, "0" * 64, K)
    with pytest.raises(LadleError, match=r"differ from the driver's .*put LADLE_CACHE on storage every node sees"):
        node_shards(tampered, metis, str(data_root))
    assert len(preparations) == 1, "shards already in the node's cache were prepared again"


def test_nan_loss_is_final(data_root: Path, tmp_path: Path, ray_address: str) -> None:
    """A NaN loss fails its ingredient at once (a retry would fail the same way); the run records it."""
    exploding = load_recipe(None, [*OVERRIDES, "lr=1.0e+30"])
    run = _ray_run(exploding, data_root, tmp_path / "nan", ray_address)
    assert run.failed == [f"ingredient-{k:02d}" for k in range(K)] and not run.ingredients
    status = read_json(run.run_dir / "ingredient-00.json")
    assert status["status"] == "failed" and status["error"].startswith("FloatingPointError: ")
    assert read_json(run.run_dir / "run.json")["status"] == "failed"


def test_a_failed_view_falls_back_through_ray(data_root: Path, tmp_path: Path, ray_address: str) -> None:
    """The launcher's fallback to the whole graph (:mod:`ladle.train.view_check`) on the Ray backend: the trunk,
    the trunk continued and the branches are trained again as tasks on the whole graph, the first ones kept aside."""
    run = train_ingredients(load_recipe(None, list(STARVED_VIEW)), 2, run_dir=tmp_path / "run", data_root=data_root,
                            baseline=True, backend="ray", ray_options={"address": ray_address, "cpus": 1, "gpus": 0})
    assert not run.failed and run.view_fallback is not None and run.view_fallback["view"] == "saint-rw"
    record = read_json(run.run_dir / "run.json")
    assert record["status"] == "done" and record["recipe"]["view"]["kind"] == "full"
    for name in ("trunk", "trunk-continued", "ingredient-00", "ingredient-01"):
        assert read_json(run.run_dir / "failed-view" / f"{name}.json")["view"]["kind"] == "saint-rw"
        assert read_json(run.run_dir / f"{name}.json")["view"]["kind"] == "full"
    best_again = max(meta["val_acc"] for meta in (*run.ingredients, run.continued))
    assert best_again > run.view_fallback["best_val_acc"] + 0.1


def test_the_branches_start_once_the_trunk_is_done_while_the_baseline_trains(data_root: Path, tmp_path: Path,
                                                                            ray_address: str) -> None:
    """As on the local backend: the branches do not wait for the baseline (1 + 300 full-graph epochs) trained beside
    the 1-epoch trunk; gathered, they branch from the trunk's weights the driver wrote once the trunk was done."""
    recipe = load_recipe(None, ["trunk.epochs=1", "epochs=300", "patience=300", "view.kind=full"])
    run = train_ingredients(recipe, 1, run_dir=tmp_path / "run", data_root=data_root, baseline=True, backend="ray",
                            ray_options={"address": ray_address, "cpus": 1, "gpus": 0, "gather": True})
    assert not run.failed and run.baseline is not None and run.trunk is not None
    assert (run.run_dir / "trunk.safetensors").is_file()  # gathered from its node like any ingredient's
    first_branch = min(meta["started_at"] for meta in [*run.ingredients, run.continued])
    assert run.trunk["ended_at"] <= first_branch < run.baseline["ended_at"]


def test_cuda_needs_gpus(recipe: Recipe) -> None:
    pytest.importorskip("ray")
    from ladle.train.ray_tasks import run_ray

    with pytest.raises(LadleError, match="gpus-per-ingredient"):
        run_ray([], recipe, None, None, "cuda", {"address": None, "cpus": 1, "gpus": 0, "gather": False})


def test_cli_without_ray(data_root: Path, tmp_path: Path) -> None:
    """With Ray hidden, ``--backend ray`` exits 2 with one line naming the extra, no traceback."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "ray.py").write_text("raise ImportError('ray hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "ladle.train", "--backend", "ray", "-k", "1", "--data-root", str(data_root),
         "--run-dir", str(tmp_path / "run"), *OVERRIDES],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "ladle[ray]" in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1


SHIPPING_DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])  # on the driver's path only: Ray gives its workers the driver's folder, not this
from their_gnn import MeanGNN
import ladle
from ladle.core.recipe import load_recipe
run = ladle.train_ingredients(load_recipe(None, sys.argv[5:]), 2, run_dir=sys.argv[3], data_root=sys.argv[2],
                              backend="ray", model=MeanGNN, ray_options={"address": sys.argv[4], "cpus": 1, "gpus": 0})
assert not run.failed, run.failed
"""


def test_your_model_is_shipped_to_the_nodes(data_root: Path, tmp_path: Path, ray_address: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A model class from a module only the driver can import (not installed, not in Ray's workers' path) trains
    on the cluster a driver joins as on the local backend: ladle ships its module with the driver's job."""
    user_code = tmp_path / "user-code"
    user_code.mkdir()
    (user_code / "their_gnn.py").write_text((Path(__file__).parents[1] / "notebooks" / "my_gnn.py").read_text())
    subprocess.run([sys.executable, "-c", SHIPPING_DRIVER, str(user_code), str(data_root), str(tmp_path / "ray"),
                    ray_address, *OVERRIDES], cwd=tmp_path, check=True, timeout=300)
    monkeypatch.syspath_prepend(str(user_code))
    from their_gnn import MeanGNN
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ladle.train.launch.available_cores", lambda: 1)
        local = train_ingredients(load_recipe(None, OVERRIDES), 2, workers=1, run_dir=tmp_path / "local",
                                  data_root=data_root, model=MeanGNN)
    for meta in local.ingredients:
        ours, theirs = (load_state(folder / f"{meta['name']}.safetensors") for folder in (tmp_path / "ray", local.run_dir))
        assert ours.keys() == theirs.keys() and all(key.startswith("module.") for key in ours)
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs), meta["name"]
