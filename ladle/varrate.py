"""``python -m ladle.varrate``: partition-parallel training whose workers talk, compressed at a variable rate.

The comparison to ladle's zero-communication soups, after Cervino et al. (2024), *Distributed training
of large GNNs with variable communication rates* (VARCO). Each of K ranks owns one part of a METIS or
random partition. At every layer ``H' = Â (H W) + b`` a rank projects its own rows (``Z = H W``), sends
its peers the rows of ``Z`` they aggregate from (its boundary nodes), compressed with ratio ``r_t``,
receives theirs (its halo), and aggregates with its rows of the full-graph ``Â``. Exchanging after the
projection sends ``hidden`` columns instead of the raw features (8,415 on Coauthor Physics). The
feature gradients of the halo rows travel back the same way; parameter gradients are all-reduced so
every rank holds one model, whose state dict is ladle's :class:`~ladle.models.GNN`.

``r_t`` follows a schedule, heavy compression early and light late (``linear``, ``step``), or is fixed;
``full`` (``r = 1``) is exact full-graph training and ``none`` drops the cut edges (no halo). Every
byte a rank puts on the wire is counted: forward halo, backward halo and the gradient all-reduce
(each rank's gradient once, ``K x model size`` a step, the unit of the soup's final gather of K
models). Transport is ``torch.distributed`` (gloo on CPU, NCCL on GPU): uneven ``all_to_all_single``
for halos, ``all_reduce`` for gradients and metrics.
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import logging
import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.data import Data
from tqdm import tqdm

from ladle.checkpoints import atomic_open, read_json, save_state, write_json
from ladle.config import Recipe, load_recipe, recipe_from_dict
from ladle.data import load_dataset
from ladle.errors import LadleError, run_cli
from ladle.launch import available_cores, resolve_device
from ladle.models import GNN, Features, GCNLayer, SAGELayer, project_features, adjacency, build_model, use_sparse_features
from ladle.sparse import SparseMatrix
from ladle.views import PARTITION_KINDS, ViewConfig, build_view

log = logging.getLogger("ladle.varrate")  # also when run as __main__ or in spawned ranks

SCHEDULES = ("full", "fixed", "linear", "step", "none")
SUPPORTED_MODELS = ("gcn", "sage")


# ---------------------------------------------------------------- compression operators


def kept_columns(width: int, rate: float) -> int:
    """Columns a payload of ``width``-wide rows keeps at ratio ``rate``: ``int(width / rate)``, at least 1."""
    return max(1, min(width, int(width / rate)))


class Compressor(ABC):
    """Rows of width ``d`` at ratio ``r`` -> a smaller payload the receiver decodes back to width ``d``.

    Encoding and decoding are pure functions of ``(rows, rate, key)``: both ends of an exchange derive
    the same choices from the shared ``key``. At ``rate <= 1`` every compressor is lossless.
    """

    name: ClassVar[str]

    @abstractmethod
    def payload_columns(self, width: int, rate: float) -> int:
        """Columns of the payload of one row (its dtype is the one :meth:`encode` returns)."""

    @abstractmethod
    def encode(self, rows: Tensor, rate: float, key: int) -> Tensor:
        """The payload of ``rows`` (one payload row per input row)."""

    @abstractmethod
    def decode(self, payload: Tensor, width: int, rate: float, key: int) -> Tensor:
        """Float rows of width ``width`` from a payload :meth:`encode` made with the same ``rate``, ``key``."""


class Truncate(Compressor):
    """The authors' scheme: send the first ``int(d / r)`` columns; the receiver pads the rest with zeros.

    A linear projection ``P``, so the backward pass (which sends ``P^T g``, the same columns of the
    gradient) gives the exact gradient of the compressed forward.
    """

    name = "truncate"

    def payload_columns(self, width: int, rate: float) -> int:
        return kept_columns(width, rate)

    def encode(self, rows: Tensor, rate: float, key: int) -> Tensor:
        return rows[:, : kept_columns(rows.size(1), rate)]

    def decode(self, payload: Tensor, width: int, rate: float, key: int) -> Tensor:
        return F.pad(payload, (0, width - payload.size(1)))


class RandomMask(Compressor):
    """Send ``int(d / r)`` random columns, the same for every row and both ends (drawn from ``key``).

    The receiver scatters them back scaled by ``d / kept``, so the halo is unbiased over keys; like
    :class:`Truncate` it is linear and its backward is the exact gradient.
    """

    name = "mask"

    def payload_columns(self, width: int, rate: float) -> int:
        return kept_columns(width, rate)

    @staticmethod
    def columns(width: int, rate: float, key: int) -> Tensor:
        """The sorted column ids kept at ``(width, rate, key)``."""
        kept = kept_columns(width, rate)
        if kept == width:
            return torch.arange(width)
        generator = torch.Generator().manual_seed(key)
        return torch.randperm(width, generator=generator)[:kept].sort().values

    def encode(self, rows: Tensor, rate: float, key: int) -> Tensor:
        if kept_columns(rows.size(1), rate) == rows.size(1):
            return rows
        return rows[:, self.columns(rows.size(1), rate, key).to(rows.device)]

    def decode(self, payload: Tensor, width: int, rate: float, key: int) -> Tensor:
        if payload.size(1) == width:
            return payload
        out = payload.new_zeros(payload.size(0), width)
        out[:, self.columns(width, rate, key).to(payload.device)] = payload * (width / payload.size(1))
        return out


class Int8(Compressor):
    """Per-row absmax int8 quantisation (plus a float32 scale per row) of the first ``int(4d / r)`` columns.

    Four int8 values cost one float32, so at ``r >= 4`` the payload is as large as :class:`Truncate`'s
    and carries 4x the columns at lower precision; ``1 < r < 4`` sends all ``d`` columns in int8.
    The rounding has no gradient: the backward pass quantises the gradient the same way
    (straight-through). Payload rows are bytes: ``kept`` int8 values then the 4 bytes of the scale.
    """

    name = "int8"

    @staticmethod
    def kept(width: int, rate: float) -> int:
        """Quantised columns at ``(width, rate)``."""
        return kept_columns(width, rate / 4)

    def payload_columns(self, width: int, rate: float) -> int:
        return width if rate <= 1 else self.kept(width, rate) + 4

    def encode(self, rows: Tensor, rate: float, key: int) -> Tensor:
        if rate <= 1:
            return rows
        columns = rows[:, : self.kept(rows.size(1), rate)]
        scale = (columns.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny).float()
        quantised = torch.round(columns / scale).to(torch.int8)
        return torch.cat([quantised.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)

    def decode(self, payload: Tensor, width: int, rate: float, key: int) -> Tensor:
        if rate <= 1:
            return payload
        kept = payload.size(1) - 4
        scale = payload[:, kept:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # fresh storage: aligned
        values = payload[:, :kept].contiguous().view(torch.int8).float() * scale
        return F.pad(values, (0, width - kept))


COMPRESSORS: dict[str, type[Compressor]] = {c.name: c for c in (Truncate, RandomMask, Int8)}


def build_compressor(name: str) -> Compressor:
    """The compressor called ``name`` (``truncate``, ``mask`` or ``int8``)."""
    if name not in COMPRESSORS:
        raise LadleError(f"unknown compressor {name!r} (one of: {', '.join(COMPRESSORS)})")
    return COMPRESSORS[name]()


# ---------------------------------------------------------------- rate schedules


@dataclass(frozen=True)
class RateSchedule:
    """The compression ratio ``r_t`` of each epoch; ``None`` means no exchange at all (``none``).

    ``full``: 1. ``fixed``: ``rate_max`` throughout. ``linear``: from ``rate_max`` at epoch 0 to
    ``rate_min`` after ``fraction`` of the epochs, then ``rate_min``. ``step``: the ``steps`` ratios in
    turn, each for an equal share of that ``fraction``, the last one to the end (default: four
    geometric steps from ``rate_max`` to ``rate_min``, e.g. 64, 16, 4, 1).
    """

    kind: str = "linear"
    rate_max: float = 64.0
    rate_min: float = 1.0
    fraction: float = 1.0
    steps: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise LadleError(f"--schedule must be one of {', '.join(SCHEDULES)}; got {self.kind!r}")
        if not 1 <= self.rate_min <= self.rate_max:
            raise LadleError(f"rates must satisfy 1 <= --rate-min <= --rate-max; got {self.rate_min}, {self.rate_max}")
        if not 0 < self.fraction <= 1:
            raise LadleError(f"--rate-fraction must be in (0, 1]; got {self.fraction}")
        if any(rate < 1 for rate in self.steps):
            raise LadleError(f"--rate-steps must all be >= 1; got {list(self.steps)}")

    def levels(self) -> tuple[float, ...]:
        """The plateaus of the ``step`` schedule."""
        if self.steps:
            return self.steps
        ratio = self.rate_min / self.rate_max
        return tuple(self.rate_max * ratio ** (i / 3) for i in range(4))

    def rate(self, epoch: int, epochs: int) -> float | None:
        """The ratio of ``epoch`` (0-based) of ``epochs``."""
        if self.kind == "none":
            return None
        if self.kind == "full":
            return 1.0
        if self.kind == "fixed":
            return self.rate_max
        progress = min(1.0, epoch / max(1.0, self.fraction * epochs))
        if self.kind == "linear":
            return self.rate_max + (self.rate_min - self.rate_max) * progress
        levels = self.levels()
        return levels[min(len(levels) - 1, int(progress * len(levels)))]

    def describe(self) -> dict[str, Any]:
        """JSON-able settings."""
        return {**asdict(self), "steps": list(self.levels()) if self.kind == "step" else []}


# ---------------------------------------------------------------- partition plan


@dataclass(eq=False)
class HaloPlan:
    """What rank ``rank`` of ``world`` owns, sends and receives at every layer.

    Local rows are the owned nodes (sorted global ids) followed by the halo, grouped by owner rank in
    rank order: exactly the layout ``all_to_all_single`` returns. ``send_index`` lists the local rows
    each peer needs, grouped by peer in rank order and sorted by global id within a peer, which is
    the order that peer expects them in.
    """

    rank: int
    world: int
    owned: Tensor
    halo: Tensor
    send_index: Tensor
    send_counts: list[int]
    recv_counts: list[int]
    adj: SparseMatrix  # owned rows x (owned + halo) columns of the full graph's normalised adjacency
    induced_adj: SparseMatrix  # the owned nodes' own subgraph, normalised on its own (schedule ``none``)

    def to(self, device: torch.device | str) -> HaloPlan:
        """The same plan with its tensors on ``device``."""
        return HaloPlan(self.rank, self.world, self.owned, self.halo, self.send_index.to(device), self.send_counts,
                        self.recv_counts, self.adj.to(device), self.induced_adj.to(device))

    def describe(self) -> dict[str, int]:
        """Sizes: owned nodes, halo rows received and boundary rows sent per layer."""
        return {"owned": int(self.owned.numel()), "halo": int(self.halo.numel()),
                "sent": int(self.send_index.numel())}


def build_plan(edge_index: Tensor, num_nodes: int, parts: Tensor, rank: int, world: int, model: str) -> HaloPlan:
    """The halo plan of ``rank`` from the whole graph and the part id of every node.

    A node ``v`` owned by ``p`` is in the halo of ``q != p`` when some node of ``q`` aggregates from it
    (a non-zero ``Â[u, v]`` with ``u`` in ``q``). Every rank computes the same table of such pairs, so
    its sends and its peers' receives agree without a handshake.
    """
    full = adjacency(edge_index, num_nodes, model)
    assert isinstance(full, SparseMatrix)
    crow = full.csr.crow_indices()
    row = torch.repeat_interleave(torch.arange(num_nodes), crow[1:] - crow[:-1])
    col, value = full.csr.col_indices(), full.csr.values()
    cross = parts[row] != parts[col]
    # (needing part, node) pairs, unique, ordered by (owner, node) within each needing part
    needing, node = parts[row[cross]], col[cross]
    pairs = torch.unique(needing * num_nodes + node)
    needing, node = pairs // num_nodes, pairs % num_nodes
    owner = parts[node]

    owned = (parts == rank).nonzero().view(-1)
    mine = needing == rank
    incoming = node[mine][torch.argsort(owner[mine] * num_nodes + node[mine])]
    recv_counts = torch.bincount(parts[incoming], minlength=world).tolist()
    position = torch.full((num_nodes,), -1, dtype=torch.long)
    position[owned] = torch.arange(owned.numel())
    outgoing = owner == rank  # pairs already sorted by (needing part, node)
    send_index = position[node[outgoing]]
    send_counts = torch.bincount(needing[outgoing], minlength=world).tolist()
    position[incoming] = owned.numel() + torch.arange(incoming.numel())

    local_rows = parts[row] == rank
    adj = SparseMatrix(position[row[local_rows]], position[col[local_rows]], value[local_rows],
                       (owned.numel(), owned.numel() + incoming.numel()))
    src, dst = edge_index
    inside = (parts[src] == rank) & (parts[dst] == rank)
    induced = torch.stack([position[src[inside]], position[dst[inside]]])
    induced_adj = adjacency(induced, owned.numel(), model)
    assert isinstance(induced_adj, SparseMatrix)
    return HaloPlan(rank, world, owned, incoming, send_index, send_counts, recv_counts, adj, induced_adj)


def partition_nodes(data: Data, kind: str, parts: int, seed: int) -> Tensor:
    """The part id of every node: the same METIS / random partition the soup's ``view.kind`` uses."""
    if kind not in PARTITION_KINDS:
        raise LadleError(f"--partition must be one of {', '.join(PARTITION_KINDS)}; got {kind!r}")
    try:
        view = build_view(data, ViewConfig(kind=kind), 0, parts, seed)
    except ValueError as error:
        raise LadleError(f"--partition {kind} with {parts} workers: {error}") from None
    return view.parts  # type: ignore[attr-defined]


# ---------------------------------------------------------------- halo exchange and byte accounting


class PeerFailure(RuntimeError):
    """Another rank died or stalled: a collective failed or timed out."""


@contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn a failed collective (gloo/NCCL raise RuntimeError when a peer closes its connection or the
    group's timeout passes) into a :class:`PeerFailure` that says which one."""
    try:
        yield
    except RuntimeError as error:
        raise PeerFailure(f"{what} failed: {_first_line(error)}") from None


@dataclass
class Traffic:
    """Bytes this rank sent, by purpose (payload bytes; a peer's own rows are never sent)."""

    forward_halo: int = 0
    backward_halo: int = 0
    allreduce: int = 0
    eval_halo: int = 0

    FIELDS: ClassVar[tuple[str, ...]] = ("forward_halo", "backward_halo", "allreduce", "eval_halo")

    def values(self) -> list[int]:
        """The counters in :attr:`FIELDS` order."""
        return [getattr(self, name) for name in self.FIELDS]


def exchange_key(seed: int, step: int, layer: int) -> int:
    """The shared random key of one layer's exchange in one step (the same on every rank)."""
    return int(np.random.SeedSequence([seed, step, layer]).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass(eq=False)
class HaloExchange:
    """One step's halo exchanges: which plan, compressor and ratio, and where to count the bytes.

    ``evaluating`` exchanges count as ``eval_halo`` (they have no backward).
    """

    plan: HaloPlan
    compressor: Compressor
    rate: float
    seed: int
    step: int
    traffic: Traffic
    evaluating: bool = False

    def __call__(self, rows: Tensor, layer: int) -> Tensor:
        """The halo rows of layer ``layer`` given this rank's rows (differentiable)."""
        return _HaloFunction.apply(rows, self, layer)

    def transfer(self, rows: Tensor, layer: int, send_counts: list[int], recv_counts: list[int]) -> tuple[Tensor, int]:
        """Compress ``rows`` (grouped by peer, ``send_counts`` each), swap, decompress; return (rows, bytes sent)."""
        key = exchange_key(self.seed, self.step, layer)
        payload = self.compressor.encode(rows, self.rate, key).contiguous()
        received = payload.new_empty((sum(recv_counts), self.compressor.payload_columns(rows.size(1), self.rate)))
        with collective(f"halo exchange of layer {layer}"):
            dist.all_to_all_single(received, payload, recv_counts, send_counts)
        return self.compressor.decode(received, rows.size(1), self.rate, key), payload.numel() * payload.element_size()


class _HaloFunction(torch.autograd.Function):
    """Forward: send the boundary rows, receive the halo. Backward: send the halo's gradients back to
    their owners, who add them to the rows they sent (same compressor, same key)."""

    @staticmethod
    def forward(ctx, rows: Tensor, exchange: HaloExchange, layer: int) -> Tensor:  # type: ignore[override]
        plan = exchange.plan
        ctx.exchange, ctx.layer, ctx.num_rows = exchange, layer, rows.size(0)
        halo, sent = exchange.transfer(rows[plan.send_index], layer, plan.send_counts, plan.recv_counts)
        if exchange.evaluating:
            exchange.traffic.eval_halo += sent
        else:
            exchange.traffic.forward_halo += sent
        return halo

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        exchange: HaloExchange = ctx.exchange
        plan = exchange.plan
        back, sent = exchange.transfer(grad.contiguous(), ctx.layer, plan.recv_counts, plan.send_counts)
        exchange.traffic.backward_halo += sent
        rows = grad.new_zeros(ctx.num_rows, grad.size(1)).index_add_(0, plan.send_index, back)
        return rows, None, None


# ---------------------------------------------------------------- the model on one partition


def check_model(recipe: Recipe) -> None:
    """varrate drives GCN and SAGE layers and per-node norms; anything else is a user error."""
    if recipe.model not in SUPPORTED_MODELS:
        raise LadleError(f"varrate supports gcn/sage; got model={recipe.model} (use model=gcn or model=sage)")
    if recipe.norm == "batch":
        raise LadleError("varrate supports norm=none or norm=layer (batch norm would need statistics "
                         "synchronised across ranks)")


def partition_forward(model: GNN, x: Features, plan: HaloPlan, exchange: HaloExchange | None) -> Tensor:
    """Logits of the owned nodes: each layer projects the owned rows, appends the halo rows it
    receives and aggregates with the plan's rows of ``Â`` (``exchange=None``: the induced subgraph)."""
    h: Features = x
    adj = plan.adj if exchange is not None else plan.induced_adj
    last = len(model.convs) - 1
    for i, conv in enumerate(model.convs):
        if isinstance(conv, GCNLayer):
            out = adj.matmul(_with_halo(project_features(h, conv.lin), exchange, i))
            out = out + conv.bias if conv.bias is not None else out
        elif isinstance(conv, SAGELayer):
            out = adj.matmul(_with_halo(project_features(h, conv.lin_l), exchange, i)) + conv.lin_l.bias
            out = out + project_features(h, conv.lin_r)
        else:
            raise LadleError(f"varrate supports gcn/sage; got a {type(conv).__name__} layer")
        h = out
        if i < last:
            h = F.dropout(F.relu(model.norms[i](h)), model.dropout, model.training)
    assert isinstance(h, Tensor)
    return h


def _with_halo(rows: Tensor, exchange: HaloExchange | None, layer: int) -> Tensor:
    return rows if exchange is None else torch.cat([rows, exchange(rows, layer)])


@dataclass(eq=False)
class Shard:
    """What one rank holds: its plan and its rows of the features, labels and split masks.

    ``totals`` are the whole graph's train / val / test counts: losses and accuracies divide by them.
    """

    plan: HaloPlan
    x: Features
    y: Tensor
    train: Tensor
    val: Tensor
    test: Tensor
    totals: tuple[int, int, int]
    num_classes: int

    @classmethod
    def build(cls, data: Data, parts: Tensor, rank: int, world: int, model: str,
              device: torch.device | str = "cpu") -> Shard:
        """Slice ``data`` for ``rank``; features go sparse when the whole matrix would (as in ladle.train)."""
        plan = build_plan(data.edge_index, data.num_nodes, parts, rank, world, model)
        x = data.x[plan.owned]
        features: Features = SparseMatrix.from_dense(x) if use_sparse_features(data.x, model) else x
        totals = (int(data.train_mask.sum()), int(data.val_mask.sum()), int(data.test_mask.sum()))
        masks = [data[key][plan.owned].to(device) for key in ("train_mask", "val_mask", "test_mask")]
        return cls(plan.to(device), features.to(device), data.y[plan.owned].to(device), *masks, totals,
                   int(data.num_classes))


def partition_loss(logits: Tensor, shard: Shard) -> Tensor:
    """This rank's share of the full-graph mean training loss: ``sum(ce over own train nodes) / |V_train|``.

    Summed over ranks (the gradient all-reduce), the gradients are those of the full-graph mean.
    """
    return F.cross_entropy(logits[shard.train], shard.y[shard.train], reduction="sum") / max(1, shard.totals[0])


def allreduce_gradients(model: GNN, traffic: Traffic) -> None:
    """Sum every parameter's gradient over ranks in one flat ``all_reduce``; count it as one model size sent."""
    params = list(model.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    with collective("gradient all-reduce"):
        dist.all_reduce(flat)
    traffic.allreduce += flat.numel() * flat.element_size()
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


# ---------------------------------------------------------------- the training loop of one rank


@dataclass(frozen=True)
class VarrateOptions:
    """Settings of a varrate run besides the recipe (the command line's flags)."""

    workers: int = 4
    partition: str = "metis"
    schedule: RateSchedule = field(default_factory=RateSchedule)
    compressor: str = "truncate"
    device: str = "cpu"
    timeout: float = 300.0
    threads: int = 0  # 0: cores / ranks on this machine


def _metrics(model: GNN, shard: Shard, exchange: HaloExchange) -> list[float]:
    """This rank's correct train, val and test predictions and val loss sum (exact exchange, no dropout)."""
    model.eval()
    with torch.no_grad():
        logits = partition_forward(model, shard.x, shard.plan, exchange)
    hit = logits.argmax(dim=-1) == shard.y
    val_loss = F.cross_entropy(logits[shard.val], shard.y[shard.val], reduction="sum")
    return [float(hit[shard.train].sum()), float(hit[shard.val].sum()), float(hit[shard.test].sum()), float(val_loss)]


def train_partition(recipe: Recipe, shard: Shard, options: VarrateOptions, run_dir: Path | None) -> dict[str, Any] | None:
    """Train one rank's side of the run (call on every rank of an initialised process group).

    Adam on the rank's share of the loss, gradients all-reduced, validation and test accuracy from an
    exact exchange, summed over ranks; the best-validation epoch's weights and test accuracy are
    kept, with early stopping after ``patience`` epochs. Rank 0 writes ``model.safetensors``,
    ``varrate.json`` and the report into ``run_dir`` and returns the metadata; other ranks return None.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = shard.y.device
    compressor = build_compressor(options.compressor)
    torch.manual_seed(recipe.seed)  # the soup's shared initialisation, identical on every rank
    model = build_model(recipe, shard.x.shape[1], shard.num_classes).to(device)
    torch.manual_seed(recipe.seed * 1_000 + rank)  # dropout differs by rank
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sizes = _gather_rows([*shard.plan.describe().values(), int(shard.train.sum())], device)
    n_train, n_val, n_test = shard.totals

    history: list[dict[str, Any]] = []
    best_key, best_epoch, best_state, best_test, stale = (-1.0, 0.0), -1, copy.deepcopy(model.state_dict()), 0.0, 0
    cumulative = 0
    bar = tqdm(total=recipe.epochs, desc=f"varrate {options.schedule.kind}", dynamic_ncols=True,
               disable=True if rank != 0 else None)
    if rank == 0:
        log.info("training %d ranks, %s partition, schedule %s, compressor %s, %d epochs", world, options.partition,
                 options.schedule.kind, options.compressor, recipe.epochs)
    epoch = 0
    for epoch in range(recipe.epochs):
        traffic = Traffic()
        rate = options.schedule.rate(epoch, recipe.epochs)
        began = time.perf_counter()
        try:
            model.train()
            exchange = None if rate is None else HaloExchange(shard.plan, compressor, rate, recipe.seed, epoch, traffic)
            loss = partition_loss(partition_forward(model, shard.x, shard.plan, exchange), shard)
            optimizer.zero_grad()
            loss.backward()
            allreduce_gradients(model, traffic)
            optimizer.step()
            step_seconds = time.perf_counter() - began
            exact = HaloExchange(shard.plan, compressor, 1.0, recipe.seed, epoch, traffic, evaluating=True)
            local = torch.tensor(_metrics(model, shard, exact) + [float(loss.detach())] + traffic.values(),
                                 dtype=torch.float64, device=device)
            with collective("metrics all-reduce"):
                dist.all_reduce(local)
        except PeerFailure as error:
            bar.close()
            raise PeerFailure(f"rank {rank}, epoch {epoch}: {error}; another rank died or stalled for more than "
                              f"{options.timeout:g} s (--timeout) - check its output") from None
        total = local.cpu().tolist()
        val_acc, val_loss = total[1] / max(1, n_val), total[3] / max(1, n_val)
        test_acc = total[2] / max(1, n_test)
        forward, backward, allreduce, eval_halo = (int(v) for v in total[5:9])
        cumulative += forward + backward + allreduce
        if (val_acc, -val_loss) > best_key:
            best_key, best_epoch, best_test, stale = (val_acc, -val_loss), epoch, test_acc, 0
            if rank == 0:
                best_state = copy.deepcopy(model.state_dict())
        else:
            stale += 1
        history.append({
            "epoch": epoch, "rate": rate, "loss": total[4], "train_acc": total[0] / max(1, n_train),
            "val_acc": val_acc, "val_loss": val_loss, "test_acc": test_acc, "best_test_acc": best_test,
            "forward_halo": forward, "backward_halo": backward, "allreduce": allreduce, "eval_halo": eval_halo,
            "training_bytes": cumulative, "step_seconds": step_seconds,
            "eval_seconds": time.perf_counter() - began - step_seconds,
        })
        bar.update(1)
        bar.set_postfix(rate="-" if rate is None else f"{rate:.1f}", val=f"{val_acc:.3f}", best=f"{best_key[0]:.3f}",
                        halo=_megabytes(forward + backward), allreduce=_megabytes(allreduce))
        if stale >= recipe.patience:
            break
    bar.close()
    if rank != 0:
        return None
    assert run_dir is not None
    model.load_state_dict(best_state)
    save_state(run_dir / "model.safetensors", model.state_dict())
    meta = _summary(recipe, options, world, history, best_epoch, best_key, best_test, epoch + 1, sizes, model)
    meta["run_dir"] = str(run_dir.resolve())
    write_json(run_dir / "varrate.json", meta)
    write_bytes_report(run_dir, f"varrate on {recipe.dataset}: {options.schedule.kind}", [report_entry(meta)])
    return meta


def _gather_rows(values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``values``, as a list by rank (a sum-reduce of one row per rank)."""
    table = torch.zeros(dist.get_world_size(), len(values), dtype=torch.long, device=device)
    table[dist.get_rank()] = torch.tensor(values, device=device)
    dist.all_reduce(table)
    return table.cpu().tolist()


def _summary(recipe: Recipe, options: VarrateOptions, world: int, history: list[dict[str, Any]], best_epoch: int,
             best_key: tuple[float, float], best_test: float, epochs_run: int, sizes: list[list[int]],
             model: GNN) -> dict[str, Any]:
    def total(key: str) -> int:
        return sum(row[key] for row in history)

    return {
        "recipe": recipe.to_dict(), "workers": world, "partition": options.partition, "compressor": options.compressor,
        "schedule": options.schedule.describe(), "device": options.device, "threads": options.threads,
        "ranks": [{"rank": r, "owned": s[0], "halo": s[1], "sent": s[2], "train": s[3]} for r, s in enumerate(sizes)],
        "epochs_run": epochs_run, "best_epoch": best_epoch, "val_acc": best_key[0], "val_loss": -best_key[1],
        "test_acc": best_test, "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "bytes": {"forward_halo": total("forward_halo"), "backward_halo": total("backward_halo"),
                  "allreduce": total("allreduce"), "eval_halo": total("eval_halo"),
                  "training": history[-1]["training_bytes"] if history else 0},
        "seconds_per_epoch": {"step": total("step_seconds") / max(1, len(history)),
                              "eval": total("eval_seconds") / max(1, len(history))},
        "history": history, "status": "done",
        "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "local",
    }


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.2f}MB"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


# ---------------------------------------------------------------- reports: accuracy against bytes


def report_entry(meta: dict[str, Any]) -> dict[str, Any]:
    """A run's entry of :func:`write_bytes_report`: its figures and its (bytes, best-so-far test acc) curve."""
    schedule = meta["schedule"]
    name = schedule["kind"]
    if name == "fixed":
        name = f"fixed r={schedule['rate_max']:g}"
    if name not in ("full", "none"):
        name += f" ({meta['compressor']})"
    seconds = meta["seconds_per_epoch"]
    halo, halo_curve = 0, []
    for row in meta["history"]:
        halo += row["forward_halo"] + row["backward_halo"]
        halo_curve.append((halo, row["best_test_acc"]))
    return {"name": name, "test_acc": meta["test_acc"], "bytes": meta["bytes"]["training"], "halo_bytes": halo,
            "allreduce_bytes": meta["bytes"]["allreduce"], "step_seconds": seconds["step"],
            "eval_seconds": seconds["eval"], "epochs": meta["epochs_run"],
            "curve": [(row["training_bytes"], row["best_test_acc"]) for row in meta["history"]],
            "halo_curve": halo_curve}


def write_bytes_report(out_dir: Path, title: str, entries: Sequence[dict[str, Any]]) -> list[Path]:
    """``report.md`` (a table) and ``accuracy-bytes.png`` (when matplotlib is importable): test accuracy
    against the cumulative bytes sent while training (left) and against the halo bytes alone (right),
    one curve per entry, or a star for an entry without a curve (the soup).

    Entries: ``name``, ``test_acc``, ``bytes``, and optionally ``halo_bytes``, ``allreduce_bytes``,
    ``step_seconds`` and ``eval_seconds`` (per epoch), ``epochs``, ``curve`` and ``halo_curve`` (lists of
    ``(cumulative bytes, best-validation test accuracy so far)``) and ``note``.
    """
    def cell(entry: dict[str, Any], key: str, fmt: str) -> str:
        return format(entry[key], fmt) if entry.get(key) is not None else "-"

    lines = [f"# {title}", "", "Test accuracy at the best-validation epoch against the bytes sent while training "
             "(forward halo + backward halo + gradient all-reduce, summed over ranks).", "",
             "| run | test acc | training bytes | halo bytes | all-reduce bytes | step s/epoch | eval s/epoch | epochs "
             "| note |", "|---|---|---|---|---|---|---|---|---|"]
    for entry in entries:
        lines.append(f"| {entry['name']} | {entry['test_acc']:.4f} | {entry['bytes']:,} | "
                     f"{cell(entry, 'halo_bytes', ',')} | {cell(entry, 'allreduce_bytes', ',')} | "
                     f"{cell(entry, 'step_seconds', '.3f')} | {cell(entry, 'eval_seconds', '.3f')} | "
                     f"{cell(entry, 'epochs', 'd')} | "
                     f"{entry.get('note', '')} |")
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_open(out_dir / "report.md", "w") as stream:
        stream.write("\n".join(lines) + "\n")
    written = [out_dir / "report.md"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: no plot (pip install 'ladle[plots]')")
        return written
    figure, (total_axis, halo_axis) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colours = plt.get_cmap("tab20" if len(entries) > 10 else "tab10")
    for i, entry in enumerate(entries):
        colour = colours(i % colours.N)
        for axis, key, final in ((total_axis, "curve", entry["bytes"]),
                                 (halo_axis, "halo_curve", entry.get("halo_bytes", 0))):
            curve = [(b, acc) for b, acc in entry.get(key, []) if b > 0]
            if curve:
                axis.plot([b for b, _ in curve], [acc for _, acc in curve], color=colour, lw=1.2, label=entry["name"])
                axis.plot([final], [entry["test_acc"]], "o", color=colour)
            elif axis is total_axis:  # a run that sent nothing on this axis cannot sit on a log scale
                axis.plot([max(1, final)], [entry["test_acc"]], "*", ms=12, color=colour, label=entry["name"])
    total_axis.set_xlabel("cumulative bytes sent while training (halo + all-reduce)")
    halo_axis.set_xlabel("cumulative halo bytes (forward + backward)")
    total_axis.set_ylabel("test accuracy (best validation so far)")
    for axis in (total_axis, halo_axis):
        axis.set_xscale("log")
    total_axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    with atomic_open(out_dir / "accuracy-bytes.png") as stream:
        figure.savefig(stream, format="png", dpi=110)
    plt.close(figure)
    return written + [out_dir / "accuracy-bytes.png"]


# ---------------------------------------------------------------- process group and launch


def init_group(device: torch.device, timeout: float, init_method: str = "env://", rank: int | None = None,
               world: int | None = None) -> None:
    """Join the process group: gloo on CPU, NCCL on GPU, with ``timeout`` seconds before a stall is an error.

    ``rank``/``world`` None: read from the environment (torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``).
    """
    kwargs: dict[str, Any] = {} if rank is None else {"rank": rank, "world_size": world}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            timeout=dt.timedelta(seconds=timeout), **kwargs)


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of a rank: the CPU, or GPU ``local_rank`` (mod the GPUs visible) made current."""
    if device != "cuda":
        return torch.device("cpu")
    chosen = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    torch.cuda.set_device(chosen)
    return chosen


def load_shard(recipe: Recipe, partition: str, device: torch.device, data_root: str | None, local_rank: int) -> Shard:
    """Load the dataset, partition it (rank 0, broadcast to all) and keep this rank's shard.

    The first rank of each machine loads (stages) the dataset before the others, so they never race
    on the cache.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if local_rank != 0:
        dist.barrier()
    data = load_dataset(recipe.dataset, data_root, recipe.split, recipe.features)
    if local_rank == 0:
        dist.barrier()
    parts = partition_nodes(data, partition, world, recipe.seed) if rank == 0 else torch.empty(
        data.num_nodes, dtype=torch.long)
    parts = parts.to(device)
    dist.broadcast(parts, src=0)
    return Shard.build(data, parts.cpu(), rank, world, recipe.model, device)


def run_rank(recipe: Recipe, options: VarrateOptions, run_dir: Path | None, data_root: str | None, local_rank: int,
             init_method: str = "env://", rank: int | None = None, world: int | None = None) -> dict[str, Any] | None:
    """Everything one rank does: join the group, load its shard, train, leave the group."""
    torch.set_num_threads(options.threads)
    device = rank_device(options.device, local_rank)
    init_group(device, options.timeout, init_method, rank, world)
    try:
        shard = load_shard(recipe, options.partition, device, data_root, local_rank)
        return train_partition(recipe, shard, options, run_dir)
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, world: int, port: int, recipe_dict: dict[str, Any], options: VarrateOptions,
                  run_dir: Path, data_root: str | None) -> None:
    """Entry point of a rank started by :func:`run_local` (a fresh, spawned process)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_rank(recipe_from_dict(recipe_dict), options, run_dir, data_root, rank, f"tcp://127.0.0.1:{port}", rank, world)


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def new_run_dir(schedule: str, checkpoints_root: Path = Path("checkpoints")) -> Path:
    """``checkpoints/varrate-<schedule>-<time>`` (suffixed when taken)."""
    base = checkpoints_root / f"varrate-{schedule}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    return path


def check_inputs(recipe: Recipe, options: VarrateOptions, data_root: str | None) -> None:
    """Reject bad input before any rank starts: model, worker count, dataset, partition (stages the data)."""
    check_model(recipe)
    if options.workers < 1:
        raise LadleError(f"--workers must be >= 1, got {options.workers}")
    data = load_dataset(recipe.dataset, data_root, recipe.split, recipe.features)
    if options.workers > data.num_nodes:
        raise LadleError(f"cannot split {data.num_nodes} nodes into {options.workers} workers")


def run_local(recipe: Recipe, options: VarrateOptions, run_dir: Path | None = None,
              data_root: str | Path | None = None) -> dict[str, Any]:
    """Train with ``options.workers`` ranks spawned on this machine; return rank 0's metadata.

    This is the library call behind ``python -m ladle.varrate`` without torchrun. A rank that fails
    stops the others; the error names it.
    """
    data_root = None if data_root is None else str(data_root)
    options = _resolve(options, options.workers)
    check_inputs(recipe, options, data_root)
    run_path = Path(run_dir) if run_dir is not None else new_run_dir(options.schedule.kind)
    run_path.mkdir(parents=True, exist_ok=True)
    if not os.access(run_path, os.W_OK):
        raise LadleError(f"run directory {run_path} is not writable (choose another --run-dir)")
    args = (options.workers, free_port(), recipe.to_dict(), options, run_path, data_root)
    try:
        torch.multiprocessing.start_processes(_spawned_rank, args=args, nprocs=options.workers, start_method="spawn")
    except torch.multiprocessing.ProcessRaisedException as error:
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        log.debug("%s", error)
        raise RuntimeError(f"rank {error.error_index} failed: {lines[-1] if lines else error}") from None
    except torch.multiprocessing.ProcessExitedException as error:
        raise RuntimeError(f"rank {error.error_index} exited with code {error.exit_code}; the other ranks "
                           "were stopped") from None
    return read_json(run_path / "varrate.json")


def _resolve(options: VarrateOptions, world: int) -> VarrateOptions:
    """Options with the world size and the device resolved, and threads split between local ranks."""
    device = resolve_device(options.device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device == "cuda" and local_world > torch.cuda.device_count():
        raise LadleError(f"--device cuda needs one GPU per rank (NCCL cannot share one): {local_world} ranks on "
                         f"this machine, {torch.cuda.device_count()} GPUs visible; use fewer --workers or --device cpu")
    threads = options.threads or max(1, available_cores() // max(1, local_world))
    return VarrateOptions(world, options.partition, options.schedule, options.compressor, device, options.timeout,
                          threads)


def run_torchrun(recipe: Recipe, options: VarrateOptions, run_dir: Path | None,
                 data_root: str | None) -> dict[str, Any] | None:
    """Train as one rank of a group launched by torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set)."""
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise LadleError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not: launch with torchrun")
    world = int(os.environ["WORLD_SIZE"])
    if options.workers not in (0, world):
        raise LadleError(f"--workers {options.workers} but torchrun started {world} ranks (drop --workers)")
    options = _resolve(options, world)
    check_model(recipe)
    rank = int(os.environ["RANK"])
    run_path = (Path(run_dir) if run_dir is not None else new_run_dir(options.schedule.kind)) if rank == 0 else None
    if run_path is not None:
        run_path.mkdir(parents=True, exist_ok=True)
    return run_rank(recipe, options, run_path, data_root, int(os.environ.get("LOCAL_RANK", rank)))


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ladle.varrate`` command line."""
    parser = argparse.ArgumentParser(
        prog="python -m ladle.varrate",
        description="Partition-parallel GNN training with compressed, variable-rate halo exchange (VARCO).",
        epilog="Recipe keys can be overridden as key=value (e.g. dataset=physics epochs=100). Under torchrun "
               "(RANK/WORLD_SIZE set) the ranks come from torchrun and --workers is not needed.",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    parser.add_argument("--recipe", help="recipe name in recipes/ or a .yaml path (default: the embedded default)")
    parser.add_argument("--workers", "-w", type=int, default=None, help="ranks K on this machine (default 4)")
    parser.add_argument("--partition", default="metis", choices=PARTITION_KINDS, help="node partition (default metis)")
    parser.add_argument("--schedule", default="linear", choices=SCHEDULES,
                        help="compression ratio over training (default linear)")
    parser.add_argument("--compress", default="truncate", choices=tuple(COMPRESSORS),
                        help="compression operator (default truncate: the first d/r columns)")
    parser.add_argument("--rate-max", type=float, default=64.0,
                        help="ratio at the start (linear, step) or throughout (fixed); default 64")
    parser.add_argument("--rate-min", type=float, default=1.0, help="ratio at the end (linear, step); default 1")
    parser.add_argument("--rate-fraction", type=float, default=1.0,
                        help="fraction of the epochs over which linear/step reach --rate-min (default 1)")
    parser.add_argument("--rate-steps", help="step schedule ratios, comma-separated (default: 4 geometric steps "
                        "from --rate-max to --rate-min, e.g. 64,16,4,1)")
    parser.add_argument("--run-dir", type=Path, help="output folder (default checkpoints/varrate-<schedule>-<time>)")
    parser.add_argument("--data-root", help="dataset root folder (default $LADLE_DATA, ../shared/datasets, ./data)")
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"),
                        help="cpu (gloo) or cuda (NCCL, one GPU per rank); default cpu")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective may wait before the run fails (default 300)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (default cores / local ranks)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _parse_steps(text: str | None) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        return tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise LadleError(f"--rate-steps must be comma-separated numbers, e.g. 64,16,4,1; got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ladle.varrate``."""
    args = build_parser().parse_intermixed_args(argv)  # key=value may come before or after flags
    recipe = load_recipe(args.recipe, list(args.overrides))
    if args.timeout <= 0 or args.threads < 0:
        raise LadleError("--timeout must be > 0 and --threads >= 0")
    schedule = RateSchedule(args.schedule, args.rate_max, args.rate_min, args.rate_fraction,
                            _parse_steps(args.rate_steps))
    build_compressor(args.compress)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    workers = args.workers if args.workers is not None else (0 if under_torchrun else 4)
    options = VarrateOptions(workers, args.partition, schedule, args.compress, args.device, args.timeout,
                             args.threads)
    if under_torchrun:
        meta = run_torchrun(recipe, options, args.run_dir, args.data_root)
    else:
        meta = run_local(recipe, options, args.run_dir, args.data_root)
    if meta is not None:
        sent = meta["bytes"]
        print(f"test acc {meta['test_acc']:.4f} (best epoch {meta['best_epoch']}, val {meta['val_acc']:.4f}); "
              f"sent {sent['forward_halo'] / 1e6:.2f} MB forward halo, {sent['backward_halo'] / 1e6:.2f} MB backward "
              f"halo, {sent['allreduce'] / 1e6:.2f} MB all-reduce")
        print(f"run directory: {meta['run_dir']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
