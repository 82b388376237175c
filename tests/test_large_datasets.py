"""Datasets whose files are not in the shared root (Reddit, Flickr, ogbn-arxiv, ogbn-products, the heterophilous,
Wikipedia, WikiCS and genius graphs) load through ladle's one code path when their files are present.

Each test writes a tiny fake in the dataset's exact on-disk layout (the files PyG's or OGB's loader reads),
loads it with :func:`ladle.graph.datasets.load_dataset` from a root in ``tmp_path``, checks every array against what
was written, and loads it a second time from ladle's cache with the reader made unusable. Nothing downloads:
the network is cut, and stdin prompts fail the test.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import ladle.graph.datasets
from ladle.core.errors import LadleError
from ladle.graph.datasets import load_dataset

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable:UserWarning")  # ogb's
needs_ogb = pytest.mark.skipif(importlib.util.find_spec("ogb") is None, reason="the ogb extra is not installed")

NODES, FEATURES, CLASSES = 12, 5, 3


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache in ``tmp_path``, no network, and no stdin: a download or a prompt fails the test."""
    monkeypatch.setenv("LADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("urllib.request.urlopen", _refuse)
    monkeypatch.setattr("builtins.input", _refuse)
    return tmp_path / "cache"


def _refuse(*args, **kwargs):
    raise AssertionError(f"tried to download or prompt: {args}")


def _graph(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features (float32), labels, and directed edges (one direction, no self-loops, no duplicates)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((NODES, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, NODES)
    y[:CLASSES] = np.arange(CLASSES)  # every class present
    pairs = {(int(a), int(b)) for a, b in rng.integers(0, NODES, (30, 2)) if a < b}
    return x, y, np.array(sorted(pairs)).T


def _edge_set(edge_index: torch.Tensor) -> set[tuple[int, int]]:
    assert edge_index.size(1) == len({tuple(edge) for edge in edge_index.t().tolist()}), "duplicate edges"
    return {(int(a), int(b)) for a, b in edge_index.t().tolist()}


def _both_ways(edges: np.ndarray) -> set[tuple[int, int]]:
    return {(int(a), int(b)) for a, b in edges.T} | {(int(b), int(a)) for a, b in edges.T}


def _mask(index: np.ndarray) -> torch.Tensor:
    mask = torch.zeros(NODES, dtype=torch.bool)
    mask[torch.from_numpy(index)] = True
    return mask


def _split() -> dict[str, np.ndarray]:
    order = np.random.default_rng(7).permutation(NODES)
    return {"train": order[:6], "valid": order[6:9], "test": order[9:]}


def _check(data, x: np.ndarray, y: np.ndarray, edges: set[tuple[int, int]], split: dict[str, np.ndarray]) -> None:
    assert data.num_nodes == NODES and data.num_classes == CLASSES
    assert torch.allclose(data.x, torch.from_numpy(x), atol=1e-6)
    assert torch.equal(data.y, torch.from_numpy(y).long())
    assert _edge_set(data.edge_index) == edges
    for mask, part in (("train_mask", "train"), ("val_mask", "valid"), ("test_mask", "test")):
        assert torch.equal(data[mask], _mask(split[part])), mask


def _load_twice(name: str, root: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, reader: str) -> tuple:
    """Load ``name`` from its files, then again with ``ladle.graph.datasets.<reader>`` broken: only the cache can answer."""
    first = load_dataset(name, data_root=root)
    assert len(list((cache / "datasets").glob(f"{name}-*"))) == 1
    monkeypatch.setattr(ladle.graph.datasets, reader, _refuse)
    return first, load_dataset(name, data_root=root)


# --- OGB: <root>/ogbn_<name>/{RELEASE_v1.txt, raw/*.csv.gz, split/<kind>/{train,valid,test}.csv.gz} -----------


def _csv_gz(path: Path, rows: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = rows.reshape(len(rows), -1)
    with gzip.open(path, "wt") as stream:
        stream.writelines(",".join(repr(value.item()) for value in row) + "\n" for row in rows)


def _fake_ogb(root: Path, folder: str, split_kind: str, extra: tuple[str, ...] = ()) -> tuple:
    x, y, edges = _graph(seed=len(folder))
    split = _split()
    where = root / folder
    _csv_gz(where / "raw" / "edge.csv.gz", edges.T)
    _csv_gz(where / "raw" / "node-feat.csv.gz", x)
    _csv_gz(where / "raw" / "node-label.csv.gz", y)
    _csv_gz(where / "raw" / "num-node-list.csv.gz", np.array([NODES]))
    _csv_gz(where / "raw" / "num-edge-list.csv.gz", np.array([edges.shape[1]]))
    for name in extra:
        _csv_gz(where / "raw" / f"{name}.csv.gz", np.arange(2000, 2000 + NODES))
    for part, index in split.items():
        _csv_gz(where / "split" / split_kind / f"{part}.csv.gz", index)
    (where / "RELEASE_v1.txt").write_text("fake\n")
    return x, y, edges, split


@needs_ogb
@pytest.mark.parametrize(("name", "folder", "split_kind", "extra"), [
    ("ogbn-arxiv", "ogbn_arxiv", "time", ("node_year",)),
    ("ogbn-products", "ogbn_products", "sales_ranking", ()),
])
def test_ogb_layout_loads_then_comes_from_the_cache(tmp_path: Path, offline: Path, monkeypatch: pytest.MonkeyPatch,
                                                    name: str, folder: str, split_kind: str,
                                                    extra: tuple[str, ...]) -> None:
    root = tmp_path / "root"
    x, y, edges, split = _fake_ogb(root, folder, split_kind, extra)
    for data in _load_twice(name, root, offline, monkeypatch, "_ogb_layout"):
        _check(data, x, y, _both_ways(edges), split)
    assert not (root / folder / "processed").exists()  # ogb worked in ladle's private copy


@needs_ogb
def test_ogb_without_release_file_loads_without_prompting(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    x, y, edges, split = _fake_ogb(root, "ogbn_arxiv", "time", ("node_year",))
    (root / "ogbn_arxiv" / "RELEASE_v1.txt").unlink()
    _check(load_dataset("ogbn-arxiv", data_root=root), x, y, _both_ways(edges), split)
    assert "has no RELEASE_v1.txt" in caplog.text
    assert not (root / "ogbn_arxiv" / "RELEASE_v1.txt").exists()  # the marker went to the private copy only


@needs_ogb
def test_ogb_missing_files_are_named_and_never_downloaded(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _fake_ogb(root, "ogbn_arxiv", "time", ("node_year",))
    (root / "ogbn_arxiv" / "raw" / "node-feat.csv.gz").unlink()
    (root / "ogbn_arxiv" / "split" / "time" / "valid.csv.gz").unlink()
    with pytest.raises(LadleError, match=r"ogbn_arxiv .*missing raw/node-feat.csv.gz, split/time/valid.csv.gz"):
        load_dataset("ogbn-arxiv", data_root=root)
    with pytest.raises(LadleError, match=r"never downloads it: .*<data root>/ogbn_products \(RELEASE_v1.txt"):
        load_dataset("ogbn-products", data_root=root)
    assert sorted(path.name for path in root.iterdir()) == ["ogbn_arxiv"]


@needs_ogb
def test_ogb_is_imported_without_its_pypi_version_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing ogb starts a thread asking PyPI for its latest version unless ``outdated`` is missing."""
    for module in [name for name in sys.modules if name == "ogb" or name.startswith(("ogb.", "outdated"))]:
        monkeypatch.delitem(sys.modules, module)  # a fresh import, restored after the test
    ladle.graph.datasets._ogb_layout("ogbn-arxiv")
    assert sys.modules["ogb.version"].check_outdated is None
    assert "outdated" not in sys.modules


# --- PyG: <root>/Flickr/raw/{adj_full.npz, feats.npy, class_map.json, role.json} ------------------------------


def test_flickr_layout_loads_then_comes_from_the_cache(tmp_path: Path, offline: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, edges = _graph(seed=3)
    split = _split()
    raw = tmp_path / "root" / "Flickr" / "raw"
    raw.mkdir(parents=True)
    both = np.array(sorted(_both_ways(edges))).T  # GraphSAINT's adj_full is symmetric
    adj = sp.csr_matrix((np.ones(both.shape[1]), (both[0], both[1])), shape=(NODES, NODES))
    np.savez(raw / "adj_full.npz", data=adj.data, indices=adj.indices, indptr=adj.indptr, shape=adj.shape)
    np.save(raw / "feats.npy", x)
    (raw / "class_map.json").write_text(json.dumps({str(node): int(label) for node, label in enumerate(y)}))
    (raw / "role.json").write_text(json.dumps({key: split[part].tolist()
                                               for key, part in (("tr", "train"), ("va", "valid"), ("te", "test"))}))
    for data in _load_twice("flickr", tmp_path / "root", offline, monkeypatch, "_read_with_pyg"):
        _check(data, x, y, _both_ways(edges), split)


# --- PyG: <root>/Reddit/raw/{reddit_data.npz (feature, label, node_types), reddit_graph.npz (scipy COO)} ---------


def test_reddit_layout_loads_then_comes_from_the_cache(tmp_path: Path, offline: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, edges = _graph(seed=5)
    split = _split()
    raw = tmp_path / "root" / "Reddit" / "raw"
    raw.mkdir(parents=True)
    node_types = np.zeros(NODES, dtype=np.int64)
    for code, part in ((1, "train"), (2, "valid"), (3, "test")):
        node_types[split[part]] = code
    np.savez(raw / "reddit_data.npz", feature=x, label=y, node_types=node_types)
    both = np.array(sorted(_both_ways(edges))).T
    sp.save_npz(raw / "reddit_graph.npz", sp.coo_matrix((np.ones(both.shape[1]), (both[0], both[1])),
                                                        shape=(NODES, NODES)))
    for data in _load_twice("reddit", tmp_path / "root", offline, monkeypatch, "_read_with_pyg"):
        _check(data, x, y, _both_ways(edges), split)


def _masks(splits: int, seed: int) -> np.ndarray:
    """``[splits, 3, NODES]`` boolean train / validation / test masks, each split another permutation."""
    out = np.zeros((splits, 3, NODES), dtype=bool)
    for split in range(splits):
        order = np.random.default_rng(seed + split).permutation(NODES)
        for part, index in enumerate((order[:6], order[6:9], order[9:])):
            out[split, part, index] = True
    return out


def _check_shipped(data, x: np.ndarray, y: np.ndarray, edges: set[tuple[int, int]], masks: np.ndarray) -> None:
    """As :func:`_check`, the masks being split ``masks``' (``[3, NODES]``)."""
    assert data.num_nodes == NODES and data.num_classes == CLASSES
    assert torch.allclose(data.x, torch.from_numpy(x), atol=1e-6) and torch.equal(data.y, torch.from_numpy(y).long())
    assert _edge_set(data.edge_index) == edges
    for mask, expected in zip(("train_mask", "val_mask", "test_mask"), masks):
        assert torch.equal(data[mask], torch.from_numpy(expected)), mask


# --- PyG's HeterophilousGraphDataset: <root>/roman_empire/raw/roman_empire.npz (its ten splits as [10, N] masks) -----


def test_heterophilous_layout_loads_with_its_shipped_splits(tmp_path: Path, offline: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, edges = _graph(seed=9)
    masks = _masks(2, seed=1)
    raw = tmp_path / "root" / "roman_empire" / "raw"
    raw.mkdir(parents=True)
    np.savez(raw / "roman_empire.npz", node_features=x, node_labels=y, edges=edges.T, train_masks=masks[:, 0],
             val_masks=masks[:, 1], test_masks=masks[:, 2])
    for data in _load_twice("roman-empire", tmp_path / "root", offline, monkeypatch, "_read_with_pyg"):
        _check_shipped(data, x, y, _both_ways(edges), masks[0])
    _check_shipped(load_dataset("roman-empire", tmp_path / "root", split=1), x, y, _both_ways(edges), masks[1])
    with pytest.raises(LadleError, match="ships 2 splits"):
        load_dataset("roman-empire", tmp_path / "root", split=2)


# --- PyG's WikipediaNetwork (geom-gcn): <root>/chameleon/geom_gcn/raw/{out1_*.txt, chameleon_split_0.6_0.2_*.npz} ---


def test_wikipedia_network_layout_loads_with_its_shipped_splits(tmp_path: Path, offline: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    x = (np.random.default_rng(2).random((NODES, FEATURES)) < 0.5).astype(np.float32)  # geom-gcn's: 0/1 words
    _, y, edges = _graph(seed=2)
    masks = _masks(10, seed=3)
    raw = tmp_path / "root" / "chameleon" / "geom_gcn" / "raw"
    raw.mkdir(parents=True)
    rows = "".join(f"{node}\t{','.join(str(int(v)) for v in x[node])}\t{y[node]}\n" for node in range(NODES))
    (raw / "out1_node_feature_label.txt").write_text("node_id\tfeature\tlabel\n" + rows)
    (raw / "out1_graph_edges.txt").write_text("node_id\tnode_id\n" + "".join(f"{a}\t{b}\n" for a, b in edges.T))
    for split in range(10):
        np.savez(raw / f"chameleon_split_0.6_0.2_{split}.npz", train_mask=masks[split, 0], val_mask=masks[split, 1],
                 test_mask=masks[split, 2])
    directed = {(int(a), int(b)) for a, b in edges.T}  # geom-gcn's edges as they are
    for data in _load_twice("chameleon", tmp_path / "root", offline, monkeypatch, "_read_with_pyg"):
        _check_shipped(data, x, y, directed, masks[0])
    _check_shipped(load_dataset("chameleon", tmp_path / "root", split=9), x, y, directed, masks[9])


# --- PyG's WikiCS: <root>/WikiCS/raw/data.json (20 train / validation splits, one test mask) ---------------------------


def test_wikics_layout_loads_its_splits_around_one_test_mask(tmp_path: Path, offline: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, edges = _graph(seed=4)
    masks = _masks(20, seed=5)
    masks[:, 2] = masks[0, 2]  # one test mask for every split
    masks[:, :2] &= ~masks[0, 2]
    raw = tmp_path / "root" / "WikiCS" / "raw"
    raw.mkdir(parents=True)
    links = [[int(b) for a, b in edges.T if a == node] for node in range(NODES)]
    (raw / "data.json").write_text(json.dumps({
        "features": x.tolist(), "labels": y.tolist(), "links": links, "train_masks": masks[:, 0].tolist(),
        "val_masks": masks[:, 1].tolist(), "stopping_masks": masks[:, 1].tolist(), "test_mask": masks[0, 2].tolist()}))
    for data in _load_twice("wikics", tmp_path / "root", offline, monkeypatch, "_read_with_pyg"):
        _check_shipped(data, x, y, _both_ways(edges), masks[0])
    _check_shipped(load_dataset("wikics", tmp_path / "root", split=19), x, y, _both_ways(edges), masks[19])


# --- PyG's LINKXDataset genius: <root>/genius/raw/data.mat (edge_index, node_feat, label); a random split -------------


def test_genius_layout_loads_with_a_seeded_random_split(tmp_path: Path, offline: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from scipy.io import savemat

    x, y, edges = _graph(seed=6)
    raw = tmp_path / "root" / "genius" / "raw"
    raw.mkdir(parents=True)
    savemat(raw / "data.mat", {"edge_index": edges, "node_feat": x, "label": y.reshape(1, -1)})
    first, cached = _load_twice("genius", tmp_path / "root", offline, monkeypatch, "_read_with_pyg")
    for data in (first, cached):
        assert torch.allclose(data.x, torch.from_numpy(x)) and torch.equal(data.y, torch.from_numpy(y))
        assert _edge_set(data.edge_index) == {(int(a), int(b)) for a, b in edges.T}
        parts = torch.stack([data.train_mask, data.val_mask, data.test_mask]).long()
        assert torch.equal(parts.sum(0), torch.ones(NODES, dtype=torch.long))  # every node in one split
        assert int(data.train_mask.sum()) == NODES // 2
    assert torch.equal(first.train_mask, cached.train_mask)
    assert not torch.equal(load_dataset("genius", tmp_path / "root", split=1).train_mask, first.train_mask)
