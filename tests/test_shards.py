"""Shards: exact round trips, the content-hash cache, memory that follows the shard, training from
shards (bitwise the old path), and layer-wise inference equal to a full forward."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TRUNKLESS

from ladle.core.errors import LadleError, run_cli
from ladle.core.recipe import load_recipe
from ladle.core.resources import release_mapped_pages
from ladle.core.storage import load_state
from ladle.graph import shards as shards_module
from ladle.graph.datasets import load_dataset
from ladle.graph.inputs import graph_inputs
from ladle.graph.partition import InEdges
from ladle.graph.shards import ShardSet, load_shard, prepare_shards, shard_key
from ladle.graph.sparse import SparseMatrix
from ladle.graph.views import batch_graph, build_view
from ladle.nn import layerwise
from ladle.nn.layerwise import LayerwiseInference
from ladle.nn.models import build_model
from ladle.nn.scoring import recompute_batch_norm
from ladle.prepare import main as prepare_main
from ladle.train.launch import train_ingredients
from ladle.train.loop import BatchInputs, train_task
from ladle.train.task import IngredientTask

METIS_2 = ["view.kind=metis", "epochs=100"]


@pytest.fixture(scope="module")
def cora_shards(data_root: Path) -> ShardSet:
    return prepare_shards(load_recipe(None, [*TRUNKLESS, *METIS_2]), 2, data_root)


def test_shards_round_trip_exactly(cora_shards: ShardSet, cora_data) -> None:
    graph = load_shard(cora_shards.graph()).data
    for key in ("x", "y", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(graph[key], cora_data[key]), key
    assert torch.equal(graph.n_id, torch.arange(cora_data.num_nodes))
    edges = sorted(map(tuple, graph.edge_index.t().tolist()))
    assert edges == sorted(map(tuple, cora_data.edge_index.t().tolist()))
    partition = cora_shards.partition()
    assert partition is not None
    recipe = load_recipe(None, [*TRUNKLESS, *METIS_2])
    seen = []
    for k in range(2):
        part = load_shard(cora_shards.part(k))
        expected = build_view(cora_data, recipe.view, k, 2, recipe.seed, partition).eval_graph()
        for key in ("x", "y", "edge_index", "n_id", "train_mask", "val_mask", "test_mask"):
            assert torch.equal(part.data[key], expected[key]), (k, key)
        assert part.data.num_classes == cora_data.num_classes
        seen.append(part.data.n_id)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(cora_data.num_nodes))
    for file in cora_shards.part(0).glob("*.npy"):  # plain arrays: no pickle needed, no object dtype
        assert np.load(file, allow_pickle=False).dtype != object
    assert json.loads((cora_shards.part(0) / "meta.json").read_text())["k"] == 0


def test_cache_is_reused_and_a_changed_recipe_invalidates_it(cora_shards: ShardSet, data_root: Path) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, *METIS_2])
    stamp = (cora_shards.path / "shards.json").stat().st_mtime_ns
    again = prepare_shards(recipe, 2, data_root)
    assert again.path == cora_shards.path and (again.path / "shards.json").stat().st_mtime_ns == stamp
    assert shard_key(recipe.replace(lr=0.1, epochs=3), 2) == shard_key(recipe, 2)  # training keys: same shards
    changed = [load_recipe(None, [*TRUNKLESS, "view.kind=random"]), recipe.replace(seed=1), recipe.replace(dataset="citeseer"),
               recipe.replace(features="raw"), load_recipe(None, [*TRUNKLESS, "view.kind=metis", "split=1"])]
    keys = {shard_key(r, 2) for r in changed} | {shard_key(recipe, 3)}
    assert shard_key(recipe, 2) not in keys and len(keys) == len(changed) + 1
    (cora_shards.part(1) / "meta.json").unlink()  # an incomplete set is rebuilt
    rebuilt = prepare_shards(recipe, 2, data_root)
    assert rebuilt.complete() and (rebuilt.path / "shards.json").stat().st_mtime_ns != stamp
    x = rebuilt.part(1) / "x.npy"
    x.write_bytes(x.read_bytes()[:1000])
    with pytest.raises(LadleError, match="corrupt or incomplete"):
        load_shard(rebuilt.part(1))
    prepare_shards(recipe, 2, data_root, force=True)
    assert load_shard(rebuilt.part(1)).data.num_nodes > 0


def test_prepare_command(data_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(prepare_main, ["view.kind=random", "-k", "3", "--data-root", str(data_root)]) == 0
    out = capsys.readouterr().out
    assert "part-02" in out and "shards:" in out
    assert run_cli(prepare_main, ["view.kind=metis", "-k", "3000", "--data-root", str(data_root)]) == 2
    assert "cannot split 2708 nodes" in capsys.readouterr().err


def test_prepare_writes_the_features_before_it_builds_the_csr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The features are on disk (and mapped back) by the time the in-edge CSR is built, so prepare never holds the
    two together; the shard's features are still the graph's."""
    on_disk: list[bool] = []

    def in_edges(edge_index: torch.Tensor, num_nodes: int) -> InEdges:
        on_disk.append(any(tmp_path.glob("shards/.*.tmp/graph/x.npy")))  # in the build's temporary folder
        return InEdges(edge_index, num_nodes)

    monkeypatch.setenv("LADLE_CACHE", str(tmp_path))
    monkeypatch.setattr(shards_module, "InEdges", in_edges)
    spec = "synthetic:nodes=3000,degree=6,features=16,classes=4"
    shards = prepare_shards(load_recipe(None, [*TRUNKLESS, f"dataset={spec}", "view.kind=metis"]), 4, force=True)
    assert on_disk == [True]
    assert torch.equal(load_shard(shards.graph()).data.x, load_dataset(spec).x)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc (Linux)")
def test_a_part_worker_holds_its_part_even_after_the_trunk(tmp_path: Path) -> None:
    """One worker trains the trunk on the whole graph, then the 8 part ingredients: each reports the memory of its
    part shard, not what the process held for the trunk."""
    spec = "synthetic:nodes=200000,degree=4,features=256,classes=4"  # 205 MB of features
    recipe = load_recipe(None, [f"dataset={spec}", "view.kind=random", "epochs=1", "trunk.epochs=1",
                                "trunk.view=full"])
    run = train_ingredients(recipe, ingredients=8, workers=1, run_dir=tmp_path / "run")
    assert not run.failed and run.trunk is not None and len(run.ingredients) == 8
    parts = [meta["peak_rss_mb"] for meta in run.ingredients]
    # measured: parts 436-455 MiB, trunk 859 (700-729, 0.83x, for the parts while the trunk's graph stayed loaded);
    # later 481-552 MiB against 872-919 (0.55-0.60x: the interpreter's share moves with the machine's load)
    assert max(parts) < 0.7 * run.trunk["peak_rss_mb"], (parts, run.trunk["peak_rss_mb"])


def test_train_ingredients_from_shards_matches_the_whole_graph_path(data_root: Path, cora_data,
                                                                     tmp_path: Path) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, *METIS_2])
    run = train_ingredients(recipe, ingredients=2, workers=2, run_dir=tmp_path / "run", data_root=data_root,
                            baseline=True)
    assert not run.failed and (tmp_path / "run" / "shards").is_symlink()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["shards"] == shard_key(recipe, 2)
    assert all(m["metrics_on"] == "part" and m["test_acc"] >= 0.6 for m in run.ingredients), run.summary_table()
    assert run.baseline is not None and run.baseline["metrics_on"] == "graph"
    inference = LayerwiseInference.from_data(cora_data, batch_entries=4000)
    model = build_model(recipe, cora_data.num_features, cora_data.num_classes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: same arithmetic, same bits
    try:
        for k in (1, None):
            task = IngredientTask(k, 2, tmp_path / "run", "shared")
            state = load_state(tmp_path / "run" / f"{task.name}.safetensors")
            model.load_state_dict(state)
            logits = inference.logits(model)[cora_data.test_mask]
            assert (logits.argmax(1) == cora_data.y[cora_data.test_mask]).float().mean() >= 0.45  # full graph
            reference = tmp_path / "reference"
            reference.mkdir(exist_ok=True)
            for name in ("init.safetensors", "partition.safetensors"):
                (reference / name).write_bytes((tmp_path / "run" / name).read_bytes())
            train_task(recipe, cora_data, IngredientTask(task.k, 2, reference, "shared"))
            expected = load_state(reference / f"{task.name}.safetensors")
            assert all(torch.equal(expected[key], state[key]) for key in state), task.name
    finally:
        torch.set_num_threads(threads)


def _resident_file_kib() -> int:
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("RssFile:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc")
def test_a_mapped_arrays_pages_are_handed_back_and_read_again_intact(tmp_path: Path) -> None:
    expected = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    np.save(tmp_path / "x.npy", expected.numpy())
    mapped = torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="c"))  # as load_shard maps a shard's arrays
    assert torch.equal(mapped, expected)  # every page read: resident
    before = _resident_file_kib()
    release_mapped_pages(mapped[1000:])
    assert _resident_file_kib() < before - 12 * 1024  # at least 12 of its 16 MiB handed back
    assert torch.equal(mapped, expected)  # and read again from the file, unchanged


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_a_shards_layerwise_inference_hands_its_pages_back_and_computes_the_same(data_root: Path, model: str) -> None:
    shard = load_shard(prepare_shards(load_recipe(None, [*TRUNKLESS, "dataset=synthetic:nodes=3000,degree=8,features=32,"
                                                         "classes=5"]), 2, data_root).graph())  # dense features
    torch.manual_seed(0)
    net = build_model(load_recipe(None, [*TRUNKLESS, f"model={model}"]), 32, 5).eval()
    mapped = LayerwiseInference.from_shard(shard, batch_entries=5000)  # several batches, each handing its rows back
    assert mapped.mapped and len(mapped.ranges) > 1
    first, again = mapped.logits(net), mapped.logits(net)
    assert torch.equal(first, again)
    assert torch.allclose(first, LayerwiseInference.from_data(shard.data, batch_entries=5000).logits(net), atol=1e-6)


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_layerwise_inference_equals_the_full_forward(cora_data, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layerwise, "ROW_CHUNK", 1000)  # the features' and hidden layers' rows in three chunks
    inference = LayerwiseInference.from_data(cora_data, batch_entries=2000)
    inputs = graph_inputs(cora_data, model)
    for norm in ("layer", "batch"):
        torch.manual_seed(0)
        net = build_model(load_recipe(None, [*TRUNKLESS, f"model={model}", f"norm={norm}", "layers=3"]),
                          cora_data.num_features, cora_data.num_classes)
        for module in net.norms:
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 2.0)
        net.eval()
        assert torch.allclose(inference.logits(net), net(inputs), atol=1e-5), norm
    recompute_batch_norm(net, inputs)  # one train-mode pass over all nodes; layer-wise is within rounding of it
    expected = net(inputs)
    assert torch.allclose(inference.logits(net, bn_nodes=torch.arange(cora_data.num_nodes)), expected, atol=1e-2)


def test_sampled_batches_read_bag_of_words_features_from_their_non_zeros(data_root: Path) -> None:
    shard = load_shard(prepare_shards(load_recipe(None, list(TRUNKLESS)), 2, data_root).graph())
    rows = shard.feature_rows()
    assert shard.meta["sparse_features"] and rows is not None  # Cora's bag of words
    nodes = torch.tensor([5, 0, 2707, 5, 1234])
    assert torch.equal(rows(nodes), shard.data.x[nodes])
    shard.data.feature_rows = rows
    batch = batch_graph(shard.data, nodes, torch.empty(2, 0, dtype=torch.long), torch.ones(5, dtype=torch.bool))
    assert torch.equal(batch.x, shard.data.x[nodes])
    sparse = rows.sparse(nodes)  # the same rows as a sparse matrix, from their non-zeros alone
    assert torch.equal(sparse.csr.to_dense(), shard.data.x[nodes]) and torch.equal(sparse.csr_t.to_dense(),
                                                                                  shard.data.x[nodes].T)


@pytest.mark.parametrize("parts_per_batch", [4, 32])  # Cora: 4 of 32 parts is a dense batch, all 32 a sparse one
def test_a_sampled_batch_takes_its_features_from_the_whole_graphs_sparse_rows(data_root: Path,
                                                                             parts_per_batch: int) -> None:
    """The batch inputs are those of a batch carrying its dense features (sparse or dense alike), and the view
    stops building dense features for its batches."""
    recipe = load_recipe(None, [*TRUNKLESS, "view.kind=cluster", f"view.parts_per_batch={parts_per_batch}"])
    shard = load_shard(prepare_shards(recipe, 2, data_root).graph())
    shard.data.feature_rows = shard.feature_rows()
    whole = shard.inputs("gcn")
    view = build_view(shard.data, recipe.view, 0, 2, recipe.seed)
    reference = [graph_inputs(batch, "gcn") for batch in view.batches(0)]
    inputs = BatchInputs(view, whole, "gcn", "cpu")
    assert isinstance(whole.x, SparseMatrix) and not view.batch_features
    batches = list(view.batches(0))
    assert all(batch.x is None for batch in batches)
    for batch, expected in zip(batches, reference, strict=True):
        got = inputs(batch)
        assert type(got.x) is type(expected.x) is (SparseMatrix if parts_per_batch == 32 else torch.Tensor)
        dense = (lambda x: x.csr.to_dense() if isinstance(x, SparseMatrix) else x)
        assert torch.equal(dense(got.x), dense(expected.x)) and torch.equal(got.adj.csr.to_dense(),
                                                                            expected.adj.csr.to_dense())
