"""``view.sampler=pyg``: PyG's loaders draw batches like ladle's samplers and train as well, on real Cora.

The cluster view needs no compiled extra (PyG's ClusterLoader runs over ladle's pymetis partition), so
its tests run everywhere; the GraphSAINT and neighbour tests need torch-sparse and say so when they skip.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
import torch_geometric.typing
from conftest import run_module
from torch_geometric.data import Data

from ladle.core.errors import LadleError
from ladle.core.recipe import SAINT_KINDS, ViewConfig, load_recipe
from ladle.graph.pyg_views import PyGView, with_sampler
from ladle.graph.views import FullView, build_view
from ladle.train.launch import train_ingredients

torch.set_num_threads(1)

HAS_SPARSE = torch_geometric.typing.WITH_TORCH_SPARSE
needs_sparse = pytest.mark.skipif(
    not HAS_SPARSE, reason="torch-sparse is not installed: PyG's GraphSAINT samplers and NeighborLoader "
    "cannot run here (pip install --no-build-isolation 'ladle[sparse]')")
PYG_KINDS = ("cluster", *SAINT_KINDS, "neighbor")
RUNNABLE_KINDS = [pytest.param(kind, marks=() if kind == "cluster" else needs_sparse) for kind in PYG_KINDS]


def views(data: Data, kind: str, **settings) -> tuple:
    """The ladle and the PyG view of ingredient 0 of 2, same settings and seed."""
    return tuple(with_sampler(build_view(data, ViewConfig(kind=kind, sampler=backend, **settings), 0, 2, seed=0))
                 for backend in ("ladle", "pyg"))


def batch_stats(view, epochs: int) -> dict[str, float]:
    """Mean nodes, edges and loss nodes per batch, and mean batches per epoch, over ``epochs`` epochs."""
    batches = [batch for epoch in range(epochs) for batch in view.batches(epoch)]
    return {"nodes": statistics.mean(b.num_nodes for b in batches),
            "edges": statistics.mean(b.edge_index.size(1) for b in batches),
            "loss_nodes": statistics.mean(int(b.loss_mask.sum()) for b in batches),
            "batches": len(batches) / epochs}


def close(a: float, b: float, tolerance: float) -> bool:
    return abs(a / b - 1) <= tolerance


def test_sampler_key_is_validated_and_read_from_recipes() -> None:
    with pytest.raises(ValueError, match=r"^view\.sampler must be one of ladle, pyg; got 'dgl'$"):
        ViewConfig(sampler="dgl")
    assert load_recipe("cora-gcn", ["view.sampler=pyg"]).view.sampler == "pyg"
    assert load_recipe("cora-gcn").view.sampler == "ladle"


def test_views_without_a_pyg_loader_are_the_same_under_both_backends(cora: Data) -> None:
    ladle, pyg = views(cora, "full")
    assert type(ladle) is type(pyg) is FullView


@pytest.mark.parametrize("kind", RUNNABLE_KINDS)
def test_pyg_batches_are_in_ladle_format_deterministic_and_leave_the_global_rng_alone(cora: Data, kind: str) -> None:
    _, view = views(cora, kind)
    assert isinstance(view, PyGView) and view.describe()["sampler"] == "pyg"
    before = torch.get_rng_state()
    first = list(view.batches(3))
    assert torch.equal(torch.get_rng_state(), before)
    again, other = list(view.batches(3)), list(view.batches(4))
    assert len(first) == view.steps_per_epoch()
    assert all(torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index) for a, b in zip(first, again))
    assert any(not torch.equal(a.n_id, b.n_id) for a, b in zip(first, other))
    edges = set(map(tuple, cora.edge_index.t().tolist()))
    for batch in first:
        assert torch.equal(batch.x, cora.x[batch.n_id]) and torch.equal(batch.y, cora.y[batch.n_id])
        assert batch.n_id.unique().numel() == batch.num_nodes
        assert bool(cora.train_mask[batch.n_id][batch.loss_mask].all())
        assert set(map(tuple, batch.n_id[batch.edge_index].t().tolist())) <= edges
        if kind in SAINT_KINDS:
            assert batch.loss_weight.shape == (batch.num_nodes,)
            assert batch.edge_weight.shape == (batch.edge_index.size(1),)


def test_pyg_cluster_batches_are_whole_parts_with_every_edge_between_them(cora: Data) -> None:
    ladle, pyg = views(cora, "cluster", parts=16, parts_per_batch=3)
    assert torch.equal(pyg.parts, ladle.parts)  # ladle's pymetis partition, not PyG's METIS call
    batches = list(pyg.batches(0))
    assert len(batches) == 6  # ceil(16 / 3)
    assert torch.equal(torch.cat([b.n_id for b in batches]).sort().values, torch.arange(cora.num_nodes))
    sizes = torch.bincount(pyg.parts)
    for batch in batches:
        parts = pyg.parts[batch.n_id].unique()
        assert parts.numel() <= 3 and int(sizes[parts].sum()) == batch.num_nodes  # whole parts only
        induced, _ = ladle.adj.induced(batch.n_id.sort().values)
        expected = set(map(tuple, batch.n_id.sort().values[induced].t().tolist()))
        assert set(map(tuple, batch.n_id[batch.edge_index].t().tolist())) == expected


def test_pyg_cluster_draws_like_ladle(cora: Data) -> None:
    ladle, pyg = (batch_stats(view, epochs=10) for view in views(cora, "cluster", parts=32, parts_per_batch=4))
    assert ladle["batches"] == pyg["batches"] == 8
    assert ladle["nodes"] == pyg["nodes"] == cora.num_nodes / 8  # every node once per epoch
    assert close(pyg["edges"], ladle["edges"], 0.05), (ladle, pyg)


@needs_sparse
@pytest.mark.parametrize("kind", ["saint-node", "saint-rw"])
def test_pyg_saint_draws_like_ladle(cora: Data, kind: str) -> None:
    ladle, pyg = (batch_stats(view, epochs=5) for view in views(cora, kind, sample_coverage=5))
    assert ladle["batches"] == pyg["batches"]
    assert close(pyg["nodes"], ladle["nodes"], 0.05), (ladle, pyg)
    assert close(pyg["edges"], ladle["edges"], 0.10), (ladle, pyg)


@needs_sparse
@pytest.mark.xfail(strict=True, reason="by design: PyG's GraphSAINTEdgeSampler draws directed edges with "
                   "replacement, weighted deg(u) + deg(v) (it inverts 1/deg twice), where ladle draws undirected "
                   "edges without replacement, weighted 1/deg(u) + 1/deg(v); measured on Cora: 416 vs 598 "
                   "nodes a batch (0.70x) for the same edge budget")
def test_pyg_saint_edge_draws_like_ladle(cora: Data) -> None:
    ladle, pyg = (batch_stats(view, epochs=5) for view in views(cora, "saint-edge", sample_coverage=5))
    assert close(pyg["nodes"], ladle["nodes"], 0.05), (ladle, pyg)


@pytest.fixture(scope="module", params=SAINT_KINDS)
def saint_estimates(request: pytest.FixtureRequest, cora: Data) -> dict[str, dict[str, float]]:
    """Per backend, over 200 batches, two GraphSAINT estimates divided by their exact values.

    ``loss``: the weighted loss of a per-node 'loss' (the degree, which hub-preferring samplers would
    bias) against its train mean; ``aggregation``: the ``edge_weight``-weighted in-edges of the batch
    nodes, scaled by their loss weights, against the number of edges.
    """
    degree = torch.bincount(cora.edge_index[1], minlength=cora.num_nodes).double()
    num_train = int(cora.train_mask.sum())
    estimates = {}
    for view in views(cora, request.param, steps_per_epoch=100, sample_coverage=100):
        batches = [b for epoch in range(2) for b in view.batches(epoch)]
        loss = [float((degree[b.n_id] * b.loss_weight.double())[b.loss_mask].sum()) for b in batches]
        aggregated = [float((b.edge_weight.double() * b.loss_weight.double()[b.edge_index[1]]).sum()) * num_train
                      for b in batches]
        estimates["pyg" if isinstance(view, PyGView) else "ladle"] = {
            "loss": statistics.mean(loss) / float(degree[cora.train_mask].mean()),
            "aggregation": statistics.mean(aggregated) / cora.num_edges}
    return estimates


@needs_sparse
def test_pyg_saint_loss_normalisation_is_unbiased_like_ladle(saint_estimates: dict) -> None:
    assert all(close(e["loss"], 1.0, 0.08) for e in saint_estimates.values()), saint_estimates


@needs_sparse
@pytest.mark.xfail(strict=True, reason="by design: PyG's edge_norm is C_u / C_uv, the count of the source u "
                   "(ladle and the paper divide by the aggregating node v's), and pairs never pre-sampled "
                   "get 1e4; measured on Cora, its aggregation estimate is 2.5x (node), 1.4x (rw) and 68x "
                   "(edge sampler) the edge count, ladle's within 7%; trained 30 epochs, PyG's saint-node and "
                   "saint-edge Cora ingredients reached 73.8% and 66.4% test accuracy, ladle's 80.8% and 82.1%")
def test_pyg_saint_edge_normalisation_is_unbiased_like_ladle(saint_estimates: dict) -> None:
    assert close(saint_estimates["ladle"]["aggregation"], 1.0, 0.1), saint_estimates
    assert close(saint_estimates["pyg"]["aggregation"], 1.0, 0.1), saint_estimates


@needs_sparse
def test_pyg_saint_loss_weights_match_ladle_node_by_node(cora: Data) -> None:
    """Both estimate 1 / (p_v |V_train|) from pre-sampling counts: the per-node weights agree."""
    ladle, pyg = views(cora, "saint-rw", sample_coverage=200)
    ratio = (pyg.loss_weight / ladle.loss_weight).double()
    assert close(float(ratio.median()), 1.0, 0.05)
    assert float(((ratio - 1).abs() < 0.25).double().mean()) > 0.9


@needs_sparse
def test_pyg_neighbor_draws_like_ladle(cora: Data) -> None:
    ladle, pyg = (batch_stats(view, epochs=5) for view in views(cora, "neighbor", batch_size=32, fanout=(5, 3)))
    assert ladle["batches"] == pyg["batches"] == 5  # 140 train nodes, 32 a batch
    assert ladle["loss_nodes"] == pyg["loss_nodes"] == 28
    assert close(pyg["nodes"], ladle["nodes"], 0.05), (ladle, pyg)
    assert close(pyg["edges"], ladle["edges"], 0.05), (ladle, pyg)
    _, view = views(cora, "neighbor", batch_size=32, fanout=(5, 3))
    seeds = torch.cat([b.n_id[b.loss_mask] for b in view.batches(0)])
    assert torch.equal(seeds.sort().values, cora.train_mask.nonzero().view(-1))  # every train node once


@pytest.mark.parametrize("kind", ["saint-rw", "neighbor"])
def test_missing_package_is_one_actionable_error(cora: Data, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_geometric.typing, "WITH_TORCH_SPARSE", False)
    monkeypatch.setattr(torch_geometric.typing, "WITH_PYG_LIB", False)
    with pytest.raises(LadleError, match=rf"view\.sampler=pyg with view\.kind={kind} needs torch-sparse"):
        with_sampler(build_view(cora, ViewConfig(kind=kind, sampler="pyg"), 0, 1, seed=0))
    assert isinstance(with_sampler(build_view(cora, ViewConfig(kind="cluster", sampler="pyg"), 0, 1, seed=0)), PyGView)


@pytest.mark.skipif(HAS_SPARSE, reason="checks the message of a machine without torch-sparse")
def test_train_without_torch_sparse_says_what_to_install(data_root: Path, tmp_path: Path) -> None:
    result = run_module("ladle.train", "--recipe", "cora-gcn", "view.kind=saint-rw", "view.sampler=pyg",
                        "--data-root", str(data_root), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert "view.kind=saint-rw needs torch-sparse: pip install" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize("kind", [pytest.param("cluster"), pytest.param("saint-rw", marks=needs_sparse),
                                  pytest.param("neighbor", marks=needs_sparse)])
def test_both_backends_train_cora_to_comparable_accuracy(data_root: Path, tmp_path: Path, kind: str) -> None:
    accuracy = {}
    for backend in ("ladle", "pyg"):
        recipe = load_recipe("cora-gcn", [f"view.kind={kind}", f"view.sampler={backend}", "epochs=30"])
        run = train_ingredients(recipe, ingredients=2, workers=1, run_dir=tmp_path / backend, data_root=data_root)
        accuracy[backend] = statistics.mean(meta["test_acc"] for meta in run.ingredients)
        assert len(run.ingredients) == 2 and not run.failed
    assert min(accuracy.values()) > 0.74, accuracy
    assert abs(accuracy["ladle"] - accuracy["pyg"]) < 0.03, accuracy
