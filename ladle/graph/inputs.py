"""The inputs a model's forward takes for one graph: node features (dense or sparse) and the
normalised adjacency it aggregates with."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.utils import dropout_edge

from ladle.graph.sparse import SparseMatrix

Features = Tensor | SparseMatrix


@dataclass
class GraphInputs:
    """What a model's forward takes for one graph: node features and its adjacency."""

    x: Features
    adj: SparseMatrix | Tensor
    num_nodes: int

    def to(self, device: torch.device | str) -> GraphInputs:
        """The same inputs on ``device`` (a no-op on CPU)."""
        if torch.device(device).type == "cpu":
            return self
        return GraphInputs(self.x.to(device), self.adj.to(device), self.num_nodes)


EDGE_INDEX_MODELS = ("gat", "gin", "appnp", "custom")  # their layers take PyG's edge_index
SPARSE_FEATURE_MODELS = ("gcn", "sage", "gin", "appnp")  # their first layer projects a sparse feature matrix


def adjacency(edge_index: Tensor, num_nodes: int, model: str, edge_weight: Tensor | None = None,
              degree: Tensor | None = None) -> SparseMatrix | Tensor:
    """The adjacency a model aggregates with; rows are targets (messages flow ``src -> dst``).

    gcn: symmetric normalisation with self-loops; sage: mean over in-neighbours; the others
    (:data:`EDGE_INDEX_MODELS`): ``edge_index`` itself.
    ``edge_weight`` (GraphSAINT's aggregator normalisation) multiplies each edge's entry. ``degree``
    (in-degree of each node in a larger graph this one is cut from) replaces the in-degree counted
    here, so nodes whose in-edges are all present are normalised exactly as in that graph.
    """
    if model in EDGE_INDEX_MODELS:
        return edge_index
    src, dst = edge_index
    weight = torch.ones(src.numel()) if edge_weight is None else edge_weight.float()
    if degree is None:
        degree = torch.zeros(num_nodes).index_add_(0, dst, torch.ones(dst.numel()))
    degree = degree.float()
    if model == "gcn":
        loops = torch.arange(num_nodes)
        src, dst = torch.cat([src, loops]), torch.cat([dst, loops])
        weight = torch.cat([weight, torch.ones(num_nodes)])
        inv_sqrt = (degree + 1).pow(-0.5)
        value = inv_sqrt[src] * weight * inv_sqrt[dst]
    else:
        value = weight / degree.clamp(min=1)[dst]
    return SparseMatrix(dst, src, value, (num_nodes, num_nodes))


SPARSE_MIN_ENTRIES = 1 << 21  # below this many entries (nodes x features) a dense product is cheaper


def use_sparse_features(x: Tensor, model: str) -> bool:
    """Large, wide, mostly-zero features (bag of words) go through a sparse product: 50-100x less work.

    Small batches stay dense: there, building the sparse matrix costs more than it saves.
    """
    if model not in SPARSE_FEATURE_MODELS or x.dim() != 2 or x.size(1) < 256 or x.numel() < SPARSE_MIN_ENTRIES:
        return False
    sample = x[: min(x.size(0), 4096)]
    return bool(torch.count_nonzero(sample) < 0.05 * sample.numel())


def drop_edges(graph: Data, p: float) -> Data:
    """DropEdge (Rong et al. 2020): ``graph`` with each edge dropped with probability ``p``, drawn from torch's
    generator (PyG's ``dropout_edge``); its ``edge_weight`` follows its edges, its whole-graph ``degree`` is scaled
    by ``1 - p`` (what the edges left give in expectation). ``p`` = 0: ``graph`` itself."""
    if not p:
        return graph
    edge_index, kept = dropout_edge(graph.edge_index, p=p)
    dropped = copy.copy(graph)
    dropped.edge_index = edge_index
    if graph.get("edge_weight") is not None:
        dropped.edge_weight = graph.edge_weight[kept]
    if graph.get("degree") is not None:
        dropped.degree = graph.degree * (1 - p)
    return dropped


def graph_inputs(graph: Data, model: str, sparse_features: bool | None = None,
                 features: Features | None = None) -> GraphInputs:
    """Build (once) the inputs of ``graph`` for ``model``: features (``features`` when given, else from
    ``graph.x``) and adjacency (normalised with the graph's ``edge_weight`` and whole-graph ``degree`` where it
    carries them)."""
    if features is not None:
        x: Features = features
    elif sparse_features if sparse_features is not None else use_sparse_features(graph.x, model):
        x = SparseMatrix.from_dense(graph.x)
    else:
        x = graph.x
    adj = adjacency(graph.edge_index, graph.num_nodes, model, graph.get("edge_weight"), graph.get("degree"))
    return GraphInputs(x, adj, graph.num_nodes)
