"""Ingredient views on real Cora: batch format, determinism, partitions, ClusterGCN, GraphSAINT, neighbours."""
from __future__ import annotations

import json
from itertools import islice

import pytest
import torch
from torch_geometric.data import Data

from ladle.core.recipe import (
    PARTITION_KINDS,
    SAINT_KINDS,
    VIEW_KINDS,
    BranchConfig,
    Recipe,
    ViewConfig,
)
from ladle.graph.inputs import drop_edges, graph_inputs
from ladle.graph.views import build_view
from ladle.train.task import RunSpec

torch.set_num_threads(1)

SAMPLED_KINDS = tuple(kind for kind in VIEW_KINDS if kind != "full" and kind not in PARTITION_KINDS)


def _edge_set(edge_index: torch.Tensor, n_id: torch.Tensor | None = None) -> set[tuple[int, int]]:
    """Edges as global ``(src, dst)`` pairs (mapping local ids through ``n_id`` when given)."""
    if n_id is not None:
        edge_index = n_id[edge_index]
    return set(map(tuple, edge_index.t().tolist()))


def _check_batch(batch: Data, data: Data) -> None:
    """The batch format every view promises."""
    n = batch.num_nodes
    assert batch.edge_index.dtype == torch.long and batch.edge_index.dim() == 2 and batch.edge_index.size(0) == 2
    if batch.edge_index.numel():
        assert int(batch.edge_index.min()) >= 0 and int(batch.edge_index.max()) < n
    assert batch.n_id.numel() == n == batch.n_id.unique().numel()
    assert torch.equal(batch.x, data.x[batch.n_id]) and torch.equal(batch.y, data.y[batch.n_id])
    assert batch.loss_mask.dtype == torch.bool and batch.loss_mask.numel() == n
    assert bool(data.train_mask[batch.n_id][batch.loss_mask].all())
    assert _edge_set(batch.edge_index, batch.n_id) <= _edge_set(data.edge_index)
    if batch.get("loss_weight") is not None:
        assert batch.loss_weight.shape == (n,)
    if batch.get("edge_weight") is not None:
        assert batch.edge_weight.shape == (batch.edge_index.size(1),)


def _same(a: Data, b: Data) -> bool:
    """Two batches hold identical tensors under identical keys."""
    return sorted(a.keys()) == sorted(b.keys()) and all(
        torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key] for key in a.keys())


@pytest.mark.parametrize("kind", VIEW_KINDS)
def test_batches_and_eval_graph_are_consistent(cora: Data, kind: str) -> None:
    view = build_view(cora, ViewConfig(kind=kind, parts=16, sample_coverage=5), k=1, num_ingredients=4, seed=0)
    batches = list(view.batches(0))
    assert len(batches) == view.steps_per_epoch() >= 1
    for batch in batches:
        _check_batch(batch, cora)
        if kind != "neighbor":  # loss counts on every train node in the batch
            assert torch.equal(batch.loss_mask, cora.train_mask[batch.n_id])
    graph = view.eval_graph()
    _check_batch(graph, cora)
    for key in ("train_mask", "val_mask", "test_mask"):
        assert torch.equal(graph[key], cora[key][graph.n_id])
    assert view.static == (kind not in SAMPLED_KINDS)
    if kind not in PARTITION_KINDS:
        assert graph.num_nodes == cora.num_nodes and graph.edge_index.size(1) == cora.num_edges
    summary = json.loads(json.dumps(view.describe()))
    assert summary["nodes"] == graph.num_nodes and summary["edges"] == graph.edge_index.size(1)
    assert summary["train_nodes"] == sum(summary["label_histogram"]) == int(graph.train_mask.sum())
    assert len(summary["label_histogram"]) == int(cora.y.max()) + 1


@pytest.mark.parametrize("kind", VIEW_KINDS)
def test_same_seed_same_batches_other_ingredient_other_batches(cora: Data, kind: str) -> None:
    config = ViewConfig(kind=kind, parts=16, sample_coverage=5, steps_per_epoch=2 if kind in SAMPLED_KINDS else 0)
    first, again, other = (build_view(cora, config, k=k, num_ingredients=4, seed=3) for k in (2, 2, 3))
    a, b, c = list(first.batches(5)), list(again.batches(5)), list(other.batches(5))
    assert len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if kind == "full":  # full-graph ingredients differ only by the model seed
        assert all(_same(x, y) for x, y in zip(a, c))
    else:
        assert not all(_same(x, y) for x, y in zip(a, c))
    if kind in SAMPLED_KINDS:
        assert not all(_same(x, y) for x, y in zip(a, first.batches(6)))


@pytest.mark.parametrize("kind", ["metis", "random"])
def test_partition_parts_cover_every_node_once(cora: Data, kind: str) -> None:
    views = [build_view(cora, ViewConfig(kind=kind), k=k, num_ingredients=4, seed=1) for k in range(4)]
    n_ids = torch.cat([view.eval_graph().n_id for view in views])
    assert torch.equal(n_ids.sort().values, torch.arange(cora.num_nodes))
    for view in views:  # each part is its full induced subgraph, cut edges dropped
        graph = view.eval_graph()
        inside = torch.zeros(cora.num_nodes, dtype=torch.bool)
        inside[graph.n_id] = True
        assert graph.edge_index.size(1) == int((inside[cora.edge_index[0]] & inside[cora.edge_index[1]]).sum())
        batches = list(view.batches(7))  # static: the same single (cached) batch every epoch
        assert len(batches) == 1 and batches[0] is graph
    summaries = [view.describe() for view in views]
    total = summaries[0]["total_cut_edges"]
    assert sum(s["cut_edges"] for s in summaries) == 2 * total  # each cut edge leaves one part, enters another
    assert sum(s["edges"] for s in summaries) + total == cora.num_edges


def test_metis_cuts_far_fewer_edges_than_random(cora: Data) -> None:
    cut = {kind: build_view(cora, ViewConfig(kind=kind), 0, 8, seed=0).describe()["total_cut_edges"]
           for kind in ("metis", "random")}
    assert cut["metis"] < 0.3 * cut["random"], cut


def test_random_partition_depends_on_seed(cora: Data) -> None:
    parts = [build_view(cora, ViewConfig(kind="random"), 0, 4, seed=s).eval_graph().n_id for s in (0, 0, 1)]
    assert torch.equal(parts[0], parts[1]) and not torch.equal(parts[0], parts[2])


def test_cluster_epoch_covers_every_node_once(cora: Data) -> None:
    view = build_view(cora, ViewConfig(kind="cluster", parts=16, parts_per_batch=3), 0, 2, seed=0)
    batches = list(view.batches(0))
    assert len(batches) == 6  # ceil(16 / 3)
    assert torch.equal(torch.cat([b.n_id for b in batches]).sort().values, torch.arange(cora.num_nodes))
    src, dst = cora.edge_index
    for batch in batches:  # edges between the merged parts are kept: the batch is an induced subgraph
        inside = torch.zeros(cora.num_nodes, dtype=torch.bool)
        inside[batch.n_id] = True
        assert batch.edge_index.size(1) == int((inside[src] & inside[dst]).sum())
    longer = ViewConfig(kind="cluster", parts=16, parts_per_batch=3, steps_per_epoch=10)
    assert len(list(build_view(cora, longer, 0, 2, seed=0).batches(0))) == 10


@pytest.mark.parametrize("kind", SAINT_KINDS)
def test_saint_normalisation_is_unbiased(cora: Data, kind: str) -> None:
    """Mean over batches of the weighted loss ~ the full-graph train mean; same for aggregated in-degree."""
    view = build_view(cora, ViewConfig(kind=kind, steps_per_epoch=100, sample_coverage=100), 0, 1, seed=0)
    degree = torch.bincount(cora.edge_index[1], minlength=cora.num_nodes).double()
    loss = degree  # a per-node "loss" that the samplers' preference for hubs would bias
    num_train = int(cora.train_mask.sum())
    weighted, unweighted, aggregated = [], [], []
    for batch in (b for epoch in range(2) for b in view.batches(epoch)):
        lw, ew = batch.loss_weight.double(), batch.edge_weight.double()
        assert bool(torch.isfinite(lw).all() and (lw > 0).all() and torch.isfinite(ew).all() and (ew > 0).all())
        weighted.append(float((loss[batch.n_id] * lw)[batch.loss_mask].sum()))
        if batch.loss_mask.any():
            unweighted.append(float(loss[batch.n_id][batch.loss_mask].mean()))
        # sum over v in batch of (1 / p_v) * sum of alpha-weighted in-edges estimates the edge count
        aggregated.append(float((ew * lw[batch.edge_index[1]]).sum() * num_train))
    target = float(loss[cora.train_mask].mean())
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert abs(mean(weighted) / target - 1) < 0.08
    assert abs(mean(unweighted) / target - 1) > 0.2  # without the weights the estimate is clearly biased
    assert abs(mean(aggregated) / cora.num_edges - 1) < 0.1


def test_saint_edge_draws_a_directed_graphs_edges_by_their_undirected_degrees() -> None:
    """Every edge ``u -> v`` of this graph has ``u > v`` and node 39 has no in-edge: each edge is one pair all the
    same, drawn with ``p ∝ 1/deg(u) + 1/deg(v)`` for the degrees of the graph taken as undirected (finite)."""
    n = 40
    src = torch.cat([torch.arange(1, n), torch.arange(2, n)])  # i + 1 -> i and i + 2 -> i
    dst = torch.cat([torch.arange(n - 1), torch.arange(n - 2)])
    data = Data(x=torch.randn(n, 4), y=torch.zeros(n, dtype=torch.long), edge_index=torch.stack([src, dst]),
                train_mask=torch.ones(n, dtype=torch.bool), val_mask=torch.zeros(n, dtype=torch.bool),
                test_mask=torch.zeros(n, dtype=torch.bool))
    view = build_view(data, ViewConfig(kind="saint-edge", batch_size=5, sample_coverage=1), 0, 1, seed=0)
    assert _edge_set(view.pairs) == {(int(v), int(u)) for u, v in zip(src, dst)}
    degree = torch.bincount(torch.cat([src, dst]), minlength=n).double()
    assert torch.equal(view.edge_prob, 1 / degree[view.pairs[0]] + 1 / degree[view.pairs[1]])
    drawn = torch.cat([batch.n_id for epoch in range(10) for batch in view.batches(epoch)]).unique()
    assert torch.equal(drawn, torch.arange(n))


def test_saint_batch_size_sets_the_subgraph_size(cora: Data) -> None:
    node = build_view(cora, ViewConfig(kind="saint-node", batch_size=100, sample_coverage=1), 0, 1, seed=0)
    edge = build_view(cora, ViewConfig(kind="saint-edge", batch_size=100, sample_coverage=1), 0, 1, seed=0)
    walk = build_view(cora, ViewConfig(kind="saint-rw", batch_size=100, walk_length=3, sample_coverage=1), 0, 1, seed=0)
    assert all(b.num_nodes <= 100 for b in node.batches(0))
    assert all(b.num_nodes <= 200 for b in edge.batches(0))
    assert all(b.num_nodes <= 400 for b in walk.batches(0))
    assert node.steps_per_epoch() == 28  # ceil(2708 / 100)


@pytest.mark.parametrize("share, max_nodes, roots, steps", [(0.25, 8000, 226, 4), (0.5, 8000, 452, 2),
                                                            (0.5, 900, 300, 4), (1.0, 8000, 903, 1)])
def test_saint_subgraphs_aim_at_their_share_of_the_graph_within_the_cap(cora: Data, share: float, max_nodes: int,
                                                                       roots: int, steps: int) -> None:
    """With ``batch_size`` 0, random-walk roots are the share of Cora's 2,708 nodes (at most ``max_nodes``) over
    the walk's 3 nodes, and an epoch covers the graph about once."""
    config = ViewConfig(kind="saint-rw", subgraph_share=share, subgraph_max_nodes=max_nodes, sample_coverage=1)
    walk = build_view(cora, config, 0, 1, seed=0)
    assert (walk.budget, walk.steps_per_epoch()) == (roots, steps)
    assert all(b.num_nodes <= 3 * roots for b in walk.batches(0))


def test_a_run_written_before_the_subgraph_keys_resumes_with_the_subgraphs_it_sampled() -> None:
    run = {"recipe": Recipe().to_dict(), "ingredients": 2, "init": "shared"}
    assert RunSpec.from_json(run).recipe == Recipe()  # today's run: its own keys
    for key in ("subgraph_share", "subgraph_max_nodes"):
        del run["recipe"]["view"][key]
    view = RunSpec.from_json(run).recipe.view
    assert (view.subgraph_share, view.subgraph_max_nodes) == (0.25, 8000) != (Recipe().view.subgraph_share, 16000)


@pytest.mark.parametrize("key, value", [("subgraph_share", 0.0), ("subgraph_share", 1.5),
                                        ("subgraph_max_nodes", 0)])
def test_a_subgraph_size_out_of_range_is_refused(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"view.{key} must be"):
        ViewConfig(kind="saint-rw", **{key: value})


def test_neighbor_sampling_respects_fanout(cora: Data) -> None:
    fanout = (3, 2)
    view = build_view(cora, ViewConfig(kind="neighbor", batch_size=32, fanout=fanout), 0, 1, seed=0)
    degree = torch.bincount(cora.edge_index[1], minlength=cora.num_nodes)
    batches = list(view.batches(0))
    seeds = torch.cat([b.n_id[b.loss_mask] for b in batches])
    assert torch.equal(seeds.sort().values, cora.train_mask.nonzero().view(-1))  # every train node once
    for batch in batches:
        num_seeds = batch.num_sampled_nodes[0]
        assert torch.equal(batch.loss_mask, torch.arange(batch.num_nodes) < num_seeds)
        assert sum(batch.num_sampled_nodes) == batch.num_nodes
        assert sum(batch.num_sampled_edges) == batch.edge_index.size(1)
        node_start = edge_start = 0
        for hop, f in enumerate(fanout):
            frontier = range(node_start, node_start + batch.num_sampled_nodes[hop])
            hop_edges = batch.edge_index[:, edge_start:edge_start + batch.num_sampled_edges[hop]]
            targets = hop_edges[1]
            assert all(int(t) in frontier for t in targets.unique())  # messages flow towards this hop
            in_edges = torch.bincount(targets, minlength=batch.num_nodes)[node_start:frontier.stop]
            expected = degree[batch.n_id[node_start:frontier.stop]].clamp(max=f)
            assert torch.equal(in_edges, expected)  # min(degree, fan-out), sampled without replacement
            assert hop_edges.t().unique(dim=0).size(0) == hop_edges.size(1)
            node_start, edge_start = frontier.stop, edge_start + hop_edges.size(1)


def test_neighbor_steps_per_epoch(cora: Data) -> None:
    view = build_view(cora, ViewConfig(kind="neighbor", batch_size=64, steps_per_epoch=5, fanout=(2,)), 0, 1, 0)
    batches = list(islice(view.batches(0), 10))
    assert len(batches) == 5 and all(int(b.loss_mask.sum()) <= 64 for b in batches)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"view\.kind must be one of full, metis.*got 'graphsaint'"):
        ViewConfig(kind="graphsaint")
    with pytest.raises(ValueError, match=r"^view\.parts must be >= 1, got 0$"):
        ViewConfig(parts=0)
    with pytest.raises(ValueError, match=r"view\.batch_size must be >= 0"):
        ViewConfig(batch_size=-1)
    with pytest.raises(ValueError, match=r"view\.fanout"):
        ViewConfig(fanout=(10, 0))
    assert ViewConfig(fanout=[5, 5]).fanout == (5, 5)  # type: ignore[arg-type]


def test_bad_input_is_a_clear_value_error(cora: Data) -> None:
    too_many = cora.num_nodes + 1
    for kind in ("metis", "random"):
        with pytest.raises(ValueError, match=rf"cannot split {cora.num_nodes} nodes into {too_many} parts"):
            build_view(cora, ViewConfig(kind=kind), 0, too_many, seed=0)
    with pytest.raises(ValueError, match=r"k=4 is out of range for 4 ingredients"):
        build_view(cora, ViewConfig(), 4, 4, seed=0)
    with pytest.raises(ValueError, match=r"view\.parts=5000 is more than the 2708 nodes"):
        build_view(cora, ViewConfig(kind="cluster", parts=5000), 0, 1, seed=0)
    with pytest.raises(ValueError, match=r"view\.parts_per_batch=8 must be <= view\.parts=4"):
        build_view(cora, ViewConfig(kind="cluster", parts=4, parts_per_batch=8), 0, 1, seed=0)
    no_train = cora.clone()
    no_train.train_mask = torch.zeros_like(cora.train_mask)
    with pytest.raises(ValueError, match="train split is empty"):
        build_view(no_train, ViewConfig(kind="neighbor"), 0, 1, seed=0)


def test_drop_edges_keeps_each_edge_at_its_rate_and_its_weights_with_it(cora_data: Data) -> None:
    graph = cora_data.clone()
    graph.edge_weight = torch.arange(graph.num_edges, dtype=torch.float)
    graph.degree = torch.full((graph.num_nodes,), 4.0)
    assert drop_edges(graph, 0.0) is graph
    torch.manual_seed(0)
    dropped = drop_edges(graph, 0.3)
    assert 0.67 < dropped.num_edges / graph.num_edges < 0.73 and graph.num_edges == cora_data.num_edges
    kept = {edge: i for i, edge in enumerate(map(tuple, graph.edge_index.t().tolist()))}
    assert [kept[edge] for edge in map(tuple, dropped.edge_index.t().tolist())] == dropped.edge_weight.long().tolist()
    assert torch.allclose(dropped.degree, torch.full((graph.num_nodes,), 2.8))


@pytest.mark.parametrize("kind", ["full", "saint-rw"])
def test_a_branch_without_any_edge_trains_as_on_a_graph_without_edges(cora_data: Data, kind: str) -> None:
    """DropEdge at a rate that drops every edge leaves a batch's adjacency the identity, and the next batch
    without DropEdge every edge again; on the whole graph a GCN epoch is then an epoch on the graph without edges
    (no dropout, so the edge draw is the only randomness; a sampled view's batches would differ there)."""
    from ladle.nn.models import build_model
    from ladle.train.loop import BatchInputs, train_epoch

    recipe = Recipe(dropout=0.0, view=ViewConfig(kind=kind, subgraph_share=0.5))
    edgeless = cora_data.clone()
    edgeless.edge_index = torch.empty(2, 0, dtype=torch.long)
    cases = [(cora_data, 1 - 1e-12)] + ([(edgeless, 0.0)] if kind == "full" else [])
    weights = []
    for data, drop_edge in cases:
        view = build_view(data, recipe.view, 0, 8, recipe.seed)
        torch.manual_seed(0)
        model = build_model(recipe, data.num_features, 7)
        inputs = BatchInputs(view, graph_inputs(data, "gcn"), "gcn", "cpu")
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        train_epoch(model, optimizer, view, 0, inputs, "test", drop_edge=drop_edge)
        weights.append(model.state_dict())
        if data is cora_data:
            batch = next(iter(view.batches(0)))
            eye = torch.eye(batch.num_nodes)
            assert torch.allclose(inputs(batch, drop_edge).adj.csr.to_dense(), eye)
            assert inputs(batch).adj.csr._nnz() == batch.num_nodes + batch.num_edges
    assert len(weights) == 1 or all(torch.allclose(weights[0][key], weights[1][key], atol=1e-6) for key in weights[0])


def test_each_ingredient_takes_its_drop_edge_rate() -> None:
    recipe = Recipe(branch=BranchConfig(drop_edge=(0.0, 0.25)))
    assert [recipe.ingredient_settings(k).drop_edge for k in range(4)] == [0.0, 0.25, 0.0, 0.25]
    assert Recipe().ingredient_settings(3).drop_edge == 0.0
    with pytest.raises(ValueError, match=r"branch.drop_edge values must be in \[0, 1\)"):
        BranchConfig(drop_edge=(1.0,))
