"""A GNN of your own, as the notebook's last section trains it: any ``torch.nn.Module`` built as
``Class(in_channels, num_classes)`` whose ``forward(x, edge_index)`` returns logits. It lives in a module (not a
notebook cell) because ladle's worker processes import it by name."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import MessagePassing


class MeanConv(MessagePassing):
    """``h_i' = W_root h_i + W_neighbours · mean_{j -> i} h_j``, computed as the mean of the projected ``W h_j``
    (the same, by linearity): the messages carry ``out_channels`` values instead of ``in_channels``."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(aggr="mean")
        self.root = nn.Linear(in_channels, out_channels)
        self.neighbours = nn.Linear(in_channels, out_channels, bias=False)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        return self.root(x) + self.propagate(edge_index, x=self.neighbours(x))


class MeanGNN(nn.Module):
    """Two :class:`MeanConv` layers, 64 hidden channels, ReLU and dropout 0.5 between them."""

    def __init__(self, in_channels: int, num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        self.conv1, self.conv2 = MeanConv(in_channels, hidden), MeanConv(hidden, num_classes)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        h = F.dropout(F.relu(self.conv1(x, edge_index)), 0.5, self.training)
        return self.conv2(h, edge_index)
