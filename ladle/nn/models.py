"""GCN, GraphSAGE, GAT, GIN and APPNP on PyG's convolutions, and the graph inputs they consume.

GCN and SAGE layers keep PyG's parameters (``GCNConv``/``SAGEConv`` state dicts) but aggregate with a
cached :class:`~ladle.graph.sparse.SparseMatrix` (``out = Â · X W``), 2-3x faster than ``edge_index``
message passing on CPU. GAT (per-edge attention), GIN (a sum of neighbours through an MLP) and APPNP (an MLP,
then personalised-PageRank propagation) are PyG's own layers on ``edge_index``; given sparse (bag-of-words)
features, GIN's and APPNP's first linear map projects them before anything else (GIN: ``W (x_i + Σ x_j) =
W x_i + Σ W x_j``), never aggregating the wide features. A user's own class (``model: custom``) is built by
:mod:`ladle.nn.custom`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import APPNP, GATConv, GCNConv, GINConv, SAGEConv

from ladle.core.errors import LadleError
from ladle.core.recipe import Recipe
from ladle.core.resources import total_memory
from ladle.graph.inputs import Features, GraphInputs
from ladle.graph.sparse import SparseMatrix
from ladle.nn.custom import CustomModel, ModelFactory

APPNP_STEPS, APPNP_ALPHA = 10, 0.1  # the APPNP paper's (Gasteiger et al. 2019) and PyG's example's propagation


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


class GINLayer(GINConv):
    """GIN-0 (``eps = 0``): ``MLP(x_i + Σ_{j -> i} x_j)``, PyG's layer and parameters; sparse features are projected
    by the MLP's first linear map before the sum (the same maths, on ``hidden`` columns instead of thousands)."""

    def __init__(self, fan_in: int, hidden: int, fan_out: int) -> None:
        super().__init__(nn.Sequential(nn.Linear(fan_in, hidden), nn.ReLU(), nn.Linear(hidden, fan_out)))

    def forward(self, x: Features, edge_index: Tensor) -> Tensor:  # type: ignore[override]
        if not isinstance(x, SparseMatrix):
            return super().forward(x, edge_index)
        first = self.nn[0]
        projected = project_features(x, first)
        summed = (1 + self.eps) * projected + self.propagate(edge_index, x=projected)  # as GINConv, projected first
        return self.nn[1:](summed + first.bias)


class GNN(nn.Module):
    """A stack of ``layers`` graph convolutions with norm, ReLU and dropout between them (APPNP: ``layers``
    linear layers, then :data:`APPNP_STEPS` parameter-free propagation steps)."""

    def __init__(self, model: str, in_channels: int, hidden: int, out_channels: int, layers: int = 2,
                 dropout: float = 0.5, norm: str = "none", heads: int = 8) -> None:
        super().__init__()
        self.model, self.dropout, self.in_channels = model, dropout, in_channels
        sizes = [in_channels] + [hidden] * (layers - 1) + [out_channels]
        self.convs = nn.ModuleList()
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            last = i == layers - 1
            if model == "gcn":
                self.convs.append(GCNLayer(fan_in, fan_out))
            elif model == "sage":
                self.convs.append(SAGELayer(fan_in, fan_out))
            elif model == "gin":  # GIN-0 (eps = 0): sum of self and neighbours, then a 2-layer MLP
                self.convs.append(GINLayer(fan_in, hidden, fan_out))
            elif model == "appnp":
                self.convs.append(nn.Linear(fan_in, fan_out))
            else:
                in_width = fan_in if i == 0 else hidden
                out_per_head, n_heads = (fan_out, 1) if last else (max(1, hidden // heads), heads)
                self.convs.append(GATConv(in_width, out_per_head, heads=n_heads, dropout=dropout))
                sizes[i + 1] = out_per_head * n_heads
        self.norms = nn.ModuleList(_norm(norm, width) for width in sizes[1:-1])
        self.propagation = APPNP(APPNP_STEPS, APPNP_ALPHA) if model == "appnp" else None

    def forward(self, inputs: GraphInputs) -> Tensor:
        """Logits for every node of ``inputs``."""
        h: Features = inputs.x
        for i, conv in enumerate(self.convs):
            if self.propagation is None:
                h = conv(h, inputs.adj)
            else:
                h = project_features(h, conv) + conv.bias if isinstance(h, SparseMatrix) else conv(h)
            if i < len(self.convs) - 1:
                h = F.dropout(F.relu(self.norms[i](h)), self.dropout, self.training)
        assert isinstance(h, Tensor)
        return h if self.propagation is None else self.propagation(h, inputs.adj)

    def has_batch_norm(self) -> bool:
        """Whether running statistics must be recomputed after merging weights."""
        return any(isinstance(n, nn.BatchNorm1d) for n in self.norms)

    def hops(self) -> int:
        """How far a node's logits read: its layers' hops (APPNP: its propagation steps)."""
        return APPNP_STEPS if self.propagation is not None else len(self.convs)


def _norm(kind: str, width: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm1d(width)
    if kind == "layer":
        return nn.LayerNorm(width)
    return nn.Identity()


TRAINING_BYTES_PER_PARAMETER = 16  # float32 weights, gradients and Adam's two moments


def check_fits(recipe: Recipe, in_channels: int, num_classes: int, model_class: ModelFactory | None = None) -> None:
    """Refuse, before anything is written, a model whose weights and optimizer state alone outgrow this machine's
    memory (counted on the meta device: nothing allocated)."""
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(recipe, in_channels, num_classes, model_class).parameters())
    needed, memory = parameters * TRAINING_BYTES_PER_PARAMETER, total_memory()
    if memory and needed > memory:
        raise LadleError(f"the model (hidden {recipe.hidden}, layers {recipe.layers}) has {parameters:,} parameters: "
                         f"{needed / 2**30:.1f} GiB of weights and optimizer state, above this machine's "
                         f"{memory / 2**30:.1f} GiB; choose a smaller hidden or fewer layers")


def build_model(recipe: Recipe, in_channels: int, num_classes: int,
                model_class: ModelFactory | None = None) -> GNN | CustomModel:
    """The recipe's model (``model``, ``hidden``, ``layers``, ``dropout``, ``norm``, ``heads``); for ``model: custom``,
    ``model_class(in_channels, num_classes)``, which the caller must then give."""
    if recipe.model == "custom":
        if model_class is None:
            raise LadleError("this run's model is your own class (model: custom): pass --model-class "
                             "package.module:Class (model= in the library)")
        return CustomModel(model_class, in_channels, num_classes)
    return GNN(recipe.model, in_channels, recipe.hidden, num_classes, recipe.layers, recipe.dropout,
               recipe.norm, recipe.heads)
