"""The soups' :class:`Evaluator` (scores a state dict on the validation split, exactly, at any size) and
:class:`SoupResult`, what every soup method returns."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.utils import k_hop_subgraph

from ladle.core.recipe import Recipe
from ladle.core.storage import StateDict
from ladle.core.weights import interpolate
from ladle.graph.inputs import GraphInputs, adjacency, graph_inputs, use_sparse_features
from ladle.graph.sparse import SparseMatrix, select
from ladle.nn.custom import CustomModel, ModelFactory
from ladle.nn.layerwise import LayerwiseInference
from ladle.nn.models import GNN, build_model
from ladle.nn.scoring import Metrics, metrics, recompute_batch_norm
from ladle.nn.target_nodes import TargetInference, sample_targets, supports

Scorer = Callable[[StateDict], "Metrics"]
AlphaScorer = Callable[[float], "Metrics"]  # scores alpha * soup + (1 - alpha) * ingredient for two fixed ends


@dataclass(frozen=True)
class Mixes:
    """The mixes ``alpha * soup + (1 - alpha) * ingredient`` of two fixed ends: the score of each alpha, and the
    weights of the one an alpha search keeps."""

    score: AlphaScorer
    weights: Callable[[float], StateDict]


Interpolation = Callable[[StateDict, StateDict], Mixes]  # (soup, ingredient) -> their mixes


def interpolation_of(score: Scorer) -> Interpolation:
    """Scores each mix by scoring its interpolated weights (:meth:`Evaluator.interpolation` does the same faster)."""
    return lambda soup, ingredient: Mixes(lambda alpha: score(interpolate(soup, ingredient, alpha)),
                                          lambda alpha: interpolate(soup, ingredient, alpha))


@dataclass
class SoupResult:
    """A merged model and how it was chosen (``method``: set by the registry, :class:`ladle.soup.methods.SoupMethod`)."""

    state: StateDict
    evaluations: int
    kept: list[int] = field(default_factory=list)
    alphas: list[float] = field(default_factory=list)
    curves: list[list[tuple[float, float, float]]] = field(default_factory=list)  # (alpha, acc, loss) per step
    order: list[int] = field(default_factory=list)  # the candidates in the order a sequential soup visited them
    seconds: float = 0.0
    method: str = ""

    def report_fields(self) -> dict[str, Any]:
        """Method-specific entries of the soup's report row (none here; subclasses add theirs)."""
        return {}


LAYERWISE_NODES = 100_000  # from this many nodes the soups score validation layer-wise on the whole graph


VALIDATION_SAMPLE = 20_000  # at that scale, candidates are scored on at most this many validation nodes


class Evaluator:
    """Scores weights of one architecture on a graph's splits, cheaply.

    Whole splits are scored by layer-wise inference (:mod:`ladle.nn.layerwise`), which bounds memory at
    scale. Validation, on small graphs, needs only the L-hop neighbourhood of the validation nodes: that
    sub-graph (with the full graph's normalisation) is built once and every candidate is scored on it,
    exactly. With ``layerwise`` (default: from :data:`LAYERWISE_NODES` nodes on, where that neighbourhood
    is most of the graph) validation is layer-wise too, no whole-graph adjacency is ever built, and
    batch-norm statistics are re-estimated on the training nodes layer by layer
    (:meth:`~ladle.nn.layerwise.LayerwiseInference.logits`). There, GCN and SAGE candidates are scored on a
    fixed seeded sample of at most :data:`VALIDATION_SAMPLE` validation nodes (all of them when fewer), by
    :class:`~ladle.nn.target_nodes.TargetInference` (exact logits of those nodes, the first aggregation computed
    once); :meth:`validation_nodes` says how many. Report rows are always scored on whole splits.
    The neighbourhoods are built on first use. ``inference``: the graph's layer-wise inference when the
    caller has it (a shard's memory-mapped CSR), else built from ``data.edge_index``. ``recompute_bn``: re-estimate
    batch-norm statistics of merged weights on the training nodes before scoring them.
    """

    def __init__(self, recipe: Recipe, data: Data, layerwise: bool | None = None,
                 inference: LayerwiseInference | None = None, recompute_bn: bool = True,
                 model_class: ModelFactory | None = None) -> None:
        self.recipe, self.data, self.recompute_bn = recipe, data, recompute_bn
        self.model: GNN | CustomModel = build_model(recipe, data.num_features, data.num_classes, model_class)
        self.sparse_features = use_sparse_features(data.x, recipe.model)
        self.forward = "layer-wise" if LayerwiseInference.supports(self.model) else "whole-graph"
        wanted = data.num_nodes >= LAYERWISE_NODES if layerwise is None else layerwise
        self.layerwise = wanted and self.forward == "layer-wise"
        self.hops = self.model.hops() if isinstance(self.model, GNN) else None  # your own model's: unknown
        self._inference = inference
        self.train_nodes = data.train_mask.nonzero().view(-1)
        self._kept_mix: tuple[StateDict, Tensor] | None = None  # the weights an alpha search kept, their first layer
        self._fold: Tensor | None = None  # the validation nodes scored, as positions among them (None: all)

    @cached_property
    def inference(self) -> LayerwiseInference:
        """Layer-wise whole-graph inference (from ``data.edge_index`` unless given)."""
        return self._inference or LayerwiseInference.from_data(self.data)

    @cached_property
    def val_targets(self) -> TargetInference:
        """Exact logits of the (sampled) validation nodes for any GCN/SAGE weights (layer-wise mode)."""
        targets = sample_targets(self.data.val_mask, VALIDATION_SAMPLE, self.recipe.seed)
        return TargetInference(self.inference, targets, self.recipe.layers)

    def validation_nodes(self) -> tuple[int, int]:
        """How many validation nodes :meth:`validation` scores candidates on, of how many."""
        total = int(self.data.val_mask.sum())
        if self._samples():
            return min(total, VALIDATION_SAMPLE), total
        return total, total

    def folds(self, seed: int) -> tuple[Tensor, Tensor]:
        """Two seeded halves of the validation nodes :meth:`validation` scores (positions among them), for a
        cross-fitted choice: what is chosen on one half is judged on the other."""
        count = self.validation_nodes()[0]
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
        return order[: count // 2].sort().values, order[count // 2:].sort().values

    @contextmanager
    def scoring_on(self, fold: Tensor) -> Iterator[None]:
        """Inside, :meth:`validation` and the mixes of :meth:`interpolation` score ``fold``'s validation nodes only
        (positions among those scored, from :meth:`folds`)."""
        previous, self._fold = self._fold, fold
        try:
            yield
        finally:
            self._fold = previous

    def _val_metrics(self, logits: Tensor, y: Tensor) -> Metrics:
        """Metrics of the scored validation nodes' ``logits`` and labels, on the current fold's alone when set."""
        if self._fold is not None:
            logits, y = logits[self._fold], y[self._fold]
        return metrics(logits, y)

    def _samples(self) -> bool:
        return self.layerwise and supports(self.model) and not self._recomputes()

    @cached_property
    def full_adj(self) -> Tensor | SparseMatrix:
        """The whole graph's normalised adjacency (for the neighbourhoods' exact normalisation)."""
        return adjacency(self.data.edge_index, self.data.num_nodes, self.recipe.model)

    @cached_property
    def whole_inputs(self) -> GraphInputs:
        """The whole graph's inputs, for models without a layer-wise path (:attr:`forward` ``whole-graph``)."""
        return graph_inputs(self.data, self.recipe.model, self.sparse_features)

    @cached_property
    def val(self) -> tuple[GraphInputs, Tensor, Tensor]:
        """The validation neighbourhood: inputs, labels of the validation nodes, where they are in it."""
        return self._neighbourhood(self.data.val_mask)

    @cached_property
    def train_hood(self) -> tuple[GraphInputs, Tensor, Tensor]:
        """The training neighbourhood, where batch-norm statistics are re-estimated."""
        return self._neighbourhood(self.data.train_mask)

    def _neighbourhood(self, mask: Tensor) -> tuple[GraphInputs, Tensor, Tensor]:
        """Inputs of the sub-graph around ``mask``'s nodes that their logits read (the model's hops), their labels,
        and where they are."""
        seeds = mask.nonzero().view(-1)
        if self.hops is None:  # your own model's reach is unknown: the whole graph
            return self.whole_inputs, self.data.y[seeds], seeds
        nodes, edge_index, mapping, _ = k_hop_subgraph(seeds, self.hops, self.data.edge_index,
                                                       relabel_nodes=True, num_nodes=self.data.num_nodes)
        x = self.data.x[nodes]
        features = SparseMatrix.from_dense(x) if self.sparse_features else x
        adj = edge_index if isinstance(self.full_adj, Tensor) else select(self.full_adj, nodes)
        return GraphInputs(features, adj, nodes.numel()), self.data.y[seeds], mapping

    def _recomputes(self) -> bool:
        return self.recompute_bn and self.model.has_batch_norm()

    @torch.no_grad()
    def full_logits(self, state: StateDict) -> Tensor:
        """Logits of every node, layer by layer over batches of adjacency rows (bounded memory at scale)."""
        self._kept_mix = None  # a pass needs the memory more than a next alpha search its soup's first layer
        if self.layerwise:
            self.model.load_state_dict(state)
            bn_nodes = self.train_nodes if self._recomputes() else None
            return self.inference.logits(self.model, bn_nodes)
        model = self.load(state)
        if self.forward == "whole-graph":
            model.eval()
            return model(self.whole_inputs)
        return self.inference.logits(model)

    def load(self, state: StateDict) -> GNN | CustomModel:
        """The model holding ``state``; batch-norm statistics recomputed on the training nodes."""
        self.model.load_state_dict(state)
        if self._recomputes():
            if self.layerwise:
                self.inference.logits(self.model, self.train_nodes)
            else:
                recompute_batch_norm(self.model, self.train_hood[0])
        return self.model

    @torch.no_grad()
    def logits(self, state: StateDict, inputs: GraphInputs) -> Tensor:
        model = self.load(state)
        model.eval()
        return model(inputs)

    def validation(self, state: StateDict) -> Metrics:
        """Validation accuracy and loss of ``state`` (on the validation neighbourhood, or layer-wise: on the
        sampled validation nodes for GCN/SAGE without batch norm to recompute, else on all of them)."""
        if self._samples():
            self.model.load_state_dict(state)
            return self._val_metrics(self.val_targets.logits(self.model), self.data.y[self.val_targets.targets])
        if self.layerwise:
            mask = self.data.val_mask
            return self._val_metrics(self.full_logits(state)[mask], self.data.y[mask])
        inputs, y, where = self.val
        return self._val_metrics(self.logits(state, inputs)[where], y)

    def validation_from(self, logits: Tensor) -> Metrics | None:
        """The figure :meth:`validation` gives for the weights whose :meth:`full_logits` these are, read from them where
        it scores the same nodes' whole-graph logits (layer-wise: the sampled nodes' rows, or the whole split); else
        ``None`` (a small graph's validation neighbourhood is scored apart)."""
        if self._samples():
            targets = self.val_targets.targets
            return self._val_metrics(logits[targets], self.data.y[targets])
        if self.layerwise:
            mask = self.data.val_mask
            return self._val_metrics(logits[mask], self.data.y[mask])
        return None

    def interpolation(self, soup: StateDict, ingredient: StateDict) -> Mixes:
        """Scores ``alpha * soup + (1 - alpha) * ingredient`` for any alpha, as :meth:`validation` scores those weights.
        On the sampled validation nodes the first layer's output is linear in its weights, so it is the same mix of
        the two ends' outputs: two dense products for a whole alpha search instead of one an alpha (the largest
        part of a scoring there); and the mix a search keeps carries its first layer to the next search, whose soup it
        is, so each later search computes only its ingredient's."""
        if not self._samples():
            return interpolation_of(self.validation)(soup, ingredient)
        targets, y = self.val_targets, self.data.y[self.val_targets.targets]
        ends = []
        for state in (ingredient, soup):
            if self._kept_mix is not None and state is self._kept_mix[0]:
                ends.append(self._kept_mix[1])
                continue
            self.model.load_state_dict(state)
            ends.append(targets.first_layer(self.model))
        self._kept_mix = None
        mixed = torch.empty_like(ends[0])

        def score(alpha: float) -> Metrics:
            self.model.load_state_dict(interpolate(soup, ingredient, alpha))
            return self._val_metrics(targets.logits(self.model, torch.lerp(ends[0], ends[1], alpha, out=mixed)), y)

        def weights(alpha: float) -> StateDict:
            state = interpolate(soup, ingredient, alpha)
            self._kept_mix = (state, torch.lerp(ends[0], ends[1], alpha))
            return state
        return Mixes(score, weights)

    def split(self, state: StateDict, mask_name: str) -> Metrics:
        """Accuracy and loss of ``state`` on a whole split of the full graph."""
        mask = self.data[mask_name]
        return metrics(self.full_logits(state)[mask], self.data.y[mask])

    def test_accuracy(self, state: StateDict) -> float:
        """Test accuracy of ``state``, from one whole-graph pass: a report's figure, never a choice's."""
        return self.split_metrics(self.full_logits(state))["test_acc"]

    def split_metrics(self, logits: Tensor) -> dict[str, float]:
        """Validation accuracy and loss and test accuracy of full-graph ``logits`` (a report row's figures); the test
        split's from each node's predicted class alone, no copy of its logits (most of them, on some graphs)."""
        val_mask, test_mask, y = self.data.val_mask, self.data.test_mask, self.data.y
        val = metrics(logits[val_mask], y[val_mask])
        test_acc = (logits.argmax(1) == y)[test_mask].float().mean().item()
        return {"val_acc": val.acc, "val_loss": val.loss, "test_acc": test_acc}
