"""PyG's own loaders behind ladle's sampled views (recipe key ``view.sampler: pyg``).

``cluster`` batches come from PyG's ``ClusterData``/``ClusterLoader`` over ladle's pymetis partition
(torch-sparse from PyPI is built without METIS, so PyG's own METIS call would fail); ``saint-node``,
``saint-edge`` and ``saint-rw`` from ``GraphSAINTNodeSampler``/``EdgeSampler``/``RandomWalkSampler`` with
PyG's normalisation; ``neighbor`` from ``NeighborLoader``. The GraphSAINT samplers need torch-sparse,
``NeighborLoader`` torch-sparse or pyg-lib. Each view wraps the ladle view of the same settings, which
still owns the eval graph, the partition and the step count, and converts PyG's batches to ladle's batch
format (see :mod:`ladle.graph.views`), so trainers and models do not know which sampler drew them.

PyG's samplers draw from torch's global RNG. Here every draw runs on a private RNG state seeded by
``(seed, k, epoch)``: batches are deterministic and the trainer's own random stream (dropout) is
neither read nor advanced by sampling.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch_geometric.typing
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.loader import (
    ClusterData,
    ClusterLoader,
    GraphSAINTEdgeSampler,
    GraphSAINTNodeSampler,
    GraphSAINTRandomWalkSampler,
    NeighborLoader,
)

from ladle.core.errors import LadleError
from ladle.core.recipe import ViewConfig
from ladle.graph.partition import stream_generator
from ladle.graph.views import (
    ClusterView,
    IngredientView,
    NeighborView,
    SaintView,
    batch_graph,
)

# Random streams of these loaders (distinct from ladle's own samplers' streams).
_NORM_STREAM, _EPOCH_STREAM = 11, 12
_SAINT_SAMPLERS = {"saint-node": GraphSAINTNodeSampler, "saint-edge": GraphSAINTEdgeSampler,
                   "saint-rw": GraphSAINTRandomWalkSampler}


@contextmanager
def _global_rng_from(generator: torch.Generator) -> Iterator[None]:
    """Run the block with ``generator``'s state as torch's global CPU RNG, then advance ``generator``.

    The global RNG is restored afterwards, as if the block had drawn nothing.
    """
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(generator.get_state())
        yield
        generator.set_state(torch.get_rng_state())


def _draw(loader: Iterable[Data], steps: int, generator: torch.Generator) -> Iterator[Data]:
    """``steps`` batches of ``loader`` (passes back to back), each drawn from ``generator``'s stream."""
    iterator: Iterator[Data] | None = None
    for _ in range(steps):
        with _global_rng_from(generator):
            batch = next(iterator, None) if iterator is not None else None
            if batch is None:
                iterator = iter(loader)
                batch = next(iterator)
        yield batch


def _topology(data: Data) -> Data:
    """What PyG's loaders need to see of ``data``: its edges and a node id to carry through batches."""
    return Data(edge_index=data.edge_index, num_nodes=data.num_nodes, n_id=torch.arange(data.num_nodes))


def check_sampler(config: ViewConfig) -> None:
    """Fail early, in one line, when ``config`` asks for a PyG loader that cannot run here."""
    if config.sampler == "pyg":
        _require(config.kind)


def _require(kind: str) -> None:
    """A one-line, actionable error when PyG's loader for ``kind`` cannot run here."""
    has_sparse = torch_geometric.typing.WITH_TORCH_SPARSE
    if kind in _SAINT_SAMPLERS and not has_sparse:
        missing = "torch-sparse"
    elif kind == "neighbor" and not (has_sparse or torch_geometric.typing.WITH_PYG_LIB):
        missing = "torch-sparse (or pyg-lib)"
    else:
        return
    raise LadleError(f"view.sampler=pyg with view.kind={kind} needs {missing}: pip install --no-build-isolation "
                     f"'ladle[sparse]' (compiles for minutes), or use view.sampler=ladle")


class PyGView:
    """A ladle view whose training batches one of PyG's loaders draws; the rest is the ladle view's."""

    static = False
    batch_features = True
    loader: Iterable[Data]  # set by each subclass

    def __init__(self, base: IngredientView) -> None:
        self.base = base
        self.kind, self.k, self.stream, self.num_ingredients = base.kind, base.k, base.stream, base.num_ingredients
        self.config, self.seed, self.data, self.num_classes = base.config, base.seed, base.data, base.num_classes

    @property
    def adj(self) -> Any:
        """The ladle view's in-edge CSR (shards are written from it)."""
        return self.base.adj

    def eval_graph(self) -> Data:
        """The ladle view's eval graph: samplers differ only in how they draw training batches."""
        return self.base.eval_graph()

    def steps_per_epoch(self) -> int:
        """As the ladle view."""
        return self.base.steps_per_epoch()

    def describe(self) -> dict:
        """The ladle view's summary, with ``sampler`` and this view's step count."""
        return {**self.base.describe(), "sampler": "pyg", "steps_per_epoch": self.steps_per_epoch()}

    def batches(self, epoch: int) -> Iterator[Data]:
        """``steps_per_epoch`` batches of PyG's loader in ladle's format, deterministic given (seed, stream, epoch)."""
        generator = stream_generator(self.seed, _EPOCH_STREAM, self.stream, epoch)
        for batch in _draw(self.loader, self.steps_per_epoch(), generator):
            yield self._convert(batch)

    def _convert(self, batch: Data) -> Data:
        """PyG's batch (``n_id`` and local ``edge_index``) as a ladle batch, loss on its train nodes."""
        return self._batch(batch.n_id, batch.edge_index, self.data.train_mask[batch.n_id])

    def _batch(self, nodes: Tensor, edge_index: Tensor, loss_mask: Tensor, **extra: Any) -> Data:
        return batch_graph(self.data, nodes, edge_index, loss_mask, self.batch_features, **extra)


class _GivenPartitionClusterData(ClusterData):
    """PyG's ``ClusterData`` over a given node -> part assignment instead of its own METIS call."""

    def __init__(self, data: Data, parts: Tensor, num_parts: int) -> None:
        self._parts = parts
        super().__init__(data, num_parts, log=False)

    def _metis(self, edge_index: Tensor, num_nodes: int) -> Tensor:
        return self._parts


class PyGClusterView(PyGView):
    """ClusterGCN batches from ``ClusterLoader``: ``parts_per_batch`` shuffled parts of ladle's partition."""

    def __init__(self, base: ClusterView) -> None:
        super().__init__(base)
        self.parts = base.parts
        clusters = _GivenPartitionClusterData(_topology(self.data), self.parts, self.config.parts)
        self.loader = ClusterLoader(clusters, batch_size=self.config.parts_per_batch, shuffle=True)

    def steps_per_epoch(self) -> int:
        """One pass of the loader over all parts unless ``view.steps_per_epoch`` says otherwise."""
        return self.config.steps_per_epoch or len(self.loader)


class PyGSaintView(PyGView):
    """GraphSAINT subgraphs and normalisation from PyG's samplers, budgets as in the ladle view.

    PyG's ``node_norm`` (:math:`n / (C_v N)`) is rescaled to ladle's ``loss_weight``
    (:math:`n / (C_v |V_{train}|)`), so the loss is the same estimator; ``edge_norm``
    (:math:`C_u / C_{u,v}`) is the batch's ``edge_weight`` as PyG computes it.
    """

    def __init__(self, base: SaintView) -> None:
        super().__init__(base)
        sampler = _SAINT_SAMPLERS[self.kind]
        extra = {"walk_length": self.config.walk_length} if self.kind == "saint-rw" else {}
        with _global_rng_from(stream_generator(self.seed, _NORM_STREAM, self.stream)):
            self.loader = sampler(_topology(self.data), batch_size=base.budget, num_steps=self.steps_per_epoch(),
                                  sample_coverage=self.config.sample_coverage, log=False, **extra)
        num_train = int(self.data.train_mask.sum())
        self.loss_weight = (self.loader.node_norm * self.data.num_nodes / num_train).float()
        self.edge_weight = self.loader.edge_norm.float()  # per edge of ``data.edge_index``

    def _convert(self, batch: Data) -> Data:
        nodes = batch.n_id
        return self._batch(nodes, batch.edge_index, self.data.train_mask[nodes],
                           loss_weight=self.loss_weight[nodes], edge_weight=batch.edge_norm.float())


class PyGNeighborView(PyGView):
    """GraphSAGE fan-out batches from ``NeighborLoader``, seeds drawn from the train nodes, loss on the seeds."""

    def __init__(self, base: NeighborView) -> None:
        super().__init__(base)
        self.loader = NeighborLoader(_topology(self.data), num_neighbors=list(self.config.fanout),
                                     input_nodes=base.train_nodes, batch_size=base.batch_size, shuffle=True)

    def _convert(self, batch: Data) -> Data:
        graph = self._batch(batch.n_id, batch.edge_index, torch.arange(batch.num_nodes) < batch.batch_size)
        for key in ("num_sampled_nodes", "num_sampled_edges"):  # per-hop counts: pyg-lib gives them, torch-sparse not
            if batch.get(key) is not None:
                graph[key] = list(batch[key])
        return graph


_PYG_VIEWS: dict[str, type[PyGView]] = {
    "cluster": PyGClusterView, "saint-node": PyGSaintView, "saint-edge": PyGSaintView, "saint-rw": PyGSaintView,
    "neighbor": PyGNeighborView,
}


def pyg_view(base: IngredientView) -> IngredientView | PyGView:
    """``base`` with PyG's loader drawing its batches; kinds PyG has no loader for are returned as they are."""
    if base.kind not in _PYG_VIEWS:
        return base
    _require(base.kind)
    return _PYG_VIEWS[base.kind](base)


def with_sampler(view: IngredientView) -> IngredientView | PyGView:
    """``view`` as its config's ``sampler`` draws it: as it is for ``ladle``, through PyG's loaders for ``pyg``."""
    return pyg_view(view) if view.config.sampler == "pyg" else view
