"""Seeded node splits: per-class (Shchur et al.) and random fractions of the labelled nodes."""
from __future__ import annotations

import torch
from torch import Tensor


def per_class_split(y: Tensor, train_per_class: int, val_per_class: int, seed: int) -> tuple[Tensor, ...]:
    """Shchur et al.: ``train_per_class`` and ``val_per_class`` random nodes of each class, the rest test."""
    generator = torch.Generator().manual_seed(seed)
    masks = [torch.zeros(y.numel(), dtype=torch.bool) for _ in range(3)]
    for c in range(int(y.max()) + 1):
        members = (y == c).nonzero().view(-1)
        members = members[torch.randperm(members.numel(), generator=generator)]
        masks[0][members[:train_per_class]] = True
        masks[1][members[train_per_class:train_per_class + val_per_class]] = True
        masks[2][members[train_per_class + val_per_class:]] = True
    return tuple(masks)


def random_split(eligible: Tensor, train: float, val: float, seed: int) -> tuple[Tensor, ...]:
    """Random ``train``/``val``/rest fractions of the eligible nodes, seeded."""
    generator = torch.Generator().manual_seed(seed)
    nodes = eligible.nonzero().view(-1)
    nodes = nodes[torch.randperm(nodes.numel(), generator=generator)]
    n_train, n_val = int(train * nodes.numel()), int(val * nodes.numel())
    masks = [torch.zeros(eligible.numel(), dtype=torch.bool) for _ in range(3)]
    masks[0][nodes[:n_train]] = True
    masks[1][nodes[n_train:n_train + n_val]] = True
    masks[2][nodes[n_train + n_val:]] = True
    return tuple(masks)
