"""Datasets from a root folder in PyG's layout, with their standard splits.

The root is resolved as ``--data-root`` > ``$LADLE_DATA`` > ``../shared/datasets`` (when it exists)
> ``./data``, and may be read-only. PyG reads a dataset's files in a private folder ladle has just
created; what it produced is kept in the cache (``$LADLE_CACHE`` or ``~/.cache/ladle``) as plain
``.npy`` arrays under ``datasets/<name>-<identity>/``, where the identity is a digest of the files'
paths, sizes and mtimes (:func:`dataset_identity`). Nothing in the cache is unpickled: arrays load
with ``allow_pickle=False`` and PyG is never handed a ``processed/`` file ladle did not just write.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch_geometric
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
from torch_geometric.data.storage import GlobalStorage
from torch_geometric.utils import to_undirected

from ladle.core.errors import LadleError
from ladle.core.files import check_regular, read_json, write_json
from ladle.core.storage import save_npy
from ladle.graph.cache import cache_dir, discard, mark_cache_entry
from ladle.graph.splits import per_class_split, random_split
from ladle.graph.synthetic import NAMED_GRAPHS, parse_synthetic, synthetic_graph

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Source:
    """Where a dataset lives under the root, how PyG loads it, and what to tell a user without it."""

    folder: str
    load: Callable[[Path], Data]
    files: str
    splits: str  # "public" | "per-class" | "shipped" | "random"
    normalize: bool = False


def _planetoid(name: str) -> Callable[[Path], Data]:
    def load(root: Path) -> Data:
        from torch_geometric.datasets import Planetoid

        return Planetoid(str(root), name)[0]

    return load


def _pyg(cls_name: str, name: str | None, sub: str | None = None, **options: bool) -> Callable[[Path], Data]:
    """PyG's ``cls_name`` dataset ``name`` under the root (or its ``sub`` folder), with ``options``."""
    def load(root: Path) -> Data:
        import torch_geometric.datasets as datasets

        cls = getattr(datasets, cls_name)
        where = str(root / sub) if sub else str(root)
        return (cls(where, name, **options) if name else cls(where, **options))[0]

    return load


def _ogb(name: str) -> Callable[[Path], Data]:
    """OGB's own loader on its unzipped download (``<root>/ogbn_arxiv``, ...); it never downloads nor prompts.

    ogb downloads when a ``raw/`` file is missing, and asks on stdin whether to download again when the
    folder lacks its ``RELEASE_v<version>.txt``. ladle first checks every file ogb will read (a missing one is
    named in the error) and, in its private copy, gives the prompt's default answer: keep the files.
    """
    def load(root: Path) -> Data:
        dataset_class, release, needed = _ogb_layout(name)
        folder = root / name.replace("-", "_")
        if not folder.is_dir():
            raise LadleError(f"dataset '{name}' is not in the data root and ladle never downloads it: unzip OGB's "
                             f"download into <data root>/{folder.name} ({release}, {', '.join(needed)}) "
                             "or pass --data-root")
        missing = [path for path in needed if not (folder / path).is_file()]
        if missing:
            raise FileNotFoundError(f"missing {', '.join(missing)}")
        if not (folder / release).exists():
            log.warning("%s has no %s (not OGB's download as is?): reading its files as they are", name, release)
            (folder / release).touch()
        # ogb torch.loads the graph it has just saved with PyG's classes, which torch >= 2.6 refuses by default
        allow = getattr(torch.serialization, "safe_globals", None)
        with allow([DataEdgeAttr, DataTensorAttr, GlobalStorage]) if allow else contextlib.nullcontext():
            dataset = dataset_class(name, str(root))
        data = dataset[0]
        split = dataset.get_idx_split()
        for key, part in (("train", "train"), ("val", "valid"), ("test", "test")):
            mask = torch.zeros(data.num_nodes, dtype=torch.bool)
            mask[split[part]] = True
            data[f"{key}_mask"] = mask
        data.y = data.y.view(-1)
        if data.edge_index is not None:
            data.edge_index = to_undirected(data.edge_index, num_nodes=data.num_nodes)
        return data

    return load


def _ogb_layout(name: str) -> tuple[type, str, list[str]]:
    """ogb's dataset class, and from ogb's table of datasets the release marker and every file its loader reads.

    ogb is imported without ``outdated``, which would start a thread that asks PyPI for ogb's latest version.
    """
    saved = sys.modules.get("outdated")
    sys.modules["outdated"] = None  # type: ignore[assignment]  # ogb skips its version check when absent
    try:
        import ogb.nodeproppred
        import pandas
    except ImportError:
        raise LadleError(f"dataset '{name}' needs the ogb package: pip install 'ladle[ogb]'") from None
    finally:
        if saved is None:
            del sys.modules["outdated"]
        else:
            sys.modules["outdated"] = saved
    table = pandas.read_csv(Path(ogb.nodeproppred.__file__).parent / "master.csv", index_col=0,
                            keep_default_na=False)[name]
    extra = [] if table["additional node files"] == "None" else table["additional node files"].split(",")
    raw = ["edge", "node-feat", "node-label", "num-node-list", "num-edge-list", *extra]
    needed = [f"raw/{file}.csv.gz" for file in raw]
    needed += [f"split/{table['split']}/{part}.csv.gz" for part in ("train", "valid", "test")]
    return ogb.nodeproppred.PygNodePropPredDataset, f"RELEASE_v{table['version']}.txt", needed


SOURCES: dict[str, _Source] = {
    "cora": _Source("Cora", _planetoid("Cora"), "ind.cora.{x,tx,allx,y,ty,ally,graph,test.index}", "public", True),
    "citeseer": _Source(
        "CiteSeer", _planetoid("CiteSeer"), "ind.citeseer.{x,tx,allx,y,ty,ally,graph,test.index}", "public", True
    ),
    "pubmed": _Source(
        "PubMed", _planetoid("PubMed"), "ind.pubmed.{x,tx,allx,y,ty,ally,graph,test.index}", "public", True
    ),
    "physics": _Source("Physics", _pyg("Coauthor", "Physics"), "ms_academic_phy.npz", "per-class"),
    "cs": _Source("CS", _pyg("Coauthor", "CS"), "ms_academic_cs.npz", "per-class"),
    "photo": _Source("Photo", _pyg("Amazon", "Photo"), "amazon_electronics_photo.npz", "per-class"),
    "computers": _Source(
        "Computers", _pyg("Amazon", "Computers"), "amazon_electronics_computers.npz", "per-class"
    ),
    **{
        name: _Source(name, _pyg("WebKB", name), "out1_graph_edges.txt, out1_node_feature_label.txt, "
                      f"{name}_split_0.6_0.2_*.npz", "shipped")
        for name in ("cornell", "texas", "wisconsin")
    },
    "actor": _Source(
        "Actor", _pyg("Actor", None, "Actor"),
        "out1_graph_edges.txt, out1_node_feature_label.txt, film_split_0.6_0.2_*.npz", "shipped"
    ),
    **{
        name: _Source(folder, _pyg("HeterophilousGraphDataset", name), f"{folder}.npz", "shipped")
        for name, folder in ((name, name.replace("-", "_"))  # PyG's folder and file: roman_empire
                             for name in ("roman-empire", "amazon-ratings", "minesweeper", "tolokers", "questions"))
    },
    **{
        name: _Source(name, _pyg("WikipediaNetwork", name), "geom_gcn/raw/: out1_graph_edges.txt, "
                      f"out1_node_feature_label.txt, {name}_split_0.6_0.2_*.npz", "shipped")
        for name in ("chameleon", "squirrel")
    },
    "wikics": _Source("WikiCS", _pyg("WikiCS", None, "WikiCS", is_undirected=True), "data.json", "shipped"),
    **{
        name: _Source(name, _pyg("LINKXDataset", name), "data.mat", "random")
        for name in ("cornell5", "johnshopkins55", "amherst41", "reed98")
    },
    "genius": _Source("genius", _pyg("LINKXDataset", "genius"), "data.mat", "random"),
    "reddit": _Source("Reddit", _pyg("Reddit", None, "Reddit"), "reddit_data.npz, reddit_graph.npz", "shipped"),
    "flickr": _Source("Flickr", _pyg("Flickr", None, "Flickr"), "adj_full.npz, feats.npy, class_map.json, role.json",
                      "shipped"),
    "ogbn-arxiv": _Source("ogbn_arxiv", _ogb("ogbn-arxiv"), "OGB's arxiv.zip unzipped: raw/, split/time/", "shipped"),
    "ogbn-products": _Source(
        "ogbn_products", _ogb("ogbn-products"), "OGB's products.zip unzipped: raw/, split/sales_ranking/", "shipped"
    ),
}
DATASET_NAMES = tuple(SOURCES) + ("synthetic", *NAMED_GRAPHS)


def resolve_data_root(data_root: str | Path | None = None) -> Path:
    """The dataset root: argument > ``$LADLE_DATA`` > ``../shared/datasets`` if present > ``./data``."""
    if data_root is None:
        data_root = os.environ.get("LADLE_DATA") or None
    if data_root is not None:
        root = Path(data_root).expanduser()
        if not root.is_dir():
            problem = "is not a directory" if root.exists() else "does not exist"
            raise LadleError(f"data root {root} {problem} (pass --data-root or set LADLE_DATA)")
        return root
    for candidate in (Path.cwd().parent / "shared" / "datasets",
                      Path(__file__).resolve().parents[2] / "shared" / "datasets"):
        if candidate.is_dir():
            return candidate
    return Path.cwd() / "data"


DATASET_FORMAT = 1
_ARRAY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def dataset_identity(name: str, data_root: str | Path | None = None) -> str | None:
    """A digest of the files ``name`` is read from (relative path, size and mtime of each) and of the PyG
    version that reads them: an edited file or another copy of the dataset gives another identity.

    Resolves (and so checks) the data root on every call. ``"generated"`` for the synthetic graph;
    ``None`` when the root holds none of the dataset's files (PyG would download them).
    """
    key = name.lower()
    if key.startswith("synthetic"):
        return "generated"
    return _files_digest(resolve_data_root(data_root) / _source(key).folder)


def _source(key: str) -> _Source:
    if key not in SOURCES:
        raise LadleError(f"unknown dataset '{key}' (known: {', '.join(DATASET_NAMES)})")
    return SOURCES[key]


def _files_digest(folder: Path) -> str | None:
    """:func:`dataset_identity` of the files in ``folder`` (anything under a ``processed/`` is ignored)."""
    if not folder.is_dir():
        return None
    files = sorted(path for path in folder.rglob("*")
                   if path.is_file() and "processed" not in path.relative_to(folder).parts)
    if not files:
        return None
    digest = hashlib.sha256(f"ladle-dataset {DATASET_FORMAT}; torch_geometric {torch_geometric.__version__}\n".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.relative_to(folder).as_posix()}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def forget_dataset(name: str, data_root: str | Path | None = None) -> None:
    """Drop the cached arrays of ``name`` as read from this root's files: the next load reads them again."""
    key = name.lower()
    identity = dataset_identity(key, data_root)
    if identity not in (None, "generated"):
        discard(cache_dir() / "datasets" / f"{key}-{identity}")


def load_dataset(name: str, data_root: str | Path | None = None, split: int = 0, features: str = "auto") -> Data:
    """Load ``name`` with its standard split as one PyG ``Data`` (``num_classes`` set on it).

    ``split`` picks one of the shipped splits, or seeds the per-class / random split.
    ``features``: ``auto`` row-normalises Planetoid features (their convention), keeps others raw.
    """
    key = name.lower()
    if key.startswith("synthetic"):
        if split != 0:  # its masks come from its own seed
            raise LadleError(f"split={split}: a synthetic graph has one split, drawn from its seed (use split=0)")
        return finish_graph(synthetic_graph(**parse_synthetic(key)), features == "normalize")
    source = _source(key)
    data = _cached_graph(key, source, resolve_data_root(data_root))
    data = _with_split(data, source.splits, split)
    normalize = features == "normalize" or (features == "auto" and source.normalize)
    data.name = key
    return finish_graph(data, normalize)


def _cached_graph(key: str, source: _Source, root: Path) -> Data:
    """The dataset's arrays from the cache entry of its files' identity, or read by PyG now and cached."""
    identity = _files_digest(root / source.folder)
    entries = cache_dir() / "datasets"
    if identity is not None and (entries / f"{key}-{identity}").is_dir():
        entry = entries / f"{key}-{identity}"
        try:
            data = _read_entry(entry)
        except LadleError as error:
            log.warning("%s; reading the dataset files again", error)
        else:
            with contextlib.suppress(OSError):  # the last use, for ladle.prepare --prune; the cache may be read-only
                os.utime(entry)
            return data
    data = _read_with_pyg(key, source, root, entries, present=identity is not None)
    identity = identity or _files_digest(root / source.folder)  # a download kept in the root has one now
    if identity is not None:
        _write_entry(entries / f"{key}-{identity}", key, data)
    return data


def _read_with_pyg(key: str, source: _Source, root: Path, entries: Path, present: bool) -> Data:
    """Let PyG read the dataset's files (or, when not ``present``, download them) in a folder ladle creates now
    and deletes after, so PyG only ever loads the ``processed/`` files it has just written itself."""
    folder = root / source.folder
    try:
        entries.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key}-", suffix=".tmp", dir=entries))
        mark_cache_entry(work)
    except OSError as error:
        raise LadleError(f"cannot create the dataset cache {entries}: {error.strerror} "
                         "(set LADLE_CACHE to a writable folder)") from None
    try:
        if present:
            shutil.copytree(folder, work / source.folder, ignore=shutil.ignore_patterns("processed"))
        try:
            data = source.load(work)
        except LadleError:
            raise
        except Exception as error:  # noqa: BLE001 - PyG raises URLError, OSError, RuntimeError, ...
            raise LadleError(_unreadable(key, source, root, error, present)) from None
        if not present:
            _keep_download(work / source.folder, folder)
        return data
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _unreadable(key: str, source: _Source, root: Path, error: Exception, present: bool) -> str:
    """What to tell a user whose dataset PyG could not read: its files are damaged, or not there."""
    if present:
        detail = (str(error).strip().splitlines() or [""])[0][:160]
        return (f"dataset '{key}' could not be read from {root / source.folder} ({type(error).__name__}: {detail}); "
                f"its files ({source.files}) are damaged or incomplete: replace them")
    return (f"dataset '{key}' could not be loaded from {root} ({type(error).__name__}); put its files "
            f"({source.files}) in {root / source.folder}/raw or pass --data-root")


def _keep_download(downloaded: Path, folder: Path) -> None:
    """Keep what PyG downloaded in the data root, as PyG itself would, so the next run reads it from there."""
    try:
        shutil.copytree(downloaded, folder, ignore=shutil.ignore_patterns("processed"))
    except OSError as error:
        log.warning("could not keep the downloaded files in %s (%s); they will be downloaded again", folder,
                    error.strerror or error)


def _write_entry(entry: Path, key: str, data: Data) -> None:
    """Cache the tensors of ``data`` as ``.npy`` arrays + ``meta.json``, written aside and renamed into place."""
    arrays = {name: value.contiguous().numpy() for name, value in data.items() if isinstance(value, Tensor)}
    temp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".tmp", dir=entry.parent))
    try:
        mark_cache_entry(temp)
        for name, array in arrays.items():
            save_npy(temp / f"{name}.npy", array)
        write_json(temp / "meta.json", {
            "format": DATASET_FORMAT, "dataset": key, "num_nodes": int(data.num_nodes),
            "torch_geometric": torch_geometric.__version__,
            "arrays": {name: [list(array.shape), str(array.dtype)] for name, array in arrays.items()}})
        discard(entry)  # a corrupt one
        os.rename(temp, entry)
    except OSError as error:
        if not entry.is_dir():  # else another process cached it first
            log.warning("could not cache dataset '%s' in %s (%s)", key, entry, error.strerror or error)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _read_entry(entry: Path) -> Data:
    """A cached dataset: ``.npy`` arrays memory-mapped without pickle, each checked against ``meta.json``."""
    meta = read_json(entry / "meta.json")
    corrupt = f"dataset cache {entry} is corrupt"
    if (meta.get("format") != DATASET_FORMAT or not isinstance(meta.get("arrays"), dict)
            or not isinstance(meta.get("num_nodes"), int)):
        raise LadleError(f"{corrupt} (format {meta.get('format')}, expected {DATASET_FORMAT})")
    arrays: dict[str, Tensor] = {}
    for name, expected in meta["arrays"].items():
        if not _ARRAY_NAME.fullmatch(name):
            raise LadleError(f"{corrupt} (array name {name!r})")
        try:
            check_regular(entry / f"{name}.npy")
            array = np.load(entry / f"{name}.npy", mmap_mode="c", allow_pickle=False)
        except (OSError, ValueError, LadleError) as error:
            raise LadleError(f"{corrupt} ({name}.npy: {error})") from None
        if [list(array.shape), str(array.dtype)] != expected:
            raise LadleError(f"{corrupt} ({name}.npy is {array.dtype}{list(array.shape)}, expected {expected})")
        arrays[name] = torch.from_numpy(array)
    return Data(num_nodes=meta["num_nodes"], **arrays)


def normalize_rows(x: Tensor) -> Tensor:
    """Features divided by their row sums (Planetoid's convention; an all-zero row stays zero)."""
    x = x.float()
    return x / x.sum(dim=1, keepdim=True).clamp(min=1e-12)


def finish_graph(data: Data, normalize: bool) -> Data:
    """Float features (row-normalised when ``normalize``), long labels, ``num_classes`` set."""
    data.x = normalize_rows(data.x) if normalize else data.x.float()
    data.y = data.y.long().view(-1)
    data.num_classes = int(data.y.max()) + 1
    return data


def _with_split(data: Data, kind: str, split: int) -> Data:
    labelled = data.y.view(-1) >= 0
    if kind == "per-class":
        data.train_mask, data.val_mask, data.test_mask = per_class_split(data.y, 20, 30, seed=split)
    elif kind == "random":
        data.train_mask, data.val_mask, data.test_mask = random_split(labelled, 0.5, 0.25, seed=split)
    elif kind == "shipped" and data.train_mask.dim() == 2:
        count = data.train_mask.size(1)
        if split >= count:
            raise LadleError(f"split={split} but this dataset ships {count} splits (0..{count - 1})")
        for mask in ("train_mask", "val_mask", "test_mask"):
            data[mask] = data[mask][:, split] if data[mask].dim() == 2 else data[mask]  # WikiCS: one test mask
    elif split != 0:
        raise LadleError(f"split={split}: this dataset has one standard split; use split=0")
    for mask in ("train_mask", "val_mask", "test_mask"):
        data[mask] = data[mask].bool() & labelled
    return data
