"""Varrate's halo exchange: which rows each rank owns, sends and receives (:class:`HaloPlan`), the
partition it comes from, and the differentiable, compressed, byte-counted exchange itself."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch_geometric.data import Data

from ladle.core.errors import LadleError
from ladle.core.recipe import PARTITION_KINDS, ViewConfig
from ladle.graph.inputs import Features, adjacency
from ladle.graph.partition import stream_seed
from ladle.graph.sparse import SparseMatrix
from ladle.graph.views import build_view
from ladle.varrate.compression import Compressor
from ladle.varrate.memory import ErrorFeedback, Route, SelectiveExchange


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
        raise LadleError(f"--partition {kind} with {parts} ranks: {error}") from None
    empty = (torch.bincount(view.parts, minlength=parts) == 0).nonzero().view(-1).tolist()  # type: ignore[attr-defined]
    if empty:
        raise LadleError(f"--partition {kind} left rank{'s' * (len(empty) > 1)} {', '.join(map(str, empty))} of "
                         f"{parts} with no nodes; use fewer --ranks or --partition random")
    return view.parts  # type: ignore[attr-defined]


def fetch_input_halo(x: Tensor, plan: HaloPlan, sparse: bool) -> tuple[Features, int]:
    """This rank's input rows followed by its halo's, fetched from their owners once; return them and the bytes
    this rank sent.

    The first layer aggregates ``X W`` over the halo; ``X`` never changes, so once a rank holds its halo's rows of
    ``X`` it projects them itself and that layer exchanges nothing, forward or backward (its weight gradient,
    summed over ranks, is the same). ``x``: the owned rows, dense. ``sparse``: send each row's non-zeros (an int32
    count a row, then an int32 column and a float32 value each) and return a :class:`SparseMatrix`; else dense rows.
    """
    outgoing = x[plan.send_index]
    if not sparse:
        halo = outgoing.new_empty(sum(plan.recv_counts), x.size(1))
        with collective("input halo exchange"):
            dist.all_to_all_single(halo, outgoing.contiguous(), plan.recv_counts, plan.send_counts)
        return torch.cat([x, halo]), outgoing.numel() * outgoing.element_size()
    row, col = outgoing.nonzero(as_tuple=True)
    per_row = torch.bincount(row, minlength=outgoing.size(0)).int()
    got_per_row = per_row.new_empty(sum(plan.recv_counts))
    with collective("input halo exchange"):
        dist.all_to_all_single(got_per_row, per_row, plan.recv_counts, plan.send_counts)
    send_nonzeros = [int(part.sum()) for part in per_row.split(plan.send_counts)]
    recv_nonzeros = [int(part.sum()) for part in got_per_row.split(plan.recv_counts)]
    got_col = col.new_empty(sum(recv_nonzeros), dtype=torch.int32)
    got_value = outgoing.new_empty(sum(recv_nonzeros))
    with collective("input halo exchange"):
        dist.all_to_all_single(got_col, col.int(), recv_nonzeros, send_nonzeros)
        dist.all_to_all_single(got_value, outgoing[row, col].contiguous(), recv_nonzeros, send_nonzeros)
    x, got_per_row, got_col, got_value = x.cpu(), got_per_row.cpu(), got_col.cpu(), got_value.cpu()  # built on CPU
    own_row, own_col = x.nonzero(as_tuple=True)
    halo_row = x.size(0) + torch.repeat_interleave(torch.arange(got_per_row.numel()), got_per_row.long())
    inputs = SparseMatrix(torch.cat([own_row, halo_row]), torch.cat([own_col, got_col.long()]),
                          torch.cat([x[own_row, own_col], got_value]), (x.size(0) + got_per_row.numel(), x.size(1)))
    return inputs.to(outgoing.device), 4 * per_row.numel() + 8 * row.numel()


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
    """Bytes this rank sent, by purpose (payload bytes; a peer's own rows are never sent; collectives
    counted as :mod:`ladle.core.collectives`'s ring algorithms send them)."""

    forward_halo: int = 0
    backward_halo: int = 0
    allreduce: int = 0
    eval_halo: int = 0
    metrics: int = 0

    FIELDS: ClassVar[tuple[str, ...]] = ("forward_halo", "backward_halo", "allreduce", "eval_halo", "metrics")

    def values(self) -> list[int]:
        """The counters in :attr:`FIELDS` order."""
        return [getattr(self, name) for name in self.FIELDS]


def exchange_key(seed: int, step: int, layer: int) -> int:
    """The shared random key of one layer's exchange in one step (the same on every rank)."""
    return stream_seed(seed, step, layer) >> 1


@dataclass(eq=False)
class HaloExchange:
    """One step's halo exchanges: which plan, compressor and ratio, and where to count the bytes.

    ``evaluating`` exchanges count as ``eval_halo`` (they have no backward). A training exchange may carry
    state across steps (:mod:`ladle.varrate.memory`): ``feedback`` (the sender's error-feedback residuals) and
    ``selection`` (send a fraction of the rows, the receiver keeps the rest from before).
    """

    plan: HaloPlan
    compressor: Compressor
    rate: float
    seed: int
    step: int
    traffic: Traffic
    evaluating: bool = False
    feedback: ErrorFeedback | None = None
    selection: SelectiveExchange | None = None

    def __post_init__(self) -> None:
        if self.evaluating and (self.feedback is not None or self.selection is not None):
            raise ValueError("an evaluation exchange is exact: it takes no error feedback and no selection")

    def __call__(self, rows: Tensor, layer: int) -> Tensor:
        """The halo rows of layer ``layer`` given this rank's rows (differentiable)."""
        return _HaloFunction.apply(rows, self, layer)

    def key(self, layer: int) -> int:
        """The compressor's shared key at ``layer``."""
        return exchange_key(self.seed, self.step, layer)

    def route(self, layer: int, device: torch.device) -> Route:
        """The rows that travel at ``layer``: all of them, or a selection."""
        plan = self.plan
        if self.selection is None:
            return Route(None, None, plan.send_counts, plan.recv_counts)
        return self.selection.route(plan.rank, plan.send_counts, plan.recv_counts, self.seed, self.step, layer, device)

    def swap(self, payload: Tensor, width: int, layer: int, send_counts: list[int],
             recv_counts: list[int]) -> tuple[Tensor, int]:
        """Swap payloads (grouped by peer, ``send_counts`` each) and decompress; return (rows received, bytes sent)."""
        payload = payload.contiguous()
        received = payload.new_empty((sum(recv_counts), self.compressor.payload_columns(width, self.rate)))
        with collective(f"halo exchange of layer {layer}"):
            dist.all_to_all_single(received, payload, recv_counts, send_counts)
        decoded = self.compressor.decode(received, width, self.rate, self.key(layer))
        return decoded, payload.numel() * payload.element_size()

    def transfer(self, rows: Tensor, layer: int, send_counts: list[int], recv_counts: list[int]) -> tuple[Tensor, int]:
        """Compress ``rows`` (grouped by peer, ``send_counts`` each), swap, decompress; return (rows, bytes sent)."""
        payload = self.compressor.encode(rows, self.rate, self.key(layer))
        return self.swap(payload, rows.size(1), layer, send_counts, recv_counts)


class _HaloFunction(torch.autograd.Function):
    """Forward: send the boundary rows, receive the halo. Backward: send the halo's gradients back to
    their owners, who add them to the rows they sent (same compressor, same key).

    Only the rows that travel this step carry gradients back (a selective exchange returns those alone): the
    error-feedback residual and a selective exchange's stale rows are constants.
    """

    @staticmethod
    def forward(ctx, rows: Tensor, exchange: HaloExchange, layer: int) -> Tensor:  # type: ignore[override]
        plan = exchange.plan
        route = exchange.route(layer, rows.device)
        sources = plan.send_index if route.sent is None else plan.send_index[route.sent]
        ctx.exchange, ctx.layer, ctx.num_rows, ctx.route, ctx.sources = exchange, layer, rows.size(0), route, sources
        outgoing = rows[sources]
        if exchange.feedback is None:
            payload = exchange.compressor.encode(outgoing, exchange.rate, exchange.key(layer))
        else:
            payload = exchange.feedback.encode(exchange.compressor, outgoing, exchange.rate, exchange.key(layer),
                                               layer, route.sent, plan.send_index.numel())
        halo, sent = exchange.swap(payload, rows.size(1), layer, route.send_counts, route.recv_counts)
        if exchange.evaluating:
            exchange.traffic.eval_halo += sent
        else:
            exchange.traffic.forward_halo += sent
        return halo if exchange.selection is None else exchange.selection.merge(layer, halo, route)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        exchange: HaloExchange = ctx.exchange
        route: Route = ctx.route
        grad = grad if route.received is None else grad[route.received]
        back, sent = exchange.transfer(grad.contiguous(), ctx.layer, route.recv_counts, route.send_counts)
        exchange.traffic.backward_halo += sent
        rows = grad.new_zeros(ctx.num_rows, grad.size(1)).index_add_(0, ctx.sources, back)
        return rows, None, None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
