"""A Ray cluster of two nodes on this machine (a head and a second raylet, loopback only) that loses its second
node mid-run: the ingredient that node was training is retried on the head, none is lost or kept twice, and the
weights equal a local run's. About 50 s on 2 cores (two Ray nodes start and stop, 4 x 300 epochs train twice), so it
runs with ``make test``."""
from __future__ import annotations

import csv
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS, run_module

from bench.ray_nodes import kill_node_while_training, loopback_cluster
from ladle.core.files import read_json
from ladle.core.recipe import load_recipe
from ladle.core.storage import load_state
from ladle.train.launch import train_ingredients

K, EPOCHS = 4, 300  # long enough (~3 s an ingredient) that the second node is killed 1 s into one
OVERRIDES = [*TRUNKLESS, "dataset=cora", "view.kind=metis", f"epochs={EPOCHS}", "hidden=16", "seed=5", "patience=1000"]


@pytest.fixture
def cluster() -> Iterator[tuple[str, int]]:
    pytest.importorskip("ray")
    with loopback_cluster() as nodes:
        yield nodes


def test_losing_a_node_loses_no_ingredient(cluster: tuple[str, int], data_root: Path, tmp_path: Path) -> None:
    address, second = cluster
    run_dir = tmp_path / "ray"
    train = subprocess.Popen([sys.executable, "-m", "ladle.train", "--backend", "ray", "--address", address,
                              "-k", str(K), "--run-dir", str(run_dir), "--data-root", str(data_root), *OVERRIDES],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = kill_node_while_training(train, second)
    _, err = train.communicate(timeout=600)
    assert train.returncode == 0, err[-2000:]
    metas = [read_json(run_dir / f"ingredient-{k:02d}.json") for k in range(K)]
    assert all(meta["status"] == "done" for meta in metas) and victim not in {meta["pid"] for meta in metas}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ladle.train.launch.available_cores", lambda: 1)
        local = train_ingredients(load_recipe(None, OVERRIDES), K, workers=2, run_dir=tmp_path / "local",
                                  data_root=data_root)
    for meta in local.ingredients:
        ours, theirs = (load_state(d / f"{meta['name']}.safetensors") for d in (run_dir, local.run_dir))
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs), meta["name"]
    with open(run_dir / "metrics.csv", newline="") as stream:
        rows = Counter((row["name"], row["epoch"]) for row in csv.DictReader(stream) if row["role"] == "ingredient")
    assert len(rows) == K * EPOCHS and set(rows.values()) == {1}, "an ingredient's epochs are missing or kept twice"
    soup = run_module("ladle.soup", "--run-dir", str(run_dir), "--data-root", str(data_root), "--method", "uniform")
    assert soup.returncode == 0, soup.stderr


def test_a_second_node_late_to_start_is_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded machine the second raylet can miss Ray's 30 s to register: it is killed (so it cannot join later)
    and the node started again on another port; after :data:`NODE_STARTS` failures the error is raised."""
    import bench.ray_nodes as nodes

    starts: list[list[str]] = []
    killed: list[set[int]] = []

    def ray_start(args: list[str]) -> None:
        starts.append(args)
        if "--address" in args and sum("--address" in a for a in starts) <= failures:
            raise RuntimeError("ray start failed: The current node timed out during startup.")

    monkeypatch.setattr(nodes, "_ray_start", ray_start)
    monkeypatch.setattr(nodes, "_stop_cluster", lambda temp, port: None)
    monkeypatch.setattr(nodes, "raylet_pid", lambda port: 10_000 + port)
    monkeypatch.setattr(nodes, "_kill_trees", killed.append)
    failures = 1
    with nodes.loopback_cluster() as (_, second):
        tried = [int(args[args.index("--node-manager-port") + 1]) for args in starts if "--address" in args]
        assert len(tried) == 2 and tried[-1] == second and killed == [{10_000 + tried[0]}]
    starts.clear()
    failures = nodes.NODE_STARTS
    with pytest.raises(RuntimeError, match="timed out during startup"), nodes.loopback_cluster():
        pass
    assert sum("--address" in args for args in starts) == nodes.NODE_STARTS
