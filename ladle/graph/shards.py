"""Shards: a run's graph prepared once, cut so that each worker loads only what its ingredient sees.

A shard is a folder of ``.npy`` arrays (loaded with ``allow_pickle=False``, memory-mapped) and a
``meta.json``: ``x`` (float32 features), ``y``, ``train_mask``/``val_mask``/``test_mask``, the in-edge
CSR ``rowptr``/``col`` (row ``v`` lists the sources of the edges ``u -> v``, sorted; local ids) and
``n_id`` (the global id of each local node). Where GCN/SAGE would multiply the features as a sparse
matrix (bag of words), their non-zeros are stored too (``x_rowptr``/``x_col``/``x_value``), so a
worker builds its inputs without ever reading the dense ``x``.

For partition views (``metis``, ``random``) shard ``part-k`` is part ``k``'s induced subgraph, all
that ingredient ever sees; a worker trains it as the whole graph of a static view and validates on
its own val nodes. With ``view.halo = L`` the shard also holds the part's L-hop in-neighbourhood,
read-only: its split masks are false outside the part, and ``degree`` (whole-graph in-degrees) keeps
the normalisation exact; ``meta.json`` gives the halo's nodes, edges and bytes. Every run also gets
``graph``, the whole graph as one shard: sampled views, ``full`` and the baseline memory-map it, so
concurrent workers share one copy in the page cache.

Preparation (load, partition, write) happens once per content hash of what the shards depend on
(dataset, the identity of its files, split, features, view, K, seed) into ``<cache>/shards/<hash>/``;
each run links it as ``checkpoints/<run>/shards``. The data root is checked on every call, cached or not.
"""
from __future__ import annotations

import contextlib
import copy
import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import Data
from tqdm import tqdm

from ladle.core.errors import LadleError
from ladle.core.files import check_regular, read_json, write_json
from ladle.core.recipe import PARTITION_KINDS, Recipe, ViewConfig
from ladle.core.resources import release_mapped_pages
from ladle.core.storage import save_npy
from ladle.graph.cache import cache_dir, mark_cache_entry
from ladle.graph.datasets import dataset_identity, forget_dataset, load_dataset
from ladle.graph.given import graph_identity
from ladle.graph.inputs import (
    SPARSE_FEATURE_MODELS,
    GraphInputs,
    adjacency,
    graph_inputs,
    use_sparse_features,
)
from ladle.graph.partition import InEdges, cut_edges, part_subgraph
from ladle.graph.sparse import CSRRows, SparseMatrix
from ladle.graph.views import FullView, IngredientView, build_view

log = logging.getLogger(__name__)

SHARD_FORMAT = 1
REBUILD = "rebuild the shards with python -m ladle.prepare --force (same recipe, -k and seed)"
_MASKS = ("train_mask", "val_mask", "test_mask")
_PART_KEYS = ("cut_edges", "total_cut_edges", "halo", "halo_nodes", "halo_edges", "halo_bytes")


# ---------------------------------------------------------------- one shard


@dataclass
class Shard:
    """One loaded shard: its graph and arrays (memory-mapped copy-on-write) and its ``meta.json``."""

    path: Path
    data: Data
    arrays: dict[str, Tensor]
    meta: dict[str, Any]

    @property
    def rowptr(self) -> Tensor:
        """Row pointers of the in-edge CSR (one row per local target node)."""
        return self.arrays["rowptr"]

    @property
    def col(self) -> Tensor:
        """Local source ids of the in-edge CSR."""
        return self.arrays["col"]

    def inputs(self, model: str) -> GraphInputs:
        """:func:`~ladle.graph.inputs.graph_inputs` of the whole shard, decided and built the same way, but bag-of-words
        features come from their stored non-zeros: the dense ``x`` is never read."""
        if not self.meta["sparse_features"] or model not in SPARSE_FEATURE_MODELS:
            return graph_inputs(self.data, model, sparse_features=False)
        rowptr = self.arrays["x_rowptr"]
        row = torch.repeat_interleave(torch.arange(rowptr.numel() - 1), rowptr.diff())
        features = SparseMatrix(row, self.arrays["x_col"], self.arrays["x_value"], tuple(self.data.x.shape))
        adj = adjacency(self.data.edge_index, self.data.num_nodes, model, degree=self.data.get("degree"))
        return GraphInputs(features, adj, self.data.num_nodes)

    def feature_rows(self) -> CSRRows | None:
        """Rows of the features from their stored non-zeros (bag-of-words shards), else None."""
        if not self.meta["sparse_features"]:
            return None
        return CSRRows(self.arrays["x_rowptr"], self.arrays["x_col"], self.arrays["x_value"], tuple(self.data.x.shape))

    def view(self, config: ViewConfig, seed: int) -> IngredientView:
        """The static view of a part shard: the part is the whole graph its ingredient trains on."""
        return PartShardView(self, config, seed)


class PartShardView(FullView):
    """Part ``k`` of a partition view, from its shard: trains exactly as :class:`~ladle.graph.views.PartitionView`
    (same nodes, same local edge order) without the rest of the graph; ``describe`` adds its cut edges
    and halo."""

    def __init__(self, shard: Shard, config: ViewConfig, seed: int) -> None:
        super().__init__(shard.data, config, shard.meta["k"], shard.meta["num_ingredients"], seed)
        self.num_classes = shard.meta["num_classes"]
        self.part_meta = {key: shard.meta[key] for key in _PART_KEYS if key in shard.meta}

    def describe(self) -> dict:
        """The view's summary with the partition's ``cut_edges``, ``total_cut_edges`` and, with a halo,
        ``halo``, ``halo_nodes``, ``halo_edges`` and ``halo_bytes``."""
        return {**super().describe(), **self.part_meta}


def write_shard(path: Path, data: Data, nodes: Tensor, rowptr: Tensor, col: Tensor, extra: dict[str, Any],
                owned: Tensor | None = None, degree: Tensor | None = None,
                saved: Collection[str] = ()) -> dict[str, Any]:
    """Write the subgraph of ``data`` on ``nodes`` (global ids, with its local CSR) as a shard; return its meta.

    ``owned`` (bool per node): nodes outside it are a read-only halo (split masks false there);
    ``degree`` (whole-graph in-degree per node) is stored for the halo's exact normalisation; ``saved``: arrays
    already written in ``path`` (:func:`save_array`), not written again.
    """
    whole = nodes.numel() == data.num_nodes  # nodes are sorted and unique: all of them, in order

    def take(values: Tensor) -> Tensor:
        return values if whole else values[nodes]

    masks = {mask: take(data[mask]) if owned is None else take(data[mask]) & owned for mask in _MASKS}
    arrays = {"x": take(data.x), "y": take(data.y), **masks, "rowptr": rowptr, "col": col, "n_id": nodes}
    sparse = use_sparse_features(arrays["x"], "gcn")  # the same choice for sage; gat never goes sparse
    if sparse:
        row, column = arrays["x"].nonzero(as_tuple=True)
        x_rowptr = torch.zeros(nodes.numel() + 1, dtype=torch.long)
        x_rowptr[1:] = torch.bincount(row, minlength=nodes.numel()).cumsum(0)
        arrays |= {"x_rowptr": x_rowptr, "x_col": column, "x_value": arrays["x"][row, column]}
    if degree is not None:
        arrays["degree"] = degree
    meta = {"format": SHARD_FORMAT, "num_nodes": int(nodes.numel()), "num_edges": int(col.numel()),
            "sparse_features": sparse,
            "num_features": int(data.num_features), "num_classes": int(data.num_classes),
            **{mask.replace("_mask", "_nodes"): int(arrays[mask].sum()) for mask in _MASKS}, **extra,
            **(_halo_footprint(arrays, owned) if owned is not None else {}),
            "arrays": {name: [list(array.shape), str(array.numpy().dtype)] for name, array in arrays.items()}}
    for name, array in arrays.items():
        if name not in saved:
            save_array(path, name, array)
    write_json(path / "meta.json", meta)
    return meta


def save_array(path: Path, name: str, array: Tensor) -> Tensor:
    """Write ``array`` as ``path/name.npy`` (atomically) and return it memory-mapped back from there."""
    save_npy(path / f"{name}.npy", array.contiguous().numpy())
    return torch.from_numpy(np.load(path / f"{name}.npy", mmap_mode="c", allow_pickle=False))


def _halo_footprint(arrays: dict[str, Tensor], owned: Tensor) -> dict[str, int]:
    """The halo's nodes, its edges (those with a halo endpoint) and the bytes of the shard they take:
    their rows of every per-node array, their entries of the edge and feature arrays, and ``degree``."""
    halo = ~owned
    num_halo = int(halo.sum())
    rowptr, col = arrays["rowptr"], arrays["col"]
    row = torch.repeat_interleave(torch.arange(owned.numel()), rowptr.diff())
    halo_edges = int((halo[col] | halo[row]).sum())
    halo_nonzeros = int(arrays["x_rowptr"].diff()[halo].sum()) if "x_rowptr" in arrays else 0
    size = 0
    for name, array in arrays.items():
        if name == "degree":
            size += array.numel() * array.element_size()
        elif name == "col":
            size += halo_edges * array.element_size()
        elif name in ("x_col", "x_value"):
            size += halo_nonzeros * array.element_size()
        else:  # one row per node (rowptr and x_rowptr: one entry per node, plus one)
            size += num_halo * array[0].numel() * array.element_size()
    return {"halo_nodes": num_halo, "halo_edges": halo_edges, "halo_bytes": size}


def load_shard(path: Path, edge_index: bool = True) -> Shard:
    """Memory-map a shard (copy-on-write: nothing is read until used, nothing is written back).

    No pickle is involved; a missing or truncated file is a :class:`LadleError` naming the fix.
    ``edge_index=False``: the graph's ``edge_index`` is not built (callers that read the CSR alone save
    16 bytes per edge).
    """
    path = Path(path)
    meta = read_json(path / "meta.json", REBUILD)
    if meta.get("format") != SHARD_FORMAT or not isinstance(meta.get("arrays"), dict):
        raise LadleError(f"shard {path} has format {meta.get('format')}, expected {SHARD_FORMAT}; {REBUILD}")
    arrays: dict[str, Tensor] = {}
    for name, (shape, dtype) in meta["arrays"].items():
        try:
            check_regular(path / f"{name}.npy")
            array = np.load(path / f"{name}.npy", mmap_mode="c", allow_pickle=False)
        except (OSError, ValueError, LadleError) as error:
            raise LadleError(f"shard {path} is corrupt or incomplete ({name}.npy: {error}); {REBUILD}") from None
        if list(array.shape) != shape or str(array.dtype) != dtype:
            raise LadleError(f"shard {path} is corrupt ({name}.npy is {array.dtype}{list(array.shape)}, "
                             f"expected {dtype}{shape}); {REBUILD}")
        arrays[name] = torch.from_numpy(array)
    rowptr, col = arrays["rowptr"], arrays["col"]
    edges = None
    if edge_index:
        edges = torch.stack([col, torch.repeat_interleave(torch.arange(meta["num_nodes"]), rowptr.diff())])
    data = Data(x=arrays["x"], y=arrays["y"], edge_index=edges, n_id=arrays["n_id"],
                num_nodes=meta["num_nodes"], degree=arrays.get("degree"), **{mask: arrays[mask] for mask in _MASKS})
    data.num_classes = meta["num_classes"]
    data.name = meta["dataset"]
    return Shard(path, data, arrays, meta)


# ---------------------------------------------------------------- the shards of a run


def shard_inputs(recipe: Recipe, ingredients: int, data_root: str | Path | None = None,
                 graph: Data | None = None) -> dict[str, Any]:
    """What a run's shards depend on (nothing else: ``lr``, ``epochs``, ``view.fallback`` do not change them), with the
    identity of the dataset's files under ``data_root`` (:func:`~ladle.graph.datasets.dataset_identity`), or of
    the ``graph`` given in memory (:func:`~ladle.graph.given.user_graph`, :func:`graph_identity`)."""
    identity = dataset_identity(recipe.dataset, data_root) if graph is None else graph_identity(graph)
    return {"format": SHARD_FORMAT, "dataset": recipe.dataset.lower(), "split": recipe.split,
            "features": recipe.features, "ingredients": ingredients,
            "view": {key: value for key, value in recipe.to_dict()["view"].items() if key != "fallback"},
            "seed": recipe.seed, "data": identity}


def shard_key(recipe: Recipe, ingredients: int, data_root: str | Path | None = None,
              graph: Data | None = None) -> str:
    """The content hash naming the cache folder of a run's shards."""
    return _hash(shard_inputs(recipe, ingredients, data_root, graph))


def cached_shards(key: str) -> Path:
    """The cache folder of the shards whose cache key is ``key`` (:func:`shard_key`)."""
    return cache_dir() / "shards" / key


def _hash(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ShardSet:
    """The prepared shards of a run: ``graph`` always, ``part-XX`` for partition views, and the
    node -> part ids of ``metis``/``random``/``cluster`` views (``partition.npy``)."""

    path: Path
    meta: dict[str, Any]

    @classmethod
    def open(cls, path: Path) -> ShardSet:
        """The shard set in ``path`` (a cache folder or a run's ``shards`` link)."""
        return cls(Path(path), read_json(Path(path) / "shards.json", REBUILD))

    @property
    def partitioned(self) -> bool:
        """Whether each ingredient has a part shard of its own."""
        return bool(self.meta["parts"])

    def graph(self) -> Path:
        """The whole-graph shard (sampled and full views, the baseline, the soup)."""
        return self.path / "graph"

    def part(self, k: int) -> Path:
        """The shard of ingredient ``k`` of a partition view."""
        return self.path / f"part-{k:02d}"

    def partition(self) -> Tensor | None:
        """The node -> part ids the run's view uses, or None."""
        if not self.meta["partition"]:
            return None
        check_regular(self.path / "partition.npy")
        try:
            return torch.from_numpy(np.load(self.path / "partition.npy", allow_pickle=False))
        except (OSError, ValueError) as error:
            raise LadleError(f"{self.path / 'partition.npy'} is corrupt ({error}); {REBUILD}") from None

    def complete(self) -> bool:
        """Whether every shard listed in ``shards.json`` has a readable ``meta.json`` that lists its arrays, each
        present as a regular file of at least its size (the arrays themselves are checked on load)."""
        if self.meta.get("format") != SHARD_FORMAT:
            return False
        try:
            for name in ["graph", *self.meta["parts"]]:
                meta = read_json(self.path / name / "meta.json", REBUILD)
                for array, (shape, dtype) in meta["arrays"].items():
                    file = self.path / name / f"{array}.npy"
                    check_regular(file)
                    if file.stat().st_size < np.dtype(dtype).itemsize * int(np.prod(shape)):
                        return False
        except (LadleError, OSError, KeyError, TypeError, ValueError):
            return False
        return True

    def link(self, run_dir: Path) -> Path:
        """Point ``run_dir/shards`` at this set (a symlink, replaced atomically); return the link."""
        link = Path(run_dir) / "shards"
        temp = Path(run_dir) / f".shards.{os.getpid()}"
        temp.unlink(missing_ok=True)
        temp.symlink_to(self.path.resolve(), target_is_directory=True)
        os.replace(temp, link)
        return link


def prepare_shards(recipe: Recipe, ingredients: int, data_root: str | Path | None = None,
                   force: bool = False, graph: Data | None = None) -> ShardSet:
    """The shards of a run of ``recipe`` with ``ingredients`` ingredients, from the cache or built now.

    Building loads the dataset once, computes the run's partition (once per run, so all workers use
    the same one: METIS draws from the process-wide ``rand()``; this also validates the view settings)
    and writes every shard into a temporary folder renamed into place at the end, so a crash or a
    concurrent preparation never leaves a half-written set. The data root is checked every time: the key
    holds the identity of the dataset's files, and without files (a download) nothing is reused.
    ``force`` rebuilds, the dataset's cached arrays too. ``graph``: a graph given in memory
    (:func:`~ladle.graph.given.user_graph`) instead of the recipe's dataset.
    """
    if ingredients < 1:
        raise LadleError(f"--ingredients must be >= 1, got {ingredients}")
    inputs = shard_inputs(recipe, ingredients, data_root, graph)
    target = cached_shards(_hash(inputs))
    root = target.parent
    stale = target.exists()
    if stale and not force and inputs["data"] is not None:
        try:
            shards: ShardSet | None = ShardSet.open(target)
        except LadleError:
            shards = None
        if shards is not None and shards.complete():
            log.info("shards of %s (K=%d, view %s) from the cache: %s", recipe.dataset, ingredients,
                     recipe.view.kind, target)
            with contextlib.suppress(OSError):  # the last use, for ladle.prepare --prune
                os.utime(target)
            return shards
        log.warning("the cached shards %s are incomplete or damaged; rebuilding them", target)
    if force and graph is None:
        forget_dataset(recipe.dataset, data_root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LadleError(f"cannot create the shard cache {root}: {error.strerror} "
                         "(set LADLE_CACHE to a writable folder)") from None
    start = time.perf_counter()
    temp = root / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    try:
        mark_cache_entry(temp)
        meta = _build(recipe, ingredients, data_root, temp, inputs, graph)
        write_json(temp / "shards.json", meta | {"key": target.name, "seconds": time.perf_counter() - start})
        if stale:
            shutil.rmtree(target)  # forced, or found incomplete
        os.rename(temp, target)
    except OSError as error:
        if stale or not (target / "shards.json").is_file():
            raise
        log.info("another process prepared %s first (%s); using it", target, error.strerror)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    log.info("prepared shards of %s (K=%d, view %s) in %.1f s: %s", recipe.dataset, ingredients,
             recipe.view.kind, time.perf_counter() - start, target)
    return ShardSet.open(target)


def _build(recipe: Recipe, ingredients: int, data_root: str | Path | None, folder: Path,
           inputs: dict[str, Any], graph: Data | None = None) -> dict[str, Any]:
    """Load the dataset, partition it and write every shard of the run into ``folder``; return ``shards.json``.

    The memory stays near one copy of the graph's edges: the features are written to the whole-graph shard and
    memory-mapped back before the in-edge CSR is built, the edges are then held once, as that CSR (the dataset's
    ``edge_index`` is dropped once it is built), and the other per-node arrays are read back memory-mapped from
    the whole-graph shard as soon as it is written, so partitioning and each part touch only the rows they need.
    """
    data = load_dataset(recipe.dataset, data_root, recipe.split, recipe.features) if graph is None else copy.copy(graph)
    data.x = save_array(folder / "graph", "x", data.x)
    adj = InEdges(data.edge_index, data.num_nodes)
    data.edge_index = None
    common = {"dataset": recipe.dataset.lower(), "view": recipe.view.kind}
    partitioned = recipe.view.kind in PARTITION_KINDS
    with tqdm(total=1 + (ingredients if partitioned else 0), desc=f"preparing shards of {recipe.dataset}", unit="shard",
              leave=False, dynamic_ncols=True, disable=None) as bar:
        graph = write_shard(folder / "graph", data, torch.arange(data.num_nodes), adj.rowptr, adj.src,
                            {**common, "k": None, "num_ingredients": ingredients}, saved={"x"})
        bar.update(1)
        data = load_shard(folder / "graph", edge_index=False).data  # per-node arrays memory-mapped from now on
        view = build_view(data, recipe.view, 0, ingredients, recipe.seed, adj=adj)  # bad K etc. fail here
        partition: Tensor | None = getattr(view, "parts", None)
        del view
        release_mapped_pages(data.x)  # the rows part 0's view read (written by no one: the shard's read-only copy)
        parts: list[str] = []
        if partitioned:
            assert partition is not None
            parts = _write_parts(data, adj, partition, ingredients, recipe.view.halo, folder, common, bar)
    if partition is not None:
        save_array(folder, "partition", partition)
    return {"format": SHARD_FORMAT, "inputs": inputs,
            "graph": {k: v for k, v in graph.items() if k != "arrays"}, "parts": parts,
            "partition": partition is not None, "created": dt.datetime.now().isoformat(timespec="seconds")}


def _write_parts(data: Data, adj: InEdges, parts: Tensor, num_parts: int, halo: int, folder: Path,
                 common: dict[str, Any], bar: tqdm) -> list[str]:
    """Write each part's induced subgraph, with its ``halo``-hop in-neighbourhood read-only, as ``part-XX``
    (``bar`` ticks once a part); return their names.

    Nodes keep their global order and edges their CSR order, so part ``k`` is exactly
    :class:`~ladle.graph.views.PartitionView` ``k``'s eval graph.
    """
    cut = cut_edges(adj, parts, num_parts)
    total_cut = int(cut.sum()) // 2  # a cut edge counts in both its parts
    empty = (torch.bincount(parts, minlength=num_parts) == 0).nonzero().view(-1)
    if empty.numel():
        raise LadleError(f"view.kind={common['view']} left part {int(empty[0])} of {num_parts} empty; "
                         "use fewer ingredients or view.kind=random")
    names = []
    for k in range(num_parts):
        part = part_subgraph(adj, parts, k, halo)
        rowptr = torch.zeros(part.nodes.numel() + 1, dtype=torch.long)
        rowptr[1:] = torch.bincount(part.edge_index[1], minlength=part.nodes.numel()).cumsum(0)
        extra = {**common, "k": k, "num_ingredients": num_parts, "cut_edges": int(cut[k]),
                 "total_cut_edges": total_cut, **({"halo": halo} if halo else {})}
        meta = write_shard(folder / f"part-{k:02d}", data, part.nodes, rowptr, part.edge_index[0], extra,
                           part.owned if halo else None, part.degree)
        release_mapped_pages(data.x)  # this part's feature rows
        if meta["train_nodes"] == 0:
            log.warning("ingredient %d: its %s part has no train nodes", k, common["view"])
        names.append(f"part-{k:02d}")
        bar.update(1)
    return names
