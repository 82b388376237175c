"""A seeded contextual stochastic block model, with or without communities: the synthetic graph behind
``dataset: synthetic:...``."""
from __future__ import annotations

import math

import numpy as np
import torch
from torch_geometric.data import Data

from ladle.core.errors import LadleError
from ladle.core.resources import total_memory
from ladle.graph.splits import random_split

SYNTHETIC_DEFAULTS = {"nodes": 10_000, "degree": 10, "features": 64, "classes": 10,
                      "homophily": 0.7, "signal": 0.25, "seed": 0, "communities": 0, "locality": 0.8,
                      "subclasses": 1, "affinity": 0.0}
# Named synthetic graphs. synthetic-products: ogbn-products' shape (1M nodes, mean degree ~26, 100 features,
# 47 classes) with its locality (communities of ~500 that METIS keeps: K = 8 parts cut ~19 % of the edges),
# weak features, 5 % label noise and 4 classes a community whose nodes tell apart only by a plurality of their
# neighbours: a full-graph GCN climbs for 200 epochs (66 % validation after 20, 83 % after 100, 84 % after 200, under
# the 95 % its label noise allows; bench/RESULTS.md, *synthetic-products with four classes a community*).
NAMED_GRAPHS = {
    "synthetic-products": "synthetic:nodes=1000000,degree=26,features=100,classes=47,homophily=0.95,signal=0.15,"
                          "communities=2000,locality=0.8,subclasses=4,affinity=0.4",
}


def parse_synthetic(spec: str) -> dict[str, float]:
    """``synthetic:nodes=1000,degree=8`` (or a name of :data:`NAMED_GRAPHS`) -> keyword arguments of
    :func:`synthetic_graph`."""
    _, _, body = NAMED_GRAPHS.get(spec, spec).partition(":")
    options: dict[str, float] = dict(SYNTHETIC_DEFAULTS)
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in SYNTHETIC_DEFAULTS:
            raise LadleError(
                f"bad synthetic option '{item}' (known: {', '.join(SYNTHETIC_DEFAULTS)}; e.g. synthetic:nodes=100000)"
            )
        try:
            number = float(value)
            options[key] = type(SYNTHETIC_DEFAULTS[key])(number)
        except (ValueError, OverflowError):
            number = math.nan
        if not math.isfinite(number):
            raise LadleError(f"synthetic option '{key}' needs a finite number, got '{value}'")
    if (options["classes"] < 2 or options["nodes"] < options["classes"] * 4 or options["degree"] < 1
            or options["features"] < 1 or not 0 <= options["homophily"] <= 1 or options["signal"] < 0
            or not 0 <= options["seed"] < 2**63 or not 0 <= options["communities"] <= options["nodes"]
            or not 0 <= options["locality"] <= 1 or not 0 <= options["affinity"] <= 1
            or not 1 <= options["subclasses"] <= (options["classes"] if options["communities"] else 1)):
        raise LadleError("synthetic graph needs classes >= 2, nodes >= 4 * classes, degree >= 1, features >= 1, "
                         "0 <= homophily <= 1, signal >= 0, 0 <= seed < 2^63, 0 <= communities <= nodes, "
                         "0 <= locality <= 1, 0 <= affinity <= 1 and 1 <= subclasses <= classes "
                         "(above 1 only with communities)")
    needed = options["nodes"] * (4 * options["features"] + 16 * options["degree"])  # features and edges
    memory = total_memory()
    if memory and needed > memory:
        raise LadleError(f"synthetic graph of {options['nodes']:,} nodes needs about {needed / 2**30:.1f} GiB, above "
                         f"this machine's {memory / 2**30:.1f} GiB")
    return options


def synthetic_graph(nodes: int, degree: int, features: int, classes: int, homophily: float = 0.7,
                    signal: float = 0.25, seed: int = 0, communities: int = 0, locality: float = 0.8,
                    subclasses: int = 1, affinity: float = 0.0, chunk: int = 1 << 18) -> Data:
    """A contextual stochastic block model: learnable from features (class means + noise) and structure.

    Each node draws ``degree / 2`` partners, of its own class with probability ``homophily``; the
    graph is then made undirected (edges sorted by source, then target). With ``communities`` > 0 the graph
    has locality below its classes, as co-purchase or citation graphs do (what a METIS partition keeps): each
    node belongs to one of ``communities`` random communities, takes its community's class with probability
    ``homophily`` (else a random class), and draws each partner from its own community with probability
    ``locality`` (else from the whole graph). With ``subclasses`` = m > 1 a community holds m classes (its
    dominant one and m - 1 random ones) in m random groups of its nodes, and a partner from the community comes
    from the node's own group with probability ``affinity`` (else from the whole community): a node's class then
    shows only as a plurality of its neighbours, which a model must learn to read. Generated in chunks of
    ``chunk`` nodes into one preallocated array of pairs, deduplicated as int64 keys sorted in place, so the
    peak stays near the output's size (1M nodes, 10M edges, 64 features: 0.4 GB out, 0.6 GB peak above the
    interpreter).
    """
    generator = torch.Generator().manual_seed(seed)
    cells = None  # with subclasses: each node's group in its community, the nodes by group, where each starts
    if communities:
        group = torch.randint(communities, (nodes,), generator=generator)
        dominant = torch.randint(classes, (communities,), generator=generator)
        own = torch.rand(nodes, generator=generator) < homophily
        noise = torch.randint(classes, (nodes,), generator=generator)
        same_group, groups = locality, communities
        if subclasses > 1:  # a node's group in its community, and each group's class (group 0: the dominant)
            cell = torch.randint(subclasses, (nodes,), generator=generator)
            cell_class = torch.randint(classes, (communities, subclasses), generator=generator)
            cell_class[:, 0] = dominant
            y = torch.where(own, cell_class[group, cell], noise)
            cell += group * subclasses
            cells = (cell, *_grouped(cell, communities * subclasses))
        else:
            y = torch.where(own, dominant[group], noise)
    else:  # the group a partner is drawn from is the class
        y = group = torch.randint(classes, (nodes,), generator=generator)
        same_group, groups = homophily, classes
    means = torch.randn(classes, features, generator=generator) * signal
    by_group, group_start = _grouped(group, groups)
    half = max(1, degree // 2)
    x = torch.empty(nodes, features)
    pairs = np.empty(nodes * half, dtype=np.int64)  # undirected pairs (low, high) as keys low * nodes + high
    count = 0
    for start in range(0, nodes, chunk):
        ids = torch.arange(start, min(start + chunk, nodes))
        x[ids] = means[y[ids]] + torch.randn(ids.numel(), features, generator=generator)
        src = ids.repeat_interleave(half)
        same = torch.rand(src.numel(), generator=generator) < same_group
        intra = _member(group[src], by_group, group_start, generator)
        if cells is not None:
            kin = torch.rand(src.numel(), generator=generator) < affinity
            intra = torch.where(kin, _member(cells[0][src], *cells[1:], generator), intra)
        anywhere = torch.randint(nodes, (src.numel(),), generator=generator)
        dst = torch.where(same, intra, anywhere)
        keep = src != dst
        src, dst = src[keep], dst[keep]
        pairs[count:count + src.numel()] = (torch.minimum(src, dst) * nodes + torch.maximum(src, dst)).numpy()
        count += src.numel()
    edge_index = torch.from_numpy(_undirected_edges(pairs, count, nodes))
    train, val, test = random_split(torch.ones(nodes, dtype=torch.bool), 0.1, 0.1, seed=seed)
    data = Data(x=x, y=y, edge_index=edge_index, train_mask=train, val_mask=val, test_mask=test)
    data.name = "synthetic"
    return data


def _grouped(group: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nodes sorted by group, and where each group starts in that order (``groups + 1`` offsets)."""
    start = torch.zeros(groups + 1, dtype=torch.long)
    start[1:] = torch.bincount(group, minlength=groups).cumsum(0)
    return torch.argsort(group), start


def _member(groups: torch.Tensor, by_group: torch.Tensor, start: torch.Tensor,
            generator: torch.Generator) -> torch.Tensor:
    """One uniformly drawn member of each of ``groups`` (none may be empty)."""
    size = start[groups + 1] - start[groups]
    return by_group[start[groups] + (torch.rand(groups.numel(), generator=generator) * size).long()]


_KEY_CHUNK = 1 << 22  # pairs reversed at once


def _undirected_edges(pairs: np.ndarray, count: int, nodes: int) -> np.ndarray:
    """Both directions of the distinct undirected pairs among ``pairs[:count]`` (keys ``low * nodes + high``),
    sorted by (source, target), as a ``[2, E]`` int64 array: what ``to_undirected`` gives, without its copies.
    ``pairs`` is consumed (its memory handed back once read); the sorted keys then grow in place into the two
    rows, so the peak is the output."""
    drawn = pairs[:count]
    drawn.sort()
    first = np.ones(count, dtype=bool)
    np.not_equal(drawn[1:], drawn[:-1], out=first[1:])
    distinct = int(first.sum())
    keys = np.empty(2 * distinct, dtype=np.int64)
    np.compress(first, drawn, out=keys[:distinct])
    del drawn, first
    pairs.resize(0, refcheck=False)
    for start in range(0, distinct, _KEY_CHUNK):  # the reversed pairs, high * nodes + low
        forward = keys[start:min(start + _KEY_CHUNK, distinct)]
        keys[distinct + start:distinct + start + forward.size] = forward % nodes * nodes + forward // nodes
    edges = keys.size
    keys.sort()
    keys.resize(2 * edges, refcheck=False)  # realloc: the sorted keys stay in the first half
    edge_index = keys.reshape(2, edges)
    np.remainder(edge_index[0], nodes, out=edge_index[1])
    edge_index[0] //= nodes
    return edge_index
