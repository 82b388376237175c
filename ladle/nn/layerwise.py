"""Full-graph logits of a ladle :class:`~ladle.nn.models.GNN`, layer by layer over batches of nodes.

A plain forward builds the whole normalised adjacency ``Â`` (a CSR and its transpose) and every
layer's activations at once. Here layer ``l`` is finished for all nodes before layer ``l + 1``
starts (no node is recomputed, unlike sampled inference), and its aggregation reads the rows of
``Â`` of one batch of target nodes at a time from the graph's in-edge CSR (a shard's memory-mapped
``rowptr``/``col``, or one sort of ``edge_index``), with no transpose and no autograd buffers. A hidden
layer's output is finished (norm, ReLU, the next layer's projection) a batch of rows at a time, so peak
memory is the features (and their cached first aggregation), one layer's inputs and the next's (``N x``
their widths) and one batch's rows: never a whole hidden layer.

Batches are cut by entries of ``A + I`` (default ``2^24``), not by nodes: torch's CSR product costs
``O(N * width)`` a call whatever the batch (it copies the dense operand), so few large batches are
several times faster than many small ones; a 1M-node, 10M-edge graph is one batch.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.nn import GATConv
from tqdm import tqdm

from ladle.core.resources import release_mapped_pages
from ladle.graph.inputs import use_sparse_features
from ladle.graph.shards import Shard
from ladle.nn.models import GNN, GCNLayer, SAGELayer

LAYERWISE_MODELS = ("gcn", "sage", "gat")  # GIN, APPNP and custom models are scored by a whole-graph forward
DEFAULT_BATCH_ENTRIES = 1 << 24  # entries of A + I per batch of rows
FIRST_AGGREGATION_BYTES = 2 << 30  # dense features up to this size get their first aggregation cached
ROW_CHUNK = 1 << 16  # nodes per dense product where a layer's output is finished chunk by chunk

Rows = Iterator[tuple[int, int, Tensor]]  # a layer's output (or input), a range of rows at a time


class LayerwiseInference:
    """Computes ``model(graph)`` for every node of one graph, exactly up to float rounding, batch by batch.

    ``rowptr``/``col``: the in-edge CSR (row ``v`` lists the sources ``u`` of the edges ``u -> v``), as
    :mod:`ladle.graph.shards` stores it. Built once per graph; each :meth:`logits` call takes any weights.
    ``mapped``: ``x`` and ``col`` are a shard's read-only memory-mapped files; the pages of ``col`` a batch of rows
    read, and those of ``x`` once its first aggregation is cached, are then handed back
    (:func:`~ladle.core.resources.release_mapped_pages`), so the files are not held resident pass after pass.
    """

    def __init__(self, x: Tensor, rowptr: Tensor, col: Tensor, batch_entries: int = DEFAULT_BATCH_ENTRIES,
                 mapped: bool = False) -> None:
        if batch_entries < 1:
            raise ValueError(f"batch_entries must be >= 1, got {batch_entries}")
        self.x, self.rowptr, self.col, self.mapped = x, rowptr, col, mapped
        self.num_nodes = rowptr.numel() - 1
        in_degree = rowptr.diff().float().unsqueeze(1)
        self.gcn_scale = (in_degree + 1).pow(-0.5)  # D^-1/2, degrees counted in A + I
        self.mean_scale = 1.0 / in_degree.clamp(min=1)
        entries = rowptr + torch.arange(self.num_nodes + 1)  # entries of A + I before each row
        starts = torch.searchsorted(entries[:-1], torch.arange(0, int(entries[-1]), batch_entries)).unique()
        bounds = torch.cat([starts, torch.tensor([self.num_nodes])]).tolist()
        self.ranges = [(start, end) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
        self._ones = torch.ones(max((int(rowptr[e] - rowptr[s]) for s, e in self.ranges), default=0))
        self._first: dict[str, Tensor] = {}  # cached first aggregations (see aggregated)

    @classmethod
    def from_data(cls, data: Data, batch_entries: int = DEFAULT_BATCH_ENTRIES) -> LayerwiseInference:
        """From a PyG graph (messages flow ``edge_index[0] -> edge_index[1]``): one sort of its edges."""
        src, dst = data.edge_index
        order = torch.argsort(dst * data.num_nodes + src)
        rowptr = torch.zeros(data.num_nodes + 1, dtype=torch.long)
        rowptr[1:] = torch.bincount(dst, minlength=data.num_nodes).cumsum(0)
        return cls(data.x, rowptr, src[order], batch_entries)

    @classmethod
    def from_shard(cls, shard: Shard, batch_entries: int = DEFAULT_BATCH_ENTRIES) -> LayerwiseInference:
        """From a loaded shard (usually a run's ``shards/graph``): its CSR is used as it is, memory-mapped."""
        return cls(shard.data.x, shard.rowptr, shard.col, batch_entries, mapped=True)

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether :meth:`logits` can run ``model``: a built-in GCN, SAGE or GAT."""
        return isinstance(model, GNN) and model.model in LAYERWISE_MODELS

    @torch.no_grad()
    def logits(self, model: GNN, bn_nodes: Tensor | None = None) -> Tensor:
        """``model``'s eval-mode logits for all nodes, ``[num_nodes, classes]``.

        A hidden layer's output is never held for all nodes: each batch of its rows is normalised,
        activated and projected by the next layer's weights at once, so only the next layer's inputs
        (``N x`` its output width, for GCN and SAGE) are kept. ``bn_nodes``: first re-estimate each
        batch-norm layer's running statistics (in place) as the mean and unbiased variance of these
        nodes' activations, the layers below already in eval mode (that layer's output is then held
        whole once). :func:`ladle.nn.scoring.recompute_batch_norm` propagates train-mode activations
        through one forward of a sub-graph instead; on all of Cora's nodes the two differ by ~1e-3.
        """
        model.eval()
        bar = tqdm(total=len(model.convs), desc="layer-wise inference", unit="layer", leave=False,
                   dynamic_ncols=True, disable=None)
        first = model.convs[0]
        sparse = use_sparse_features(self.x, model.model)
        cached = not sparse and self.caches_aggregation and isinstance(first, (GCNLayer, SAGELayer))
        inputs: list[Tensor] = []  # what the first layer reads: nothing when it starts from the cached aggregation
        if not cached:
            inputs = [self.x] if isinstance(first, GATConv) else self._inputs(first, self._feature_rows(), sparse)
        for i, conv in enumerate(model.convs):
            last, from_cache = i == len(model.convs) - 1, i == 0 and cached
            into = _logits_buffer(conv, self.num_nodes) if last and not from_cache else None
            rows = self._first_rows(first) if from_cache else self._output_rows(conv, inputs, into)
            bar.update(1)
            if last:
                bar.close()
                if into is None:
                    return _gather(rows, self.num_nodes)
                for _ in rows:  # each batch is written into its rows of the logits
                    pass
                return into
            norm = model.norms[i]
            if bn_nodes is not None and isinstance(norm, nn.BatchNorm1d):
                whole = _gather(rows, self.num_nodes)
                chosen = whole[bn_nodes]
                norm.running_mean.copy_(chosen.mean(0))
                norm.running_var.copy_(chosen.var(0))
                norm.num_batches_tracked.fill_(1)
                rows = ((start, end, whole[start:end]) for start, end in self._row_chunks())
            inputs = self._inputs(model.convs[i + 1], ((s, e, F.relu(norm(h))) for s, e, h in rows), sparse=False)
        raise AssertionError("a model has at least one layer")

    @property
    def caches_aggregation(self) -> bool:
        """Whether a first GCN/SAGE layer on dense features reuses their cached aggregation (:meth:`aggregated`): when
        they are small enough (:data:`FIRST_AGGREGATION_BYTES`) to hold a second copy of."""
        return self.x.numel() * 4 <= FIRST_AGGREGATION_BYTES

    def aggregated(self, mean: bool) -> Tensor:
        """The weight-free first aggregation of the features for all nodes, computed on first use and kept:
        ``Â X`` (GCN, ``mean=False``) or the in-neighbour mean of ``X`` (SAGE). The first layer is linear
        in its weights (``Â X W = (Â X) W``), so every later model pays one dense product instead of a
        pass over the edges."""
        key = "mean" if mean else "gcn"
        if key not in self._first:
            x = self.x.float()
            out = torch.empty(self.num_nodes, x.size(1))
            for start, end in self.ranges:
                if mean:
                    torch.mm(self._rows(start, end), x, out=out[start:end])
                else:  # (A + I) D^-1/2 X: the neighbours, each scaled by its entry, plus the node itself
                    torch.mul(x[start:end], self.gcn_scale[start:end], out=out[start:end])
                    out[start:end].addmm_(self._rows(start, end, scaled=True), x)
                self._read(start, end)
            self._first[key] = out.mul_(self.mean_scale if mean else self.gcn_scale)
            self.release()  # a GCN pass does not read the features again
        return self._first[key]

    def release(self) -> None:
        """Hand back the resident pages of the memory-mapped features and CSR (``mapped``; else nothing)."""
        if self.mapped:
            release_mapped_pages(self.x)
            release_mapped_pages(self.col)

    def _read(self, start: int, end: int) -> None:
        """A batch of rows is done with the CSR: its pages of ``col`` go back (``mapped``)."""
        if self.mapped:
            release_mapped_pages(self.col[int(self.rowptr[start]):int(self.rowptr[end])])

    def _row_chunks(self) -> list[tuple[int, int]]:
        """Consecutive ranges of :data:`ROW_CHUNK` nodes, for work that is dense row by row."""
        return [(start, min(start + ROW_CHUNK, self.num_nodes)) for start in range(0, self.num_nodes, ROW_CHUNK)]

    def _feature_rows(self) -> Rows:
        """The features, :data:`ROW_CHUNK` rows at a time (the first layer's input when it has no cached aggregation)."""
        return ((start, end, self.x[start:end]) for start, end in self._row_chunks())

    def _first_rows(self, conv: nn.Module) -> Rows:
        """The first GCN/SAGE layer's output from the cached aggregation (:meth:`aggregated`), chunk by chunk."""
        if isinstance(conv, GCNLayer):
            aggregated = self.aggregated(mean=False)
            for start, end in self._row_chunks():
                out = aggregated[start:end] @ conv.lin.weight.t()
                yield start, end, out.add_(conv.bias) if conv.bias is not None else out
            return
        aggregated = self.aggregated(mean=True)
        for start, end in self._row_chunks():
            out = torch.addmm(conv.lin_l.bias, aggregated[start:end], conv.lin_l.weight.t())
            yield start, end, out.add_(self.x[start:end] @ conv.lin_r.weight.t())

    def _inputs(self, conv: nn.Module, rows: Rows, sparse: bool) -> list[Tensor]:
        """What layer ``conv`` reads of every node, filled from ``rows`` (its input, a chunk at a time): GCN its
        projection scaled by ``D^-1/2``, SAGE its two projections (neighbours', root's), GAT the input itself."""
        if isinstance(conv, GATConv):
            return [_gather(rows, self.num_nodes)]
        if isinstance(conv, GCNLayer):
            weights, scale = [conv.lin.weight], self.gcn_scale
        else:
            assert isinstance(conv, SAGELayer)
            weights, scale = [conv.lin_l.weight, conv.lin_r.weight], None
        buffers = [torch.empty(self.num_nodes, weight.size(0)) for weight in weights]
        for start, end, h in rows:  # each product written in place: no block allocated (and zeroed) a chunk
            for buffer, weight in zip(buffers, weights):
                _matmul_rows(h, weight.t(), sparse, out=buffer[start:end])
            if scale is not None:
                buffers[0][start:end].mul_(scale[start:end])
        return buffers

    def _rows(self, start: int, end: int, scaled: bool = False) -> Tensor:
        """Rows ``start:end`` of the adjacency, a ``[end - start, N]`` CSR over the stored columns; its entries 1, or
        ``scaled``: each the ``D^-1/2`` of its source (GCN's normalisation of the features, with no scaled copy)."""
        first, last = int(self.rowptr[start]), int(self.rowptr[end])
        columns = self.col[first:last]
        values = self.gcn_scale.view(-1)[columns] if scaled else self._ones[:last - first]
        return csr(self.rowptr[start:end + 1] - first, columns, values, (end - start, self.num_nodes))

    def node_rows(self, nodes: Tensor, scaled: bool = False) -> Tensor:
        """The rows of ``nodes`` (sorted ids), a ``[len(nodes), N]`` CSR of their in-edges (entries as :meth:`_rows`)."""
        columns = self.col[row_entries(self.rowptr, nodes)]
        values = self.gcn_scale.view(-1)[columns] if scaled else torch.ones(columns.numel())
        return csr(row_pointers(self.rowptr, nodes), columns, values, (nodes.numel(), self.num_nodes))

    def _output_rows(self, conv: nn.Module, inputs: list[Tensor], into: Tensor | None = None) -> Rows:
        """Layer ``conv``'s output, a batch of rows (:attr:`ranges`) at a time, from its :meth:`_inputs`; GCN and SAGE
        write each batch into its rows of ``into`` when given."""
        if isinstance(conv, GCNLayer):  # Â = D^-1/2 (A + I) D^-1/2, degrees counted in A + I
            (projected,) = inputs
            for start, end in self.ranges:  # (A + I) rows of the batch, then the target's own scale
                out = torch.addmm(projected[start:end], self._rows(start, end), projected,
                                  out=None if into is None else into[start:end])
                self._read(start, end)
                out.mul_(self.gcn_scale[start:end])
                yield start, end, out.add_(conv.bias) if conv.bias is not None else out
        elif isinstance(conv, SAGELayer):  # mean over in-neighbours, plus the root's own projection
            neighbours, roots = inputs
            for start, end in self.ranges:
                out = torch.mm(self._rows(start, end), neighbours, out=None if into is None else into[start:end])
                out.mul_(self.mean_scale[start:end])
                self._read(start, end)
                yield start, end, out.add_(conv.lin_l.bias).add_(roots[start:end])
        else:
            assert isinstance(conv, GATConv)
            yield from self._gat(conv, inputs[0])

    def _gat(self, conv: GATConv, h: Tensor) -> Rows:
        """Attention needs each edge's endpoints: per batch, its targets first, then their other sources,
        so GATConv's own self-loops ``(i, i)`` for the first ``batch`` sources land on the targets."""
        local = torch.full((self.num_nodes,), -1, dtype=torch.long)
        for start, end in self.ranges:
            first, last = int(self.rowptr[start]), int(self.rowptr[end])
            sources = self.col[first:last]
            targets = torch.repeat_interleave(torch.arange(end - start), self.rowptr[start:end + 1].diff())
            local[start:end] = torch.arange(end - start)
            others = sources[local[sources] < 0].unique()
            local[others] = torch.arange(others.numel()) + (end - start)
            needed = torch.cat([torch.arange(start, end), others])
            batch = conv((h[needed], h[start:end]), torch.stack([local[sources], targets]))
            self._read(start, end)
            local[needed] = -1
            yield start, end, batch


def _logits_buffer(conv: nn.Module, num_nodes: int) -> Tensor | None:
    """The ``[num_nodes, width]`` tensor a last GCN or SAGE layer writes its batches into (GAT: none)."""
    if isinstance(conv, GCNLayer):
        return torch.empty(num_nodes, conv.lin.weight.size(0))
    return torch.empty(num_nodes, conv.lin_l.weight.size(0)) if isinstance(conv, SAGELayer) else None


def _gather(rows: Rows, num_nodes: int) -> Tensor:
    """The chunks of ``rows`` in one ``[num_nodes, width]`` tensor."""
    out: Tensor | None = None
    for start, end, h in rows:
        if out is None:
            out = torch.empty(num_nodes, h.size(1))
        out[start:end] = h
    assert out is not None, "a graph has at least one node"
    return out


def row_entries(rowptr: Tensor, rows: Tensor) -> Tensor:
    """Positions in ``col`` of the entries of ``rows``, row after row."""
    starts, counts = rowptr[rows], rowptr[rows + 1] - rowptr[rows]
    offsets = torch.repeat_interleave(starts - (counts.cumsum(0) - counts), counts)
    return offsets + torch.arange(int(counts.sum()))


def row_pointers(rowptr: Tensor, rows: Tensor) -> Tensor:
    """The row pointers of ``rows``' entries taken alone, row after row (as :func:`row_entries` lists them)."""
    crow = torch.zeros(rows.numel() + 1, dtype=torch.long)
    crow[1:] = (rowptr[rows + 1] - rowptr[rows]).cumsum(0)
    return crow


def csr(crow: Tensor, columns: Tensor, values: Tensor, size: tuple[int, int]) -> Tensor:
    """A float CSR matrix (beta-API warning silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        return torch.sparse_csr_tensor(crow, columns, values, size, check_invariants=False)


def _matmul_rows(rows: Tensor, matrix: Tensor, sparse: bool, out: Tensor) -> Tensor:
    """``rows @ matrix`` into ``out``, through a CSR copy of ``rows`` when they are mostly zeros."""
    if not sparse:
        return torch.mm(rows, matrix, out=out)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        return torch.mm(rows.to_sparse_csr(), matrix, out=out)
