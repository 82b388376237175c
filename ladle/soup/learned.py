"""Learned soups (Zuber et al., 2025, *Enhanced Soups for Graph Neural Networks*).

The soup is ``θ_l = Σ_k softmax(a_l)_k · θ_{k,l}``: one mixing weight per ingredient ``k`` and layer ``l``
(a layer's convolution and its norm share them), learned by Adam on the validation loss with the
ingredients frozen, through :func:`torch.func.functional_call` on the recipe's :class:`~ladle.nn.models.GNN`.

Honest protocol: the validation nodes are split once, by ``seed``, into two halves. The *fit* half gives
the loss that is descended; the *held-out* half scores the mixing weights at the start of every epoch
and after the last, and the best-scoring weights (accuracy, then lower loss; earliest on ties) are
the soup. Only validation labels are ever read; test labels never are.

``learned``: each epoch is one forward/backward on the L-hop neighbourhood of the validation nodes
(:class:`~ladle.soup.evaluator.Evaluator`'s ``val``), exact full-graph outputs. ``learned-partition``: the graph
is split into ``parts`` METIS parts; each step is one forward/backward on the induced subgraph of
``parts_per_step`` random parts (ClusterGCN normalisation, cut edges dropped), an epoch visits every
part once, and the held-out score is a no-grad pass over fixed groups of parts. Every forward then
touches about ``parts_per_step / parts`` of the graph, so the soup can be learned where the validation
neighbourhood does not fit one worker's memory: it never builds the whole graph's normalised adjacency,
its validation neighbourhood or a whole-graph forward (``ladle.soup`` scores this method's candidates
layer-wise); what it holds of the whole graph is the unnormalised in-edge CSR that METIS reads.
Mixed batch-norm statistics are used as they are while learning (models run in eval mode, so the loss
is deterministic); :func:`ladle.soup.soup_run` recomputes them for the final soup. Both methods
register in :data:`ladle.soup.methods.SOUPS` (``learned-partition`` is not part of ``all``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call
from torch_geometric.data import Data
from tqdm import tqdm

from ladle.core.errors import LadleError
from ladle.core.recipe import ViewConfig
from ladle.core.storage import StateDict
from ladle.graph.inputs import GraphInputs, adjacency
from ladle.graph.sparse import SparseMatrix
from ladle.graph.views import ClusterView, build_view
from ladle.nn.models import GNN
from ladle.nn.scoring import Metrics, metric_sums, metrics
from ladle.soup.evaluator import Evaluator, SoupResult
from ladle.soup.methods import SoupInputs, register

log = logging.getLogger(__name__)


def layer_of(key: str) -> str:
    """The mixing group of a state-dict key: ``layer<i>`` for the first index in its path
    (``convs.1.lin.weight`` and ``norms.1.bias`` -> ``layer1``), else its first component."""
    parts = key.split(".")
    index = next((p for p in parts if p.isdigit()), None)
    return f"layer{index}" if index is not None else parts[0]


class Mixture:
    """K frozen state dicts stacked per key, mixed with one weight vector over K per layer group.

    Floating-point entries are mixed; integer buffers (``num_batches_tracked``) come from the first.
    Keys in ``buffers`` (batch-norm running statistics) are mixed with the same weights, detached:
    the loss is differentiated through parameters only.
    """

    def __init__(self, states: Sequence[StateDict], buffers: Collection[str] = ()) -> None:
        if not states:
            raise LadleError("a learned soup needs at least one ingredient")
        self.num_ingredients = len(states)
        self.keys = list(states[0])
        keys = [k for k, v in states[0].items() if v.is_floating_point()]
        self.layers = sorted({layer_of(k) for k in keys}, key=lambda name: (len(name), name))
        self.group = {k: self.layers.index(layer_of(k)) for k in keys}
        self.stacked = {k: torch.stack([s[k].detach() for s in states]) for k in keys}
        self.fixed = {k: v for k, v in states[0].items() if not v.is_floating_point()}
        self.buffers = set(buffers)

    def mix(self, weights: Tensor) -> StateDict:
        """``Σ_k weights[g, k] · state_k`` for every key of group ``g``; differentiable in ``weights``
        (layers × K). One-hot rows reproduce an ingredient exactly (the other products are zeros)."""
        frozen = weights.detach()
        return {k: torch.tensordot((frozen if k in self.buffers else weights)[self.group[k]], self.stacked[k], dims=1)
                if k in self.stacked else self.fixed[k] for k in self.keys}


@dataclass
class LearnedSoupResult(SoupResult):
    """A :class:`~ladle.soup.evaluator.SoupResult` (``alphas``: each ingredient's mean weight over layers) plus the
    learned weights: ``mixing[l][k]`` for layer ``layers[l]``, and ``history``: ``(epoch, held-out acc,
    held-out loss)`` of the weights at the start of each epoch (the last row: after the last epoch)."""

    layers: list[str] = field(default_factory=list)
    mixing: list[list[float]] = field(default_factory=list)
    history: list[tuple[int, float, float]] = field(default_factory=list)
    best_epoch: int = 0

    def report_fields(self) -> dict[str, Any]:
        """The learned weights and the selected epoch, for the soup's report row."""
        return {"layers": self.layers, "mixing": self.mixing, "best_epoch": self.best_epoch}


def split_validation(val_mask: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """Positions (into the sorted validation nodes) of the fit half and the held-out half, seeded."""
    count = int(val_mask.sum())
    if count < 2:
        raise LadleError(f"a learned soup needs at least 2 validation nodes to fit and to select; got {count}")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order[: (count + 1) // 2].sort().values, order[(count + 1) // 2:].sort().values


def _mixed_logits(model: GNN, mixture: Mixture, weights: Tensor, inputs: GraphInputs) -> Tensor:
    return functional_call(model, mixture.mix(weights), (inputs,))


class _Neighbourhood:
    """``learned``: the validation neighbourhood, one forward/backward an epoch (it also scores the held half)."""

    def __init__(self, evaluator: Evaluator, mixture: Mixture, fit: Tensor, held: Tensor) -> None:
        self.model, self.mixture = evaluator.model, mixture
        self.inputs, y, where = evaluator.val
        self.fit_where, self.fit_y = where[fit], y[fit]
        self.held_where, self.held_y = where[held], y[held]
        self.forwards = 0

    def run_epoch(self, logits: Tensor, optimizer: torch.optim.Optimizer) -> Metrics:
        """One Adam step on the fit half; returns the held-out score of the weights before the step."""
        out = _mixed_logits(self.model, self.mixture, logits.softmax(-1), self.inputs)
        self.forwards += 1
        held = metrics(out[self.held_where].detach(), self.held_y)
        optimizer.zero_grad()
        F.cross_entropy(out[self.fit_where], self.fit_y).backward()
        optimizer.step()
        return held

    @torch.no_grad()
    def score(self, weights: Tensor) -> Metrics:
        """Held-out accuracy and loss of ``weights``."""
        self.forwards += 1
        out = _mixed_logits(self.model, self.mixture, weights, self.inputs)
        return metrics(out[self.held_where], self.held_y)


class _Partitions:
    """``learned-partition``: steps on random groups of METIS parts; held half scored over fixed groups."""

    def __init__(self, evaluator: Evaluator, mixture: Mixture, fit: Tensor, held: Tensor, parts: int,
                 parts_per_step: int, seed: int) -> None:
        data: Data = evaluator.data
        self.model, self.mixture, self.kind = evaluator.model, mixture, evaluator.recipe.model
        # ClusterGCN's METIS parts (seeded); the groups are drawn here, so no batch copies dense features.
        view = build_view(data, ViewConfig(kind="cluster", parts=parts, parts_per_batch=parts_per_step), 0, 1, seed)
        assert isinstance(view, ClusterView)
        self.members, self.parts_per_step = view.members, parts_per_step
        self.generator = torch.Generator().manual_seed(seed)
        self.features = data.x.to_sparse() if evaluator.sparse_features else data.x  # COO: fast row selection
        self.graph = view.adj  # the in-edge CSR METIS read: each step's induced subgraph comes from its rows
        val_nodes = data.val_mask.nonzero().view(-1)
        # Only validation labels are copied; every other node reads -1 and is never a target.
        self.labels = torch.full((data.num_nodes,), -1, dtype=torch.long)
        self.labels[val_nodes] = data.y[val_nodes]
        self.fit = torch.zeros(data.num_nodes, dtype=torch.bool)
        self.fit[val_nodes[fit]] = True
        self.held = torch.zeros(data.num_nodes, dtype=torch.bool)
        self.held[val_nodes[held]] = True
        groups = [self._nodes(torch.arange(i, min(i + parts_per_step, len(self.members))))
                  for i in range(0, len(self.members), parts_per_step)]
        self.score_groups = [nodes for nodes in groups if bool(self.held[nodes].any())]
        self.forwards = 0

    def _nodes(self, group: Tensor) -> Tensor:
        """The sorted nodes of the parts in ``group``."""
        return torch.cat([self.members[i] for i in group.tolist()]).sort().values

    def _inputs(self, nodes: Tensor) -> GraphInputs:
        """Inputs of the subgraph induced by ``nodes`` (normalised on it, as ClusterGCN does)."""
        x: Tensor | SparseMatrix
        if self.features.is_sparse:
            rows = self.features.index_select(0, nodes)  # unique entries; SparseMatrix sorts them, no coalesce
            x = SparseMatrix(*rows._indices(), rows._values(), (nodes.numel(), self.features.size(1)))
        else:
            x = self.features[nodes]
        edge_index, _ = self.graph.induced(nodes)
        return GraphInputs(x, adjacency(edge_index, nodes.numel(), self.kind), nodes.numel())

    def run_epoch(self, logits: Tensor, optimizer: torch.optim.Optimizer) -> Metrics:
        """Score the current weights, then one Adam step per random group of parts (each part once)."""
        held = self.score(logits.detach().softmax(-1))
        order = torch.randperm(len(self.members), generator=self.generator)
        for group in order.split(self.parts_per_step):
            nodes = self._nodes(group)
            targets = self.fit[nodes]
            if not bool(targets.any()):
                continue
            out = _mixed_logits(self.model, self.mixture, logits.softmax(-1), self._inputs(nodes))
            self.forwards += 1
            optimizer.zero_grad()
            F.cross_entropy(out[targets], self.labels[nodes[targets]]).backward()
            optimizer.step()
        return held

    @torch.no_grad()
    def score(self, weights: Tensor) -> Metrics:
        """Held-out accuracy and loss of ``weights``, summed over the fixed groups of parts."""
        correct, loss, count = 0.0, 0.0, 0
        for nodes in self.score_groups:
            targets = self.held[nodes]
            out = _mixed_logits(self.model, self.mixture, weights, self._inputs(nodes))[targets]
            self.forwards += 1
            y = self.labels[nodes[targets]]
            hits, loss_sum = metric_sums(out, y)
            correct, loss, count = correct + hits, loss + loss_sum, count + y.numel()
        return Metrics(correct / count, loss / count)


def learned_soup(states: Sequence[StateDict], evaluator: Evaluator, *, partition: bool = False, epochs: int = 100,
                 lr: float = 0.05, parts: int = 16, parts_per_step: int = 4, seed: int = 0) -> LearnedSoupResult:
    """Learn per-layer softmax mixing weights over ``states`` on half of the validation nodes; keep the
    weights that score best on the other half (see the module docstring). ``evaluations`` counts
    forward passes (on the validation neighbourhood, or on groups of parts with ``partition``)."""
    if epochs < 0 or lr <= 0:
        raise LadleError(f"learned soup: epochs must be >= 0 and lr > 0, got {epochs} and {lr}")
    if partition and not 1 <= parts_per_step <= parts:
        raise LadleError(f"learned soup on parts: need 1 <= parts_per_step <= parts, got {parts_per_step} and {parts}")
    start = time.perf_counter()
    mixture = Mixture(states, buffers={name for name, _ in evaluator.model.named_buffers()})
    fit, held = split_validation(evaluator.data.val_mask, seed)
    source: _Neighbourhood | _Partitions
    if partition:
        source = _Partitions(evaluator, mixture, fit, held, parts, parts_per_step, seed)
    else:
        source = _Neighbourhood(evaluator, mixture, fit, held)
    evaluator.model.eval()
    logits = torch.zeros(len(mixture.layers), mixture.num_ingredients, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=lr)
    history: list[tuple[int, float, float]] = []
    best: tuple[tuple[float, ...], int, Tensor] | None = None
    for epoch in tqdm(range(epochs + 1), desc="learned soup", leave=False, disable=None):
        weights = logits.detach().softmax(-1)
        score = source.run_epoch(logits, optimizer) if epoch < epochs else source.score(weights)
        history.append((epoch, score.acc, score.loss))
        if best is None or score.key("acc+loss") > best[0]:
            best = (score.key("acc+loss"), epoch, weights)
    assert best is not None
    _, best_epoch, weights = best
    with torch.no_grad():
        state = {k: v.clone() for k, v in mixture.mix(weights).items()}
    log.info("learned soup (%s): held-out val acc %.4f at epoch %d of %d, %d forward passes",
             "parts" if partition else "validation neighbourhood", history[best_epoch][1], best_epoch, epochs,
             source.forwards)
    return LearnedSoupResult(
        state, source.forwards,
        kept=list(range(mixture.num_ingredients)), alphas=weights.mean(0).tolist(),
        seconds=time.perf_counter() - start, layers=list(mixture.layers), mixing=weights.tolist(),
        history=history, best_epoch=best_epoch)


@register("learned", fitted=True, scales=False)
def _learned(inputs: SoupInputs) -> LearnedSoupResult:
    return learned_soup(inputs.states, inputs.evaluator, seed=inputs.seed)


@register("learned-partition", in_all=False, layerwise=True, fitted=True, scales=False)
def _learned_partition(inputs: SoupInputs) -> LearnedSoupResult:
    return learned_soup(inputs.states, inputs.evaluator, partition=True, seed=inputs.seed)
