"""GCN, GraphSAGE and GAT on PyG's convolutions, and the graph inputs they consume.

GCN and SAGE layers keep PyG's parameters (``GCNConv``/``SAGEConv`` state dicts) but aggregate with a
cached :class:`~ladle.sparse.SparseMatrix` (``out = Â · X W``), 2-3x faster than ``edge_index``
message passing on CPU. GAT needs per-edge attention and takes ``edge_index``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.nn import GATConv, GCNConv, SAGEConv

from ladle.config import Recipe
from ladle.sparse import SparseMatrix

Features = Tensor | SparseMatrix


def project_features(x: Features, linear: nn.Module) -> Tensor:
    """``x W^T`` for dense or sparse ``x`` (PyG ``Linear`` weights; the bias is added by the caller)."""
    if isinstance(x, SparseMatrix):
        return x.matmul(linear.weight.t())
    return F.linear(x, linear.weight)


class GCNLayer(GCNConv):
    """``H' = Â H W + b`` with a pre-normalised ``Â = D^-1/2 (A + I) D^-1/2``."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(in_channels, out_channels, normalize=False, add_self_loops=False)

    def forward(self, x: Features, adj: SparseMatrix) -> Tensor:  # type: ignore[override]
        out = adj.matmul(project_features(x, self.lin))
        return out + self.bias if self.bias is not None else out


class SAGELayer(SAGEConv):
    """``H' = mean_{j∈N(i)} H_j W_l + b + H_i W_r`` (projection before the mean: same maths, cheaper)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(in_channels, out_channels, aggr="mean")

    def forward(self, x: Features, adj: SparseMatrix) -> Tensor:  # type: ignore[override]
        out = adj.matmul(project_features(x, self.lin_l)) + self.lin_l.bias
        return out + project_features(x, self.lin_r)


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


def adjacency(edge_index: Tensor, num_nodes: int, model: str, edge_weight: Tensor | None = None,
              degree: Tensor | None = None) -> SparseMatrix | Tensor:
    """The adjacency a model aggregates with; rows are targets (messages flow ``src -> dst``).

    gcn: symmetric normalisation with self-loops; sage: mean over in-neighbours; gat: ``edge_index``.
    ``edge_weight`` (GraphSAINT's aggregator normalisation) multiplies each edge's entry. ``degree``
    (in-degree of each node in a larger graph this one is cut from) replaces the in-degree counted
    here, so nodes whose in-edges are all present are normalised exactly as in that graph.
    """
    if model == "gat":
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


def use_sparse_features(x: Tensor, model: str) -> bool:
    """Large, wide, mostly-zero features (bag of words) go through a sparse product: 50-100x less work.

    Small batches stay dense: there, building the sparse matrix costs more than it saves.
    """
    if model == "gat" or x.dim() != 2 or x.size(1) < 256 or x.numel() < 1 << 21:
        return False
    sample = x[: min(x.size(0), 4096)]
    return bool(torch.count_nonzero(sample) < 0.05 * sample.numel())


def graph_inputs(graph: Data, model: str, sparse_features: bool | None = None) -> GraphInputs:
    """Build (once) the inputs of ``graph`` for ``model``: features and adjacency (normalised with the
    graph's ``edge_weight`` and whole-graph ``degree`` where it carries them)."""
    if sparse_features is None:
        sparse_features = use_sparse_features(graph.x, model)
    x: Features = SparseMatrix.from_dense(graph.x) if sparse_features else graph.x
    adj = adjacency(graph.edge_index, graph.num_nodes, model, graph.get("edge_weight"), graph.get("degree"))
    return GraphInputs(x, adj, graph.num_nodes)


class GNN(nn.Module):
    """A stack of ``layers`` graph convolutions with norm, ReLU and dropout between them."""

    def __init__(self, model: str, in_channels: int, hidden: int, out_channels: int, layers: int = 2,
                 dropout: float = 0.5, norm: str = "none", heads: int = 8) -> None:
        super().__init__()
        self.model, self.dropout = model, dropout
        sizes = [in_channels] + [hidden] * (layers - 1) + [out_channels]
        self.convs = nn.ModuleList()
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            last = i == layers - 1
            if model == "gcn":
                self.convs.append(GCNLayer(fan_in, fan_out))
            elif model == "sage":
                self.convs.append(SAGELayer(fan_in, fan_out))
            else:
                in_width = fan_in if i == 0 else hidden
                out_per_head, n_heads = (fan_out, 1) if last else (max(1, hidden // heads), heads)
                self.convs.append(GATConv(in_width, out_per_head, heads=n_heads, dropout=dropout))
                sizes[i + 1] = out_per_head * n_heads
        self.norms = nn.ModuleList(_norm(norm, width) for width in sizes[1:-1])

    def forward(self, inputs: GraphInputs) -> Tensor:
        """Logits for every node of ``inputs``."""
        h: Features = inputs.x
        for i, conv in enumerate(self.convs):
            h = conv(h, inputs.adj)
            if i < len(self.convs) - 1:
                h = F.dropout(F.relu(self.norms[i](h)), self.dropout, self.training)
        assert isinstance(h, Tensor)
        return h

    def has_batch_norm(self) -> bool:
        """Whether running statistics must be recomputed after merging weights."""
        return any(isinstance(n, nn.BatchNorm1d) for n in self.norms)


def _norm(kind: str, width: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm1d(width)
    if kind == "layer":
        return nn.LayerNorm(width)
    return nn.Identity()


def build_model(recipe: Recipe, in_channels: int, num_classes: int) -> GNN:
    """The recipe's model (``model``, ``hidden``, ``layers``, ``dropout``, ``norm``, ``heads``)."""
    return GNN(recipe.model, in_channels, recipe.hidden, num_classes, recipe.layers, recipe.dropout,
               recipe.norm, recipe.heads)
