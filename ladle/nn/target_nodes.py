"""Exact eval-mode logits of a fixed set of target nodes, for scoring many candidate weights cheaply.

A soup scores dozens of candidates on the same validation nodes. Layer ``l`` is computed only where
layer ``l + 1`` reads it (the targets' in-neighbourhood, hop by hop), and the first layer's aggregation
of the input features does not depend on the weights: GCN's ``Â X W = (Â X) W`` and SAGE's
``mean(X) W_l + X W_r`` are linear in ``W``. So ``Â X`` (or the mean and the roots' own ``X``) is computed
once for the 1-hop nodes (the rows of the graph's whole one, where the graph's passes keep it), and each
candidate costs a dense product on those rows and small sparse products above them. On a 2.45M-node graph with 20,000 targets that is ~0.2 s instead of a whole-graph pass.

Normalisation uses whole-graph degrees (from the in-edge CSR), so the logits equal the whole graph's.
"""
from __future__ import annotations

import math
from functools import cached_property

import torch
from torch import Tensor, nn

from ladle.nn.layerwise import LayerwiseInference, csr, row_entries, row_pointers
from ladle.nn.models import GNN, GCNLayer, SAGELayer


def supports(model: nn.Module) -> bool:
    """Whether every layer's maths is linear in its weights after one fixed aggregation (GCN, SAGE)."""
    return isinstance(model, GNN) and model.propagation is None and all(isinstance(conv, (GCNLayer, SAGELayer)) for conv in model.convs)


def sample_targets(mask: Tensor, limit: int, seed: int) -> Tensor:
    """The nodes of ``mask`` (sorted), or a fixed seeded sample of ``limit`` of them when there are more."""
    nodes = mask.nonzero().view(-1)
    if nodes.numel() <= limit:
        return nodes
    generator = torch.Generator().manual_seed(seed)
    return nodes[torch.randperm(nodes.numel(), generator=generator)[:limit]].sort().values


def accuracy_stderr(acc: float, nodes: int) -> float:
    """Standard error of an accuracy measured on ``nodes`` nodes drawn from a larger split."""
    return math.sqrt(max(acc * (1.0 - acc), 0.0) / max(nodes, 1))


class TargetInference:
    """``model(graph)[targets]`` for a fixed ``targets`` (sorted global ids), for any GCN or SAGE weights.

    ``graph``: the whole graph's layer-wise inference, for its in-edge CSR, features (read once, at the first
    call) and normalisation. ``layers``: the model's depth.
    """

    def __init__(self, graph: LayerwiseInference, targets: Tensor, layers: int) -> None:
        self.targets = targets
        rowptr, col, num_nodes = graph.rowptr, graph.col, graph.num_nodes
        gcn_scale, mean_scale = graph.gcn_scale, graph.mean_scale
        levels = [targets]  # levels[i]: the nodes where layer L - i is needed, each a superset of the last
        for _ in range(layers - 1):
            rows = levels[-1]
            sources = col[row_entries(rowptr, rows)]
            levels.append(torch.cat([rows, sources]).unique())
        levels.reverse()  # levels[l]: output nodes of layer l + 1
        self.levels = levels
        local = torch.full((num_nodes,), -1, dtype=torch.long)
        # layer l >= 2 reads layer l - 1 at levels[l - 1]: each row's in-neighbours and itself, in local ids
        self.adj: list[Tensor] = []
        self.self_pos: list[Tensor] = []
        for inner, outer in zip(levels[:-1], levels[1:]):
            local[inner] = torch.arange(inner.numel())
            columns = local[col[row_entries(rowptr, outer)]]
            self.adj.append(csr(row_pointers(rowptr, outer), columns, torch.ones(columns.numel()),
                                (outer.numel(), inner.numel())))
            self.self_pos.append(local[outer])
            local[inner] = -1
        self.gcn_scale = [gcn_scale[level] for level in levels]
        self.mean_scale = [mean_scale[level] for level in levels]
        self.graph = graph
        graph.release()  # the rows read above: their CSR pages go back
        self._aggregated: dict[str, Tensor] = {}
        self._first_out = Tensor()  # the first level's output, the largest of a call: one buffer for every call

    def aggregated(self, mean: bool) -> Tensor:
        """The weight-free first aggregation on the first level, computed once: ``Â X`` (GCN) or the
        in-neighbour mean of ``X`` (SAGE); the graph's own whole cached one (:meth:`LayerwiseInference.aggregated`,
        which its passes reuse) where it keeps one, else from the first level's in-edges alone."""
        key = "mean" if mean else "gcn"
        if key not in self._aggregated:
            first = self.levels[0]
            if self.graph.caches_aggregation:
                out = self.graph.aggregated(mean)[first]
            else:
                neighbours = self.graph.node_rows(first, scaled=not mean) @ self.graph.x.float()
                if mean:
                    out = neighbours.mul_(self.mean_scale[0])
                else:
                    scale = self.gcn_scale[0]
                    out = neighbours.add_(scale * self.graph.x[first].float()).mul_(scale)
            self._aggregated[key] = out
        return self._aggregated[key]

    @cached_property
    def roots(self) -> Tensor:
        """The first level's own features (SAGE's root term)."""
        return self.graph.x[self.levels[0]].float()

    @torch.no_grad()
    def logits(self, model: GNN, first: Tensor | None = None) -> Tensor:
        """``model``'s eval-mode logits of the targets, ``[len(targets), classes]`` (batch-norm statistics as held).
        ``first``: its first layer's output on the first level when the caller has it (:meth:`first_layer`;
        overwritten), else computed."""
        model.eval()
        h = Tensor()
        for i, conv in enumerate(model.convs):
            if i == 0:
                h = self._first(conv) if first is None else first
            else:
                h = self._upper(conv, h, i)
            if i < len(model.convs) - 1:
                h = model.norms[i](h).relu_()  # h is this call's own tensor (or buffer): in place
        return h.clone() if len(model.convs) == 1 else h  # never the buffer the next call overwrites

    @torch.no_grad()
    def first_layer(self, model: GNN) -> Tensor:
        """``model``'s first layer on the first level, before its norm (a tensor of the caller's own). It is linear in
        that layer's weights, so the first layer of a mix of weights is the same mix of these."""
        return self._first(model.convs[0]).clone()

    def _first(self, conv: nn.Module) -> Tensor:
        """The first layer on the first level, into the buffer every call reuses (a fresh block of this size would
        be mapped and its pages zeroed by the kernel at every call)."""
        if isinstance(conv, GCNLayer):
            aggregated, weight = self.aggregated(mean=False), conv.lin.weight
        else:
            assert isinstance(conv, SAGELayer)
            aggregated, weight = self.aggregated(mean=True), conv.lin_l.weight
        if self._first_out.shape != (aggregated.size(0), weight.size(0)):
            self._first_out = torch.empty(aggregated.size(0), weight.size(0))
        out = torch.mm(aggregated, weight.t(), out=self._first_out)
        if isinstance(conv, SAGELayer):
            return out.add_(conv.lin_l.bias).addmm_(self.roots, conv.lin_r.weight.t())
        return out.add_(conv.bias) if conv.bias is not None else out

    def _upper(self, conv: nn.Module, h: Tensor, layer: int) -> Tensor:
        """Layer ``layer`` >= 1 at its (fewer) output nodes: aggregate the inputs first, then project."""
        adj, self_pos = self.adj[layer - 1], self.self_pos[layer - 1]
        if isinstance(conv, GCNLayer):
            scaled = h.mul_(self.gcn_scale[layer - 1])  # h: this call's own activations
            aggregated = (adj @ scaled + scaled[self_pos]) * self.gcn_scale[layer]
            out = aggregated @ conv.lin.weight.t()
            return out + conv.bias if conv.bias is not None else out
        assert isinstance(conv, SAGELayer)
        mean = (adj @ h) * self.mean_scale[layer]
        return mean @ conv.lin_l.weight.t() + conv.lin_l.bias + h[self_pos] @ conv.lin_r.weight.t()
