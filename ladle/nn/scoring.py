"""Scoring weights: accuracy and cross-entropy, the soups' :class:`Evaluator`, batch-norm recomputation,
the mean of state dicts, and :class:`SoupResult`, what every soup method returns."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ladle.graph.inputs import GraphInputs
from ladle.nn.models import GNN

Score = tuple[float, ...]


@dataclass(frozen=True)
class Metrics:
    """Accuracy and mean cross-entropy of one model on one node set."""

    acc: float
    loss: float

    def key(self, metric: str) -> Score:
        """What soups maximise: ``acc``, ``-loss``, or accuracy with loss as the tie-break."""
        if metric == "acc":
            return (self.acc,)
        if metric == "loss":
            return (-self.loss,)
        return (self.acc, -self.loss)


def metrics(logits: Tensor, y: Tensor) -> Metrics:
    """Accuracy and mean cross-entropy."""
    return Metrics((logits.argmax(-1) == y).float().mean().item(), F.cross_entropy(logits, y).item())


def metric_sums(logits: Tensor, y: Tensor) -> tuple[float, float]:
    """Correct predictions and summed cross-entropy: :func:`metrics` before the division, to add over
    batches or ranks first."""
    return float((logits.argmax(-1) == y).sum()), float(F.cross_entropy(logits, y, reduction="sum"))


@torch.no_grad()
def evaluate(model: GNN, inputs: GraphInputs, y: Tensor, mask: Tensor) -> Metrics:
    """:func:`metrics` of ``model`` (eval mode) on the nodes in ``mask``; an empty mask scores (0, inf)."""
    model.eval()
    logits = model(inputs)[mask]
    target = y[mask]
    if target.numel() == 0:
        return Metrics(0.0, float("inf"))
    return metrics(logits, target)


@torch.no_grad()
def recompute_batch_norm(model: nn.Module, inputs: GraphInputs) -> None:
    """Reset batch-norm running statistics and re-estimate them in one forward pass (dropout off)."""
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average: one pass gives the exact batch statistics
    model.eval()
    for norm in norms:
        norm.train()
    model(inputs)
    model.eval()
