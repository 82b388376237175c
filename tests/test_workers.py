"""Local workers: each loads the whole graph once for all its ingredients, and each part once; a worker that dies
costs its pool's tasks a retry, one that dies again is told apart from its bystanders by running alone and fails
with a message that says so, and ``--resume`` trains it."""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TRUNKLESS
from torch import Tensor, nn

from ladle.core.files import read_json
from ladle.core.recipe import load_recipe
from ladle.core.seeds import worker_seed
from ladle.core.storage import load_state
from ladle.graph.shards import ShardSet
from ladle.train import worker as shard_worker
from ladle.train.launch import DEAD_WORKER, RunResult, resume_run, train_ingredients
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


class DyingNet(nn.Module):
    """A linear model whose worker process dies in training, as one the system kills for memory: ``LADLE_TEST_DIE``
    is ``once:FILE`` (the first worker to remove ``FILE``) or ``seed=S:FILE`` (the task seeded ``S``, every time
    while ``FILE`` exists)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_channels, out_channels)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        mode, _, marker = os.environ.get("LADLE_TEST_DIE", "").partition(":")
        if self.training and marker and os.path.exists(marker):
            if mode == f"seed={torch.initial_seed()}":
                os._exit(1)
            if mode == "once":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(marker)
                    os._exit(1)
        return self.linear(x)


def _run_dying(mode: str, ingredients: int, workers: int, data_root: Path, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch, **options: Any) -> tuple[RunResult, Path]:
    """A run of :class:`DyingNet` whose workers die as ``mode`` says; the run and the marker file."""
    marker = tmp_path / "die"
    marker.touch()
    monkeypatch.setenv("LADLE_TEST_DIE", f"{mode}:{marker}")
    recipe = load_recipe(None, [*TRUNKLESS, "view.kind=random", "epochs=3"])
    run = train_ingredients(recipe, ingredients=ingredients, workers=workers, threads=1, run_dir=tmp_path / "run",
                            data_root=data_root, model=DyingNet, **options)
    return run, marker


def test_a_worker_that_dies_once_costs_a_retry_and_nothing_else(data_root: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Every task of the broken pool (the one whose worker died, the one beside it, one still queued) is tried once
    more in a new pool; the weights are those of the same tasks trained again here, where no worker dies."""
    with caplog.at_level(logging.WARNING):
        run, marker = _run_dying("once", 3, 2, data_root, tmp_path, monkeypatch, save_every=1)
    assert not marker.exists(), "no worker died"
    assert not run.failed and len(run.ingredients) == 3 and "trying it once more in a new pool" in caplog.text
    pooled = _weights(run.run_dir, 3)
    spec = RunSpec.from_json(read_json(run.run_dir / "run.json"), DyingNet)  # the run's recipe: model custom
    worker = ShardWorker(spec.recipe, ShardSet.open(run.run_dir / "shards"), 0, "cpu")
    for task in spec.tasks(run.run_dir):
        worker.run(task, 1)
    for ours, theirs in zip(pooled, _weights(run.run_dir, 3)):
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


def test_only_the_task_whose_worker_dies_alone_fails_its_bystander_finishes_and_resume_trains_it(
        data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """ingredient-00's worker dies every time, first of the one worker's queue: ingredient-01, queued behind it on
    its first death and on its retry, is tried alone and finishes with the weights it has when trained here, where no
    worker dies; ingredient-00 fails plainly, and once the cause is gone ``--resume`` trains it."""
    with caplog.at_level(logging.WARNING):
        run, marker = _run_dying(f"seed={worker_seed(0, 0)}", 2, 1, data_root, tmp_path, monkeypatch, save_every=1)
    assert run.failed == ["ingredient-00"], run.failed
    assert [meta["name"] for meta in run.ingredients] == ["ingredient-01"]
    assert "ingredient-01: trying it alone" in caplog.text
    error = read_json(run.run_dir / "ingredient-00.json")["error"]
    assert error == DEAD_WORKER and error.startswith("BrokenProcessPool: its worker process died, again on its retry, "
                                                     "and once more when it ran alone")
    assert f"`python -m ladle.train --resume --run-dir {run.run_dir}`" in caplog.text
    pooled = load_state(run.run_dir / "ingredient-01.safetensors")
    spec = RunSpec.from_json(read_json(run.run_dir / "run.json"), DyingNet)
    ShardWorker(spec.recipe, ShardSet.open(run.run_dir / "shards"), 0, "cpu").run(spec.tasks(run.run_dir)[1], 1)
    retrained = load_state(run.run_dir / "ingredient-01.safetensors")
    assert all(torch.equal(pooled[key], retrained[key]) for key in retrained)
    marker.unlink()
    resumed = resume_run(run.run_dir, workers=1, model=DyingNet)
    assert not resumed.failed and [meta["name"] for meta in resumed.ingredients] == ["ingredient-00", "ingredient-01"]
    assert read_json(run.run_dir / "run.json")["status"] == "done"
