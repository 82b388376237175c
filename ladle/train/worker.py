"""What a worker process holds, on either backend: the run's prepared shards, and the one step that trains a
task from them. A partition ingredient memory-maps its own part shard only; everything else (sampled and full
views, the trunk, the trunk continued, the baseline) the whole-graph shard, loaded once and kept for the next
whole-graph task the process is given; a part task lets it go first, so its process holds a part worker's memory.
A local pool's process (:func:`start_worker`, :func:`run_task`) may serve several runs in turn; it holds a run's
``workers.lock`` while it trains into that run."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch_geometric.data import Data

from ladle.core.recipe import Recipe, recipe_from_dict
from ladle.core.resources import die_with_parent, reset_peak_rss, return_free_memory
from ladle.core.runlock import working_in
from ladle.graph.inputs import GraphInputs
from ladle.graph.shards import ShardSet, load_shard
from ladle.train.loop import train_task
from ladle.train.task import INGREDIENT, IngredientTask


class ShardWorker:
    """Trains tasks of one run from its shard set ``shards`` on ``device`` (``slot``: this worker's index among the
    local ones, which picks its GPU when there are several)."""

    def __init__(self, recipe: Recipe, shards: ShardSet, slot: int, device: str) -> None:
        if device == "cuda" and torch.cuda.device_count() > 1:
            device = f"cuda:{slot % torch.cuda.device_count()}"  # local workers take GPUs round-robin
        self.recipe, self.shards, self.slot, self.device = recipe, shards, slot, device
        self._graph: tuple[Data, GraphInputs] | None = None

    def graph(self) -> tuple[Data, GraphInputs]:
        """The whole graph (memory-mapped) and its inputs, loaded on first use and kept; sampled batches read
        bag-of-words features from their stored non-zeros (:meth:`~ladle.graph.shards.Shard.feature_rows`)."""
        if self._graph is None:
            shard = load_shard(self.shards.graph())
            shard.data.feature_rows = shard.feature_rows()
            self._graph = shard.data, shard.inputs(self.recipe.model)
        return self._graph

    def run(self, task: IngredientTask, threads: int) -> dict[str, Any]:
        """Train ``task`` with ``threads`` torch threads on its part shard alone (partition views) or on the whole
        graph; its files go to ``task.run_dir``, which must hold the shared init (and the trunk, for a branch). The
        peak memory it reports is its own (from what the process holds when it starts)."""
        torch.set_num_threads(threads)
        part = task.role == INGREDIENT and self.shards.partitioned
        if part:
            self._graph = None  # a part worker holds its part only, whatever it trained before
        return_free_memory()
        reset_peak_rss()
        if part:
            shard = load_shard(self.shards.part(task.k))
            return train_task(self.recipe, shard.data, task, shard.inputs(self.recipe.model), self.slot,
                              self.device, part_view=shard.view(self.recipe.view, self.recipe.seed))
        data, full_inputs = self.graph()
        return train_task(self.recipe, data, task, full_inputs, self.slot, self.device)


_kept: tuple[Any, ShardWorker] | None = None  # this process's worker of the run it trained for last, and its key


def kept_worker(key: Any, build: Callable[[], ShardWorker]) -> ShardWorker:
    """This process's worker for the run ``key`` names: the one kept from its last task when that was the same run
    (its whole graph stays loaded), else ``build()``, kept in its place. Pool processes serve one run at a time."""
    global _kept
    if _kept is None or _kept[0] != key:
        _kept = None  # the last run's graph goes before the next one loads
        _kept = key, build()
    return _kept[1]


class _Process:
    """A local pool process's slot and device, from :func:`start_worker`."""

    slot, device = 0, "cpu"


def start_worker(slots: Any, device: str) -> None:
    """Initialise a local pool process: it dies with its launcher, and takes the next free slot."""
    die_with_parent()
    _Process.slot, _Process.device = slots.get(), device


def run_task(task: IngredientTask, recipe: dict[str, Any], shards: str, threads: int) -> dict[str, Any]:
    """Train ``task`` of the run of ``recipe`` whose shard set is ``shards``, with ``threads`` threads; the run's
    worker is kept for the next task of the same run (the same shards, not prepared again since)."""
    written = (Path(shards) / "shards.json").stat()
    worker = kept_worker((shards, written.st_ino, written.st_mtime_ns, recipe), lambda: ShardWorker(
        recipe_from_dict(recipe), ShardSet.open(Path(shards)), _Process.slot, _Process.device))
    with working_in(task.run_dir):
        return worker.run(task, threads)

