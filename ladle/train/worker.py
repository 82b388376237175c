"""What a worker process holds, on either backend: the run's prepared shards, and the one step that trains a
task from them. A partition ingredient memory-maps its own part shard only; everything else (sampled and full
views, the trunk, the trunk continued, the baseline) the whole-graph shard, loaded once and kept for the next
task the process is given."""
from __future__ import annotations

from typing import Any

import torch
from torch_geometric.data import Data

from ladle.core.recipe import Recipe
from ladle.graph.inputs import GraphInputs
from ladle.graph.shards import ShardSet, load_shard
from ladle.train.loop import train_task
from ladle.train.task import INGREDIENT, IngredientTask


class ShardWorker:
    """Trains tasks of one run from its shard set ``shards``, with ``threads`` torch threads on ``device``
    (``slot``: this worker's index among the local ones, which picks its GPU when there are several)."""

    def __init__(self, recipe: Recipe, shards: ShardSet, threads: int, slot: int, device: str) -> None:
        torch.set_num_threads(threads)
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

    def run(self, task: IngredientTask) -> dict[str, Any]:
        """Train ``task`` on its part shard alone (partition views) or on the whole graph; its files go to
        ``task.run_dir``, which must hold the shared init (and the trunk, for a branch)."""
        if task.role == INGREDIENT and self.shards.partitioned:
            shard = load_shard(self.shards.part(task.k))
            return train_task(self.recipe, shard.data, task, shard.inputs(self.recipe.model), self.slot,
                              self.device, part_view=shard.view(self.recipe.view, self.recipe.seed))
        data, full_inputs = self.graph()
        return train_task(self.recipe, data, task, full_inputs, self.slot, self.device)
