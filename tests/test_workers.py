"""Local workers: each loads the whole graph once for all its ingredients, and each part once."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS

from ladle.core.recipe import load_recipe
from ladle.core.storage import load_state
from ladle.graph.shards import ShardSet
from ladle.train import worker as shard_worker
from ladle.train.launch import train_ingredients
from ladle.train.task import RunSpec
from ladle.train.worker import ShardWorker


def _weights(run_dir: Path, ingredients: int) -> list[dict[str, torch.Tensor]]:
    return [load_state(run_dir / f"ingredient-{k:02d}.safetensors") for k in range(ingredients)]


@pytest.mark.parametrize("kind, loaded", [("full", ["graph"]), ("metis", ["part-00", "part-01", "part-02"])])
def test_a_worker_loads_the_whole_graph_once_and_each_part_once(kind: str, loaded: list[str], data_root: Path,
                                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                one_thread: None) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, f"view.kind={kind}", "epochs=3"])
    run = train_ingredients(recipe, ingredients=3, workers=1, threads=1, run_dir=tmp_path / "run",
                            data_root=data_root, save_every=0)
    pooled = _weights(run.run_dir, 3)
    loads: list[str] = []
    real_load = shard_worker.load_shard
    monkeypatch.setattr(shard_worker, "load_shard", lambda path: loads.append(Path(path).name) or real_load(path))
    worker = ShardWorker(recipe, ShardSet.open(run.run_dir / "shards"), 0, "cpu")  # in this process: loads are seen
    for task in RunSpec(recipe, 3, save_every=0).tasks(run.run_dir):
        worker.run(task, 1)
    assert loads == loaded
    retrained = _weights(run.run_dir, 3)  # retrained here: bitwise what the pool's worker wrote
    assert all(torch.equal(a[key], b[key]) for a, b in zip(retrained, pooled) for key in a)
