"""Node partitions of a graph and the in-edge CSR they are computed on.

Kinds: METIS k-way (pymetis), label-balanced METIS (small METIS clusters grouped into parts that
balance node counts and every class's training labels) and uniformly random. A part can carry a
read-only L-hop halo: the nodes whose features its owned nodes' L-layer receptive field reads.
Everything is deterministic given the seed; no global RNG is touched.
"""
from __future__ import annotations

import contextlib
import ctypes
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pymetis
import torch
from torch import Tensor

# Label-balanced METIS: clusters per part; enough for a part to draw labels of every class from
# several clusters, few enough that each cluster keeps METIS's locality.
CLUSTERS_PER_PART = 16


def stream_seed(seed: int, *stream: int) -> int:
    """A 64-bit seed for the random stream ``(seed, *stream)``; distinct streams are independent."""
    return int(np.random.SeedSequence([seed, *stream]).generate_state(1, dtype=np.uint64)[0])


def stream_generator(seed: int, *stream: int) -> torch.Generator:
    """A torch generator for the random stream ``(seed, *stream)``."""
    return torch.Generator().manual_seed(stream_seed(seed, *stream))


class InEdges:
    """In-edge CSR of a graph: row ``v`` lists the sources of the edges ``u -> v``, sorted by ``u``.

    Edge positions in this CSR are the edge ids the samplers count and index. Only the sources are held
    per edge; the targets (``dst``, the rows) are built on first use, or a range at a time (:meth:`targets`).
    """

    def __init__(self, edge_index: Tensor, num_nodes: int) -> None:
        # one int64 key per edge, sorted in place, then turned into the sources in place: no argsort index and no
        # gathered copies (beside the input, the peak is the keys alone)
        keys = edge_index[1].long() * num_nodes
        keys += edge_index[0]
        keys.numpy().sort()  # in place (equal keys are the same edge, so any order of them will do)
        self.num_nodes = num_nodes
        self.deg = torch.zeros(num_nodes, dtype=torch.long)
        for start in range(0, keys.numel(), _CHUNK):
            self.deg += torch.bincount(keys[start:start + _CHUNK] // num_nodes, minlength=num_nodes)
        keys %= num_nodes
        self.src = keys
        self.rowptr = torch.zeros(num_nodes + 1, dtype=torch.long)
        self.rowptr[1:] = torch.cumsum(self.deg, 0)
        self.local = torch.full((num_nodes,), -1, dtype=torch.long)  # scratch global -> local map, kept all -1

    @cached_property
    def dst(self) -> Tensor:
        """The target of every edge, held once built (8 bytes an edge: ``targets`` reads a range without it)."""
        return torch.repeat_interleave(torch.arange(self.num_nodes), self.deg)

    def targets(self, start: int, end: int) -> Tensor:
        """The target (row) of each CSR position in ``start:end``, built from the row pointers alone."""
        if end <= start:
            return torch.empty(0, dtype=torch.long)
        first = int(torch.searchsorted(self.rowptr, torch.tensor(start), right=True)) - 1
        last = int(torch.searchsorted(self.rowptr, torch.tensor(end - 1), right=True)) - 1
        counts = self.rowptr[first + 1:last + 2].clamp(max=end) - self.rowptr[first:last + 1].clamp(min=start)
        return torch.repeat_interleave(torch.arange(first, last + 1), counts)

    @contextlib.contextmanager
    def sources_on_disk(self) -> Iterator[None]:
        """Within the block ``src`` waits in a temporary file, not in memory (8 bytes an edge), then is read back."""
        with tempfile.TemporaryFile() as file:
            np.save(file, self.src.numpy(), allow_pickle=False)
            del self.src
            try:
                yield
            finally:
                file.seek(0)
                self.src = torch.from_numpy(np.load(file, allow_pickle=False))

    def rows(self, nodes: Tensor) -> tuple[Tensor, Tensor]:
        """CSR positions of all in-edges of ``nodes`` (row by row) and, for each, its row's index in ``nodes``."""
        counts = self.deg[nodes]
        owner = torch.repeat_interleave(torch.arange(nodes.numel()), counts)
        row_start = torch.cumsum(counts, 0) - counts
        positions = self.rowptr[nodes][owner] + torch.arange(owner.numel()) - row_start[owner]
        return positions, owner

    def induced(self, nodes: Tensor) -> tuple[Tensor, Tensor]:
        """The edges among ``nodes``: ``edge_index`` in local ids (positions in ``nodes``) and CSR positions."""
        self.local[nodes] = torch.arange(nodes.numel())
        positions, owner = self.rows(nodes)
        src = self.local[self.src[positions]]
        self.local[nodes] = -1
        keep = src >= 0
        return torch.stack([src[keep], owner[keep]]), positions[keep]

    def receptive_field(self, nodes: Tensor, hops: int) -> Tensor:
        """``nodes`` and every node with a path of at most ``hops`` edges into one of them, sorted."""
        inside = torch.zeros(self.num_nodes, dtype=torch.bool)
        inside[nodes] = True
        frontier = nodes
        for _ in range(hops):
            positions, _ = self.rows(frontier)
            sources = self.src[positions]
            frontier = sources[~inside[sources]].unique()
            if frontier.numel() == 0:
                break
            inside[frontier] = True
        return inside.nonzero().view(-1)


@dataclass(frozen=True)
class Part:
    """Part ``k`` as one ingredient sees it: its owned nodes plus an optional read-only halo.

    ``nodes`` are global ids, sorted; ``edge_index`` holds the edges among them in local ids, in
    in-edge CSR order; ``owned`` marks the nodes of the part itself (the others are the halo);
    ``degree`` (with a halo only) is each node's in-degree in the whole graph, for normalisation.
    """

    nodes: Tensor
    owned: Tensor
    edge_index: Tensor
    degree: Tensor | None = None

    @property
    def halo_nodes(self) -> int:
        """Nodes read from other parts."""
        return int((~self.owned).sum())

    @property
    def halo_edges(self) -> int:
        """Edges with a halo endpoint: kept only because of the halo."""
        return int((~self.owned[self.edge_index]).any(0).sum())


def part_subgraph(adj: InEdges, parts: Tensor, k: int, halo: int = 0) -> Part:
    """The induced subgraph of part ``k`` and, for ``halo = L > 0``, of its L-hop in-neighbourhood.

    With ``L`` at least a model's number of layers, the part's owned nodes get exactly their
    full-graph outputs (given the whole-graph degrees for normalisation); cut edges beyond the halo
    are dropped.
    """
    owned_nodes = (parts == k).nonzero().view(-1)
    nodes = adj.receptive_field(owned_nodes, halo) if halo else owned_nodes
    edge_index, _ = adj.induced(nodes)
    return Part(nodes, parts[nodes] == k, edge_index, adj.deg[nodes] if halo else None)


METIS_MAX_EDGES = 1 << 24  # adjacency entries METIS sees at most (about 2 GB of METIS's memory)
METIS_IMBALANCE = 1.03  # the largest part a refinement may grow to, over an equal share (METIS's own default)
_CHUNK = 1 << 24  # entries handled at once while sampling them
_REFINE_COUNTS = 1 << 22  # (row, part) counters and edges a refinement pass holds at once
_REFINE_ROUNDS = 32  # at most; it stops once two rounds in a row cut fewer than 1/1000 of the edges it cuts
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: Fibonacci hashing's multiplier
_METIS_SAMPLE_STREAM = 7


def metis_partition(adj: InEdges, num_parts: int, seed: int) -> Tensor:
    """METIS k-way partition (pymetis) of an undirected graph: the part id of every node, seeded.

    METIS holds ~120 bytes per adjacency entry while it coarsens (measured: 7.8 GB for 64M entries), so
    above :data:`METIS_MAX_EDGES` it partitions a fixed, seeded sample of the undirected edges instead
    (both directions of an edge kept or dropped together): every node is still partitioned, with its
    degree roughly thinned to fit, and the sample's parts are then refined on the whole graph
    (:func:`refine_partition`). While METIS runs on a sample, ``adj``'s sources wait on disk.
    """
    if num_parts == 1:
        return torch.zeros(adj.num_nodes, dtype=torch.long)
    starts, adjacency = _metis_input(adj, seed)
    sampled = adjacency is not adj.src
    starts, adjacency = _symmetric(starts, adjacency)
    graph = pymetis.CSRAdjacency(starts.numpy(), adjacency.numpy())
    del starts, adjacency
    with adj.sources_on_disk() if sampled else contextlib.nullcontext():
        _trim_heap()
        _, parts = pymetis.part_graph(num_parts, adjacency=graph, options=pymetis.Options(seed=seed % 2**31))
    parts = torch.from_numpy(np.asarray(parts, dtype=np.int64))
    return refine_partition(adj, parts, num_parts) if sampled else parts


def refine_partition(adj: InEdges, parts: Tensor, num_parts: int) -> Tensor:
    """``parts`` with fewer cut edges: size-constrained label propagation on the whole graph.

    Each round, every node of one parity (by id, alternating) whose in-neighbours lie mostly in another part
    moves there, the largest gains first, while that part stays within :data:`METIS_IMBALANCE` of an equal
    share (or the largest part given, if larger); a round is kept only if it cuts fewer edges, and refinement
    stops when two rounds in a row remove less than 1/1000 of the cut. Deterministic.
    """
    size = torch.bincount(parts, minlength=num_parts)
    limit = max(int(size.max()), int(METIS_IMBALANCE * adj.num_nodes / num_parts))
    best, (best_cut, gain, target) = parts, _moves(adj, parts, num_parts)
    stalled_rounds = 0
    for round_ in range(_REFINE_ROUNDS):
        movers = ((gain > 0) & (torch.arange(adj.num_nodes) % 2 == round_ % 2)).nonzero().view(-1)
        movers = movers[torch.argsort(gain[movers], descending=True, stable=True)]
        by_part = torch.argsort(target[movers], stable=True)  # within a part, still the largest gains first
        movers, into = movers[by_part], target[movers][by_part]
        rank = torch.arange(into.numel()) - torch.searchsorted(into, into)  # place in its part's queue
        moved = movers[rank < (limit - size)[into]]
        removed = 0
        if moved.numel():
            candidate = best.clone()
            candidate[moved] = target[moved]
            cut, candidate_gain, candidate_target = _moves(adj, candidate, num_parts)
            if cut < best_cut:  # else the other parity's turn, from the best parts
                removed = best_cut - cut
                best, best_cut, gain, target = candidate, cut, candidate_gain, candidate_target
                size = torch.bincount(best, minlength=num_parts)
        stalled_rounds = stalled_rounds + 1 if removed * 1000 < best_cut + removed else 0
        if stalled_rounds == 2:
            break
    return best


def _moves(adj: InEdges, parts: Tensor, num_parts: int) -> tuple[int, Tensor, Tensor]:
    """The cut (in-edge entries whose source lies in another part) and, per node, the part most of its
    in-neighbours lie in and how many more lie there than in its own; a block of rows at a time."""
    gain = torch.empty(adj.num_nodes, dtype=torch.long)
    target = torch.empty(adj.num_nodes, dtype=torch.long)
    cut = 0
    rows = max(1, _REFINE_COUNTS // num_parts)
    first = 0
    while first < adj.num_nodes:
        last = min(first + rows, int(torch.searchsorted(adj.rowptr, adj.rowptr[first] + _REFINE_COUNTS,
                                                         right=True)) - 1, adj.num_nodes)
        last = max(last, first + 1)
        start, end = int(adj.rowptr[first]), int(adj.rowptr[last])
        slots = (adj.targets(start, end) - first) * num_parts + parts[adj.src[start:end]]
        counts = torch.bincount(slots, minlength=(last - first) * num_parts).view(last - first, num_parts)
        own = counts.gather(1, parts[first:last, None]).squeeze(1)
        most, part = counts.max(1)  # ties: the lowest part id
        target[first:last] = part
        gain[first:last] = most - own
        cut += end - start - int(own.sum())
        first = last
    return cut, gain, target


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc keeps those of arrays freed below a live one), so that
    METIS's peak does not stack on them; nothing where the C library has no ``malloc_trim``."""
    with contextlib.suppress(OSError, AttributeError, TypeError):  # TypeError: no CDLL(None) on Windows
        ctypes.CDLL(None).malloc_trim(0)


def _metis_input(adj: InEdges, seed: int) -> tuple[Tensor, Tensor]:
    """The CSR METIS partitions: ``adj`` without self-loops (METIS rejects them) and, above
    :data:`METIS_MAX_EDGES` entries, a symmetric seeded sample of its edges; ``adj``'s arrays when
    nothing is dropped. Built a chunk of entries at a time."""
    entries = adj.src.numel()
    keep_fraction = min(1.0, METIS_MAX_EDGES / max(entries, 1))
    threshold = int(keep_fraction * (1 << 30))
    salt = stream_seed(seed, _METIS_SAMPLE_STREAM) >> 2  # fits an int64 sum
    keep = torch.empty(entries, dtype=torch.bool)
    kept_per_row = torch.zeros(adj.num_nodes, dtype=torch.long)
    for start in range(0, entries, _CHUNK):
        end = min(start + _CHUNK, entries)
        src, dst = adj.src[start:end], adj.targets(start, end)
        chunk = src != dst
        if keep_fraction < 1.0:  # one hash per undirected pair: (u, v) and (v, u) agree
            pair = torch.minimum(src, dst) * adj.num_nodes + torch.maximum(src, dst)
            mixed = (pair + salt) * _GOLDEN  # wraps mod 2^64; its high bits are well mixed
            chunk &= ((mixed >> 33) & ((1 << 30) - 1)) < threshold
            del pair, mixed
        keep[start:end] = chunk
        kept_per_row += torch.bincount(dst[chunk], minlength=adj.num_nodes)
    if bool(keep.all()):
        return adj.rowptr, adj.src
    starts = torch.zeros(adj.num_nodes + 1, dtype=torch.long)
    starts[1:] = torch.cumsum(kept_per_row, 0)
    return starts, adj.src[keep]


def _symmetric(starts: Tensor, adjacency: Tensor) -> tuple[Tensor, Tensor]:
    """The CSR ``(starts, adjacency)`` with each edge in both directions, once: the union of a directed graph and its
    reverse (METIS assumes a symmetric adjacency and corrupts its heap on another), or the arrays as they are when they
    already are symmetric and free of repeated edges."""
    num_nodes = starts.numel() - 1
    rows = torch.repeat_interleave(torch.arange(num_nodes), starts.diff())
    forward = rows * num_nodes + adjacency
    increasing = bool((forward[1:] > forward[:-1]).all())  # sorted rows without a repeated entry (a CSR of InEdges')
    union = torch.unique(torch.cat([forward, adjacency * num_nodes + rows]))
    del rows, forward
    if increasing and union.numel() == adjacency.numel():  # then every entry's reverse is one of them
        return starts, adjacency
    symmetric = torch.zeros(num_nodes + 1, dtype=torch.long)
    symmetric[1:] = torch.cumsum(torch.bincount(union // num_nodes, minlength=num_nodes), 0)
    return symmetric, union % num_nodes


def cut_edges(adj: InEdges, parts: Tensor, num_parts: int) -> Tensor:
    """Per part, the edges with exactly one endpoint in it (counted a chunk of edges at a time)."""
    cut = torch.zeros(num_parts, dtype=torch.long)
    for start in range(0, adj.src.numel(), _CHUNK):
        end = min(start + _CHUNK, adj.src.numel())
        src_part, dst_part = parts[adj.src[start:end]], parts[adj.targets(start, end)]
        cross = src_part != dst_part
        cut += torch.bincount(dst_part[cross], minlength=num_parts)
        cut += torch.bincount(src_part[cross], minlength=num_parts)
    return cut


def label_balanced_partition(adj: InEdges, num_parts: int, seed: int, labels: Tensor) -> Tensor:
    """METIS parts that balance node counts and each class's training labels (``labels``: class, or -1).

    METIS cuts the graph into ``CLUSTERS_PER_PART * num_parts`` clusters; clusters are then assigned
    greedily, those holding the most training labels first, each to the part where it adds least to
    :math:`\\sum_j (load_{p,j} / target_j)^2` over the constraints ``j`` (nodes, and the training
    labels of each class; ``target_j`` is an equal share). A class's labels thus go to parts that
    lack it, and label-free clusters even out node counts. (pymetis' multi-constraint vertex weights
    gave unreliable parts here.)
    """
    if num_parts == 1:
        return torch.zeros(adj.num_nodes, dtype=torch.long)
    num_clusters = min(CLUSTERS_PER_PART * num_parts, adj.num_nodes)
    clusters = metis_partition(adj, num_clusters, seed)
    train = labels >= 0
    num_classes = int(labels.max()) + 1 if bool(train.any()) else 0
    weight = torch.zeros(num_clusters, 1 + num_classes, dtype=torch.float64)
    weight[:, 0] = torch.bincount(clusters, minlength=num_clusters).double()
    if num_classes:
        flat = clusters[train] * num_classes + labels[train]
        weight[:, 1:] = torch.bincount(flat, minlength=num_clusters * num_classes).view(num_clusters, -1).double()
    total = weight.sum(0)
    scale = torch.where(total > 0, num_parts / total.clamp(min=1), torch.zeros_like(total))  # 1 / target
    scaled = weight * scale
    order = sorted(range(num_clusters), key=lambda c: (-float(weight[c, 1:].sum()), -float(weight[c, 0]), c))
    load = torch.zeros(num_parts, 1 + num_classes, dtype=torch.float64)
    group = torch.empty(num_clusters, dtype=torch.long)
    for c in order:
        added = (scaled[c] * (2 * load + scaled[c])).sum(1)  # growth of the sum of squared loads
        p = int(torch.argmin(added))  # ties: the lowest part id
        load[p] += scaled[c]
        group[c] = p
    return group[clusters]


def random_partition(num_nodes: int, num_parts: int, generator: torch.Generator) -> Tensor:
    """Uniformly random node partition into ``num_parts`` parts whose sizes differ by at most one."""
    parts = torch.empty(num_nodes, dtype=torch.long)
    parts[torch.randperm(num_nodes, generator=generator)] = torch.arange(num_nodes) * num_parts // num_nodes
    return parts
