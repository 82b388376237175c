"""Local workers: each loads the whole graph once for all its ingredients, takes the launcher's environment
of the moment, and trains the same weights whether forked from the fork server or spawned."""
from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from ladle import launch
from ladle.checkpoints import load_state
from ladle.config import load_recipe
from ladle.engine import ingredient_tasks
from ladle.launch import start_workers, train_ingredients, worker_context, worker_pool

FULL = ["view.kind=full", "epochs=3"]


def _weights(run_dir: Path, ingredients: int) -> list[dict[str, torch.Tensor]]:
    return [load_state(run_dir / f"ingredient-{k:02d}.safetensors") for k in range(ingredients)]


def _same(first: list[dict[str, torch.Tensor]], second: list[dict[str, torch.Tensor]]) -> bool:
    return all(a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a) for a, b in zip(first, second))


@pytest.mark.parametrize("kind, loaded", [("full", ["graph"]), ("metis", ["part-00", "part-01", "part-02"])])
def test_a_worker_loads_the_whole_graph_once_and_each_part_once(kind: str, loaded: list[str], data_root: Path,
                                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                one_thread: None) -> None:
    recipe = load_recipe(None, [f"view.kind={kind}", "epochs=3"])
    run = train_ingredients(recipe, ingredients=3, workers=1, threads=1, run_dir=tmp_path / "run",
                            data_root=data_root, save_every=0)
    pooled = _weights(run.run_dir, 3)
    loads: list[str] = []
    real_load = launch.load_shard
    monkeypatch.setattr(launch, "load_shard", lambda path: loads.append(Path(path).name) or real_load(path))
    worker = launch._Worker(recipe, str(run.run_dir / "shards"), 1, 0, "cpu")  # in this process: loads are seen
    for task in ingredient_tasks(run.run_dir, 3, "shared", False, save_every=0):
        worker.run(task)
    assert loads == loaded
    assert _same(_weights(run.run_dir, 3), pooled)  # retrained here: bitwise what the pool's worker wrote


def test_forked_and_spawned_workers_train_bitwise_identical_weights(data_root: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no fork server on this platform: workers are always spawned")
    assert worker_context().get_start_method() == "forkserver"
    recipe = load_recipe(None, ["view.kind=saint-rw", "epochs=4"])  # sampled: every batch draws from the RNG
    forked = train_ingredients(recipe, ingredients=2, workers=2, run_dir=tmp_path / "forked", data_root=data_root,
                               init="independent", save_every=2)
    monkeypatch.setattr(launch, "worker_context", lambda: mp.get_context("spawn"))
    spawned = train_ingredients(recipe, ingredients=2, workers=2, run_dir=tmp_path / "spawned", data_root=data_root,
                                init="independent", save_every=2)
    assert not forked.failed and not spawned.failed
    assert {m["pid"] for m in forked.ingredients}.isdisjoint({m["pid"] for m in spawned.ingredients} | {os.getpid()})
    assert _same(_weights(forked.run_dir, 2), _weights(spawned.run_dir, 2))
    assert not _same(_weights(forked.run_dir, 2)[:1], _weights(forked.run_dir, 2)[1:])  # the check can fail


def test_a_worker_has_the_launchers_environment_of_the_moment(data_root: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = load_recipe(None, FULL)
    run = train_ingredients(recipe, ingredients=1, workers=1, run_dir=tmp_path / "run", data_root=data_root,
                            save_every=0)
    start_workers()  # running already (since the run above), with the environment it started with
    monkeypatch.setenv("LADLE_WORKER_PROBE", "set after the fork server started")
    monkeypatch.delenv("LADLE_CACHE")
    with worker_pool(recipe, run.run_dir / "shards", 1, "cpu", 1) as pool:
        assert pool.submit(os.getenv, "LADLE_WORKER_PROBE").result() == "set after the fork server started"
        assert pool.submit(os.getenv, "LADLE_CACHE").result() is None
        assert pool.submit(torch.get_num_threads).result() == 1
