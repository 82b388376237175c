"""Ingredient views: how ingredient ``k`` of ``K`` sees the graph it trains and validates on.

Kinds: ``full`` (the whole graph; ingredients differ only by seed), ``metis`` / ``random`` (ingredient
``k`` owns part ``k`` of a K-way partition, :mod:`ladle.graph.partition`, plus an optional read-only halo),
``cluster`` (ClusterGCN batches), ``saint-node`` / ``saint-edge`` / ``saint-rw`` (GraphSAINT subgraphs
with its normalisation) and ``neighbor`` (GraphSAGE fan-out sampling). Everything is vectorised torch
over an in-edge CSR plus pymetis, and deterministic given ``(seed, k, epoch)``: no global RNG is touched.

Every batch and eval graph is a :class:`~torch_geometric.data.Data` with ``x``, ``y`` (rows of the
local nodes), ``edge_index`` (local ids, int64, messages flow ``edge_index[0] -> edge_index[1]``),
``num_nodes``, ``n_id`` (global ids of the local nodes) and ``loss_mask`` (nodes whose loss counts).
Optional attributes are absent unless the view needs them (read them with ``batch.get(key)``):

* ``loss_weight`` (float per node, GraphSAINT's :math:`\\lambda_v = 1 / (p_v \\cdot |V_{train}|)`):
  the training loss is ``(ce * loss_weight)[loss_mask].sum()``, an unbiased estimate of the
  full-graph mean training loss; without it the loss is ``ce[loss_mask].mean()``.
* ``edge_weight`` (float per edge, GraphSAINT's :math:`1 / \\alpha_{u,v} = p_v / p_{u,v}` for an edge
  ``u -> v``): the model multiplies the batch's normalised adjacency entry of that edge by it.
* ``degree`` (int per node, partition views with a halo): in-degree in the whole graph, which the
  model normalises with, so owned nodes aggregate exactly as on the whole graph.

Eval graphs also carry ``train_mask``, ``val_mask`` and ``test_mask`` restricted to their (owned) nodes.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from functools import cached_property

import torch
from torch import Tensor
from torch_geometric.data import Data

from ladle.core.recipe import ViewConfig
from ladle.graph.partition import (
    InEdges,
    Part,
    label_balanced_partition,
    metis_partition,
    part_subgraph,
    random_partition,
    stream_generator,
)

log = logging.getLogger(__name__)


# Independent random streams derived from the run seed (values are part of the determinism contract).
_PARTITION_STREAM, _NORM_STREAM, _EPOCH_STREAM = 0, 1, 2
# The stream index of the trunk's view (and its continuation's): above any ingredient's k, so no ingredient
# replays the trunk's batches.
TRUNK_STREAM = 1 << 32
_NEIGHBOR_BATCH = 512


def _chunks(num_items: int, chunk: int, steps: int, generator: torch.Generator) -> list[Tensor]:
    """``steps`` groups of ``chunk`` ids from back-to-back random permutations of ``range(num_items)``.

    ``steps == 0`` means one permutation, i.e. every id exactly once. Ids in a group are unique and sorted.
    """
    if steps == 0:
        order = torch.randperm(num_items, generator=generator)
    else:
        rounds = math.ceil(steps * chunk / num_items)
        order = torch.cat([torch.randperm(num_items, generator=generator) for _ in range(rounds)])[: steps * chunk]
    return [group.unique() for group in order.split(chunk)]


def batch_graph(data: Data, nodes: Tensor, edge_index: Tensor, loss_mask: Tensor, features: bool = True,
                **extra: Tensor | None) -> Data:
    """A batch over ``nodes`` (global ids) with local ``edge_index``; ``None`` extras are left out. A graph
    carrying ``feature_rows`` (:class:`~ladle.graph.sparse.CSRRows` of its bag-of-words features) gives the
    batch's features from their non-zeros, so a worker never pages in the whole dense feature matrix; without
    ``features`` the batch has no ``x`` (its trainer takes the rows of ``n_id`` itself)."""
    rows = data.get("feature_rows")
    x = None if not features else rows(nodes) if rows is not None else data.x[nodes]
    return Data(x=x, y=data.y[nodes], edge_index=edge_index, num_nodes=nodes.numel(), n_id=nodes,
                loss_mask=loss_mask, **extra)


def _part_graph(data: Data, part: Part) -> Data:
    """The eval graph of a partition's ``part``: its split masks and ``loss_mask`` cover owned nodes only."""
    nodes = part.nodes
    graph = batch_graph(data, nodes, part.edge_index, data.train_mask[nodes] & part.owned, degree=part.degree)
    for key in ("train_mask", "val_mask", "test_mask"):
        graph[key] = data[key][nodes] & part.owned
    return graph


def _whole_graph(data: Data) -> Data:
    """The whole graph in the batch format, sharing (not copying) the tensors of ``data``."""
    return Data(x=data.x, y=data.y, edge_index=data.edge_index, num_nodes=data.num_nodes,
                n_id=torch.arange(data.num_nodes), loss_mask=data.train_mask, train_mask=data.train_mask,
                val_mask=data.val_mask, test_mask=data.test_mask, degree=data.get("degree"))


class IngredientView:
    """What ingredient ``k`` of ``num_ingredients`` trains on (``batches``) and validates on (``eval_graph``).

    ``static`` views (full, metis, random) yield their eval graph as the single batch of every epoch,
    so a trainer may cache its adjacency. ``batch_features``: whether sampled batches carry their dense ``x``
    (off when the trainer takes each batch's feature rows from the whole graph's sparse features).
    ``stream``: the index its random streams are drawn from (``k``, the trunk's :data:`TRUNK_STREAM`).
    """

    static: bool = False
    batch_features: bool = True

    def __init__(self, data: Data, config: ViewConfig, k: int, num_ingredients: int, seed: int,
                 partition: Tensor | None = None, adj: InEdges | None = None, stream: int | None = None) -> None:
        self.kind = config.kind
        self.k = k
        self.stream = k if stream is None else stream
        self.num_ingredients = num_ingredients
        self.config = config
        self.seed = seed
        self.data = data
        self.num_classes = int(data.y.max()) + 1
        self._eval = _whole_graph(data)
        self._adj = adj

    @cached_property
    def adj(self) -> InEdges:
        """The in-edge CSR of the input graph: the one given, or built on first use (the full view never needs it)."""
        return self._adj if self._adj is not None else InEdges(self.data.edge_index, self.data.num_nodes)

    def batches(self, epoch: int) -> Iterator[Data]:
        """The training batches of one epoch (deterministic given ``seed``, ``stream`` and ``epoch``)."""
        yield self._eval

    def eval_graph(self) -> Data:
        """The graph this ingredient validates on, with ``train_mask``/``val_mask``/``test_mask``."""
        return self._eval

    def steps_per_epoch(self) -> int:
        """Number of batches ``batches`` yields per epoch."""
        return 1

    def describe(self) -> dict:
        """JSON-able summary: size of the graph it sees, its train nodes and their label histogram."""
        graph = self._eval
        labels = graph.y[graph.train_mask].view(-1)
        return {
            "kind": self.kind, "k": self.k, "num_ingredients": self.num_ingredients,
            "nodes": int(graph.num_nodes), "edges": int(graph.edge_index.size(1)),
            "train_nodes": int(labels.numel()),
            "label_histogram": torch.bincount(labels, minlength=self.num_classes).tolist(),
            "steps_per_epoch": self.steps_per_epoch(),
        }

    def _epoch_generator(self, epoch: int) -> torch.Generator:
        return stream_generator(self.seed, _EPOCH_STREAM, self.stream, epoch)


class FullView(IngredientView):
    """The whole graph, loss on all train nodes: ingredients differ only by their seed."""

    static = True


class PartitionView(IngredientView):
    """Part ``k`` of a K-way partition (METIS, label-balanced METIS or random, seeded by ``seed`` only).

    The ingredient sees the part's induced subgraph, plus its ``view.halo``-hop in-neighbourhood
    read-only (features and edges; no labels, no loss), and never talks to another part.
    """

    static = True

    def __init__(self, data: Data, config: ViewConfig, k: int, num_ingredients: int, seed: int,
                 partition: Tensor | None = None, adj: InEdges | None = None, stream: int | None = None) -> None:
        super().__init__(data, config, k, num_ingredients, seed, adj=adj, stream=stream)
        if num_ingredients > data.num_nodes:
            raise ValueError(f"view.kind={self.kind}: cannot split {data.num_nodes} nodes into "
                             f"{num_ingredients} parts; use at most {data.num_nodes} ingredients")
        if partition is not None:
            self.parts = partition
        elif self.kind == "metis" and config.balance == "labels":
            labels = torch.where(data.train_mask, data.y.view(-1), -1)
            self.parts = label_balanced_partition(self.adj, num_ingredients, seed, labels)
        elif self.kind == "metis":
            self.parts = metis_partition(self.adj, num_ingredients, seed)
        else:
            self.parts = random_partition(data.num_nodes, num_ingredients, stream_generator(seed, _PARTITION_STREAM))
        if not bool((self.parts == k).any()):
            raise ValueError(f"view.kind=metis left part {k} of {num_ingredients} empty; "
                             "use fewer ingredients or view.kind=random")
        self.part = part_subgraph(self.adj, self.parts, k, config.halo)
        self._eval = _part_graph(data, self.part)
        if not bool(self._eval.train_mask.any()):
            log.warning("ingredient %d: its %s part has no train nodes", k, self.kind)

    def describe(self) -> dict:
        """Adds ``cut_edges`` (edges into or out of part ``k``, dropped unless in the halo), ``total_cut_edges``
        and, with a halo, its hops, nodes and edges (``halo``, ``halo_nodes``, ``halo_edges``)."""
        src, dst = self.data.edge_index
        inside = self.parts == self.k
        summary = {**super().describe(),
                   "cut_edges": int((inside[src] ^ inside[dst]).sum()),
                   "total_cut_edges": int((self.parts[src] != self.parts[dst]).sum())}
        if self.config.halo:
            summary |= {"halo": self.config.halo, "halo_nodes": self.part.halo_nodes,
                        "halo_edges": self.part.halo_edges}
        return summary


class ClusterView(IngredientView):
    """ClusterGCN (Chiang et al., 2019): METIS into ``parts`` parts once (seeded by ``seed``); each batch
    is the induced subgraph of ``parts_per_batch`` random parts, edges between them kept.
    """

    def __init__(self, data: Data, config: ViewConfig, k: int, num_ingredients: int, seed: int,
                 partition: Tensor | None = None, adj: InEdges | None = None, stream: int | None = None) -> None:
        super().__init__(data, config, k, num_ingredients, seed, adj=adj, stream=stream)
        if config.parts > data.num_nodes:
            raise ValueError(f"view.parts={config.parts} is more than the {data.num_nodes} nodes of the graph")
        if config.parts_per_batch > config.parts:
            raise ValueError(f"view.parts_per_batch={config.parts_per_batch} must be <= view.parts={config.parts}")
        self.parts = metis_partition(self.adj, config.parts, seed) if partition is None else partition
        order = torch.argsort(self.parts, stable=True)
        sizes = torch.bincount(self.parts, minlength=config.parts)
        self.members = [group for group in order.split(sizes.tolist()) if group.numel() > 0]

    def steps_per_epoch(self) -> int:
        """One pass over all parts unless ``view.steps_per_epoch`` says otherwise."""
        return self.config.steps_per_epoch or math.ceil(len(self.members) / self.config.parts_per_batch)

    def batches(self, epoch: int) -> Iterator[Data]:
        """Random groups of parts; with the default step count every node appears exactly once per epoch."""
        groups = _chunks(len(self.members), self.config.parts_per_batch, self.config.steps_per_epoch,
                         self._epoch_generator(epoch))
        for group in groups:
            nodes = torch.cat([self.members[i] for i in group.tolist()]).sort().values
            edge_index, _ = self.adj.induced(nodes)
            yield batch_graph(self.data, nodes, edge_index, self.data.train_mask[nodes], self.batch_features)


def _undirected_pairs(adj: InEdges) -> tuple[Tensor, Tensor]:
    """Each edge ``{u, v}`` of the graph taken as undirected, once, as a ``[2, E']`` tensor, and every node's degree
    there: the in-edges with ``u < v`` in CSR order, then the one-way edges ``u -> v`` with ``u > v`` (no ``v -> u``:
    a directed graph). On an undirected graph, the in-edge CSR's own pairs and in-degrees."""
    src, dst, n = adj.src, adj.dst, adj.num_nodes
    keys = dst * n + src  # sorted: the CSR's order
    reverse = src * n + dst
    one_way = keys[torch.searchsorted(keys, reverse).clamp_(max=keys.numel() - 1)] != reverse
    canonical, flipped = src < dst, one_way & (src > dst)
    pairs = torch.cat([torch.stack([src[canonical], dst[canonical]]), torch.stack([dst[flipped], src[flipped]])], 1)
    return pairs, adj.deg + torch.bincount(src[one_way], minlength=n)  # u of a one-way u -> v gains v


class SaintView(IngredientView):
    """GraphSAINT (Zeng et al., 2020): induced subgraphs of sampled nodes, with its loss and aggregator weights.

    Samplers: ``saint-node`` draws ``batch_size`` nodes with replacement, :math:`p_v \\propto \\deg(v) + 1`
    (degree in :math:`A + I`); ``saint-edge`` draws ``batch_size`` undirected edges without replacement,
    :math:`p_{u,v} \\propto 1/\\deg(u) + 1/\\deg(v)`, and keeps their endpoints; ``saint-rw`` starts
    ``batch_size`` uniform roots and keeps every node of their ``walk_length``-step random walks. With
    ``batch_size`` 0 a subgraph aims at ``subgraph_share`` of the graph's nodes, at most ``subgraph_max_nodes``.
    Node counts :math:`C_v` and edge counts :math:`C_{u,v}` over pre-sampled subgraphs (until each node
    was drawn ``sample_coverage`` times on average, seeded by ``(seed, k)``) give
    ``loss_weight`` :math:`= n / (C_v |V_{train}|)` for ``n`` pre-samples and
    ``edge_weight`` :math:`= C_v / C_{u,v}` for ``u -> v``. Two deliberate differences from PyG's
    ``GraphSAINTSampler``: the paper's :math:`\\alpha_{u,v} = p_{u,v} / p_v` divides by the count of the
    aggregating node ``v`` (PyG uses the source's :math:`C_u`), and counts never observed in
    pre-sampling are taken as 1 rather than giving ``C_v / 0`` clipped to 1e4 (with the default
    coverage that put weight 1e4 on 0.4% of the node sampler's edges on Cora), so every weight is >= 1.
    A third, measured: ``edge_weight`` scales the batch's own normalised adjacency (degrees counted in the
    subgraph), not the whole graph's as in the paper, so a node's aggregation in a batch is on average 1.6-2.0x
    its whole-graph value on Cora. The paper's form (batches carrying whole-graph degrees) made the default
    recipe's soups lower on CiteSeer, behind a 10- or a 30-epoch trunk (bench/RESULTS.md, *The shipped recipes on
    four graphs never used here; GraphSAINT's aggregator normalisation*), so it is not used.
    """

    def __init__(self, data: Data, config: ViewConfig, k: int, num_ingredients: int, seed: int,
                 partition: Tensor | None = None, adj: InEdges | None = None, stream: int | None = None) -> None:
        super().__init__(data, config, k, num_ingredients, seed, adj=adj, stream=stream)
        num_nodes = data.num_nodes
        num_train = int(data.train_mask.sum())
        if num_train == 0:
            raise ValueError(f"view.kind={self.kind} needs train nodes; the train split is empty")
        nodes_per_sample = min(config.subgraph_max_nodes, max(1, math.ceil(num_nodes * config.subgraph_share)))
        if self.kind == "saint-node":
            self.node_weight = (self.adj.deg + 1).double()
            self.budget = min(config.batch_size or nodes_per_sample, num_nodes)  # more draws than nodes: no more nodes
            nodes_per_sample = self.budget
        elif self.kind == "saint-edge":
            self.pairs, degree = _undirected_pairs(self.adj)
            if self.pairs.size(1) == 0:
                raise ValueError("view.kind=saint-edge needs a graph with edges")
            inv_deg = 1.0 / degree.double()
            self.edge_prob = inv_deg[self.pairs[0]] + inv_deg[self.pairs[1]]
            self.budget = min(config.batch_size or math.ceil(nodes_per_sample / 2), self.pairs.size(1))
            nodes_per_sample = 2 * self.budget
        else:
            self.budget = min(config.batch_size or math.ceil(nodes_per_sample / (config.walk_length + 1)), num_nodes)
            nodes_per_sample = self.budget * (config.walk_length + 1)
        self._steps = config.steps_per_epoch or math.ceil(num_nodes / min(nodes_per_sample, num_nodes))
        self.loss_weight, self.edge_weight = self._normalisation(num_train)

    def steps_per_epoch(self) -> int:
        """``view.steps_per_epoch``, or enough subgraphs to draw about as many nodes as the graph has."""
        return self._steps

    def _sample_nodes(self, generator: torch.Generator) -> Tensor:
        """The sorted unique nodes of one sampled subgraph."""
        if self.kind == "saint-node":
            nodes = torch.multinomial(self.node_weight, self.budget, replacement=True, generator=generator)
        elif self.kind == "saint-edge":
            # Exponential races: the ``budget`` smallest Exp(1) / p are a weighted draw without replacement.
            keys = torch.empty_like(self.edge_prob).exponential_(generator=generator) / self.edge_prob
            nodes = self.pairs[:, torch.topk(keys, self.budget, largest=False).indices].reshape(-1)
        else:
            current = torch.randint(self.adj.num_nodes, (self.budget,), generator=generator)
            visited = [current]
            for _ in range(self.config.walk_length):
                deg = self.adj.deg[current]
                step = (torch.rand(current.numel(), generator=generator, dtype=torch.float64) * deg).long()
                moving = deg > 0  # a walk at an isolated node stays there
                current = current.clone()
                current[moving] = self.adj.src[self.adj.rowptr[current[moving]] + step[moving]]
                visited.append(current)
            nodes = torch.cat(visited)
        return nodes.unique()

    def _normalisation(self, num_train: int) -> tuple[Tensor, Tensor]:
        """``(loss_weight per node, edge_weight per CSR edge)`` estimated from pre-sampled subgraphs."""
        generator = stream_generator(self.seed, _NORM_STREAM, self.stream)
        node_count = torch.zeros(self.adj.num_nodes, dtype=torch.float64)
        edge_count = torch.zeros(self.adj.src.numel(), dtype=torch.float64)
        num_samples = drawn = 0
        while drawn < self.config.sample_coverage * self.adj.num_nodes:
            nodes = self._sample_nodes(generator)
            _, positions = self.adj.induced(nodes)
            node_count[nodes] += 1
            edge_count[positions] += 1
            num_samples += 1
            drawn += nodes.numel()
        # Counts never observed are taken as 1 (PyG and the paper clip C_v / 0 to 1e4 instead).
        node_count, edge_count = node_count.clamp_(min=1), edge_count.clamp_(min=1)
        loss_weight = num_samples / node_count / num_train
        edge_weight = node_count[self.adj.dst] / edge_count
        return loss_weight.float(), edge_weight.float()

    def batches(self, epoch: int) -> Iterator[Data]:
        """``steps_per_epoch`` independent subgraphs with ``loss_weight`` and ``edge_weight``."""
        generator = self._epoch_generator(epoch)
        for _ in range(self._steps):
            nodes = self._sample_nodes(generator)
            edge_index, positions = self.adj.induced(nodes)
            yield batch_graph(self.data, nodes, edge_index, self.data.train_mask[nodes], self.batch_features,
                              loss_weight=self.loss_weight[nodes], edge_weight=self.edge_weight[positions])


class NeighborView(IngredientView):
    """GraphSAGE-style neighbour sampling (Hamilton et al., 2017) from ``batch_size`` seed train nodes.

    Hop ``i`` samples up to ``fanout[i]`` in-neighbours without replacement for each node first reached
    at hop ``i`` (the seeds at hop 0). Local nodes are ordered seeds first, then by the hop that reached
    them; edges by hop. ``num_sampled_nodes`` / ``num_sampled_edges`` give the per-hop counts (as in
    PyG's ``NeighborLoader``), and ``loss_mask`` marks the seeds only.
    """

    def __init__(self, data: Data, config: ViewConfig, k: int, num_ingredients: int, seed: int,
                 partition: Tensor | None = None, adj: InEdges | None = None, stream: int | None = None) -> None:
        super().__init__(data, config, k, num_ingredients, seed, adj=adj, stream=stream)
        self.train_nodes = data.train_mask.nonzero().view(-1)
        if self.train_nodes.numel() == 0:
            raise ValueError("view.kind=neighbor needs train nodes; the train split is empty")
        self.batch_size = min(config.batch_size or _NEIGHBOR_BATCH, self.train_nodes.numel())

    def steps_per_epoch(self) -> int:
        """``view.steps_per_epoch``, or one pass over the train nodes."""
        return self.config.steps_per_epoch or math.ceil(self.train_nodes.numel() / self.batch_size)

    def batches(self, epoch: int) -> Iterator[Data]:
        """One sampled computation graph per group of seeds; the default epoch uses every train node once."""
        generator = self._epoch_generator(epoch)
        for group in _chunks(self.train_nodes.numel(), self.batch_size, self.config.steps_per_epoch, generator):
            yield self._sample(self.train_nodes[group], generator)

    def _sample(self, seeds: Tensor, generator: torch.Generator) -> Data:
        """The fan-out subgraph of ``seeds``: keep ``fanout[i]`` random in-edges per frontier node per hop."""
        local = self.adj.local
        local[seeds] = torch.arange(seeds.numel())
        frontier, nodes, edges = seeds, [seeds], []
        for fanout in self.config.fanout:
            positions, owner = self.adj.rows(frontier)
            # Sort each row by random keys; the first ``fanout`` of a row are a uniform draw without replacement.
            keys = owner.double() + torch.rand(owner.numel(), generator=generator, dtype=torch.float64)
            order = torch.argsort(keys)
            counts = self.adj.deg[frontier]
            rank = torch.arange(order.numel()) - (torch.cumsum(counts, 0) - counts)[owner[order]]
            chosen = order[rank < fanout]
            sources, targets = self.adj.src[positions[chosen]], frontier[owner[chosen]]
            new = sources[local[sources] < 0].unique()
            local[new] = torch.arange(new.numel()) + sum(part.numel() for part in nodes)
            edges.append(torch.stack([local[sources], local[targets]]))
            nodes.append(new)
            frontier = new
        n_id = torch.cat(nodes)
        local[n_id] = -1
        loss_mask = torch.arange(n_id.numel()) < seeds.numel()
        batch = batch_graph(self.data, n_id, torch.cat(edges, dim=1), loss_mask, self.batch_features)
        batch.num_sampled_nodes = [part.numel() for part in nodes]
        batch.num_sampled_edges = [part.size(1) for part in edges]
        return batch


_VIEWS: dict[str, type[IngredientView]] = {
    "full": FullView, "metis": PartitionView, "random": PartitionView, "cluster": ClusterView,
    "saint-node": SaintView, "saint-edge": SaintView, "saint-rw": SaintView, "neighbor": NeighborView,
}


def build_view(data: Data, config: ViewConfig, k: int, num_ingredients: int, seed: int, partition: Tensor | None = None,
               adj: InEdges | None = None, stream: int | None = None) -> IngredientView:
    """The view of ingredient ``k`` of ``num_ingredients`` (heavy preprocessing happens here, once).

    ``partition``: the node -> part ids of a ``metis``/``random``/``cluster`` view computed earlier
    (the launcher computes it once per run, so all workers use the same one). ``adj``: the graph's
    in-edge CSR when the caller built it already (then ``data.edge_index`` is never read). ``stream``: the
    index of its random batch streams, ``k`` unless given (the trunk's is :data:`TRUNK_STREAM`).
    """
    if num_ingredients < 1:
        raise ValueError(f"the number of ingredients must be >= 1, got {num_ingredients}")
    if not 0 <= k < num_ingredients:
        raise ValueError(f"ingredient index k={k} is out of range for {num_ingredients} ingredients "
                         f"(0..{num_ingredients - 1})")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if data.num_nodes == 0:
        raise ValueError("the graph has no nodes")
    if partition is not None and partition.numel() != data.num_nodes:
        raise ValueError(f"the partition has {partition.numel()} entries but the graph {data.num_nodes} nodes")
    if stream is not None and stream < 0:
        raise ValueError(f"the stream index must be >= 0, got {stream}")
    return _VIEWS[config.kind](data, config, k, num_ingredients, seed, partition, adj, stream)
