"""Variable-rate partition-parallel training: exactness against full-graph training, byte accounting,
compression operators, schedules, a dying rank, and launches by ``torchrun`` and the CLI.

Ranks are real processes on gloo (spawned with torch.multiprocessing, one thread each).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
import torch.nn.functional as F
from conftest import PROJECT, TRUNKLESS, run_in_process
from torch import Tensor
from torch.multiprocessing import start_processes
from torch_geometric.data import Data

from ladle.core.collectives import (
    ring_allreduce_bytes,
    ring_broadcast_bytes,
    ring_chunks,
)
from ladle.core.errors import LadleError
from ladle.core.recipe import load_recipe
from ladle.graph.datasets import load_dataset
from ladle.graph.inputs import graph_inputs
from ladle.nn.models import build_model
from ladle.varrate import (
    COMPRESSORS,
    HaloExchange,
    Int8,
    RandomMask,
    RankData,
    RateController,
    RateSchedule,
    Traffic,
    Truncate,
    allreduce_gradients,
    build_plan,
    exchange_key,
    free_port,
    init_group,
    kept_columns,
    partition_forward,
    partition_loss,
    partition_nodes,
)
from ladle.varrate import main as varrate_main

torch.set_num_threads(1)


# ---------------------------------------------------------------- compression operators and schedules


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_rate_one_is_lossless(name: str) -> None:
    rows = torch.randn(10, 16)
    compressor = COMPRESSORS[name]()
    payload = compressor.encode(rows, 1.0, key=7)
    assert payload.shape == (10, compressor.payload_columns(16, 1.0))
    assert torch.equal(compressor.decode(payload, 16, 1.0, key=7), rows)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("rate", [2.0, 4.0, 16.0, 64.0])
def test_round_trip_shapes(name: str, rate: float) -> None:
    rows = torch.randn(10, 16)
    compressor = COMPRESSORS[name]()
    payload = compressor.encode(rows, rate, key=3)
    assert payload.shape == (10, compressor.payload_columns(16, rate))
    assert compressor.decode(payload, 16, rate, key=3).shape == (10, 16)
    assert compressor.decode(payload[:0], 16, rate, key=3).shape == (0, 16)


def test_truncation_keeps_the_first_columns() -> None:
    rows = torch.randn(5, 16)
    decoded = Truncate().decode(Truncate().encode(rows, 4.0, 0), 16, 4.0, 0)
    assert torch.equal(decoded[:, :4], rows[:, :4]) and not decoded[:, 4:].any()
    assert kept_columns(16, 64.0) == 1 and kept_columns(3, 4.0) == 1 and kept_columns(64, 1.5) == 42


def test_random_mask_shares_columns_through_the_key_and_is_unbiased() -> None:
    rows = torch.randn(5, 16)
    mask = RandomMask()
    columns = RandomMask.columns(16, 4.0, key=11)
    assert torch.equal(columns, RandomMask.columns(16, 4.0, key=11)) and columns.numel() == 4
    assert not torch.equal(columns, RandomMask.columns(16, 4.0, key=12))
    decoded = mask.decode(mask.encode(rows, 4.0, 11), 16, 4.0, 11)
    assert torch.allclose(decoded[:, columns], 4 * rows[:, columns])
    assert decoded.count_nonzero() == 5 * 4
    mean = torch.stack([mask.decode(mask.encode(rows, 4.0, k), 16, 4.0, k) for k in range(4000)]).mean(0)
    assert torch.allclose(mean, rows, atol=0.25)


def test_int8_quantises_each_row_within_half_a_step() -> None:
    rows = torch.randn(6, 16) * torch.arange(1, 7).view(-1, 1)
    payload = Int8().encode(rows, 4.0, 0)
    assert payload.dtype == torch.uint8 and payload.shape == (6, 16 + 4)
    decoded = Int8().decode(payload, 16, 4.0, 0)
    step = rows.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((decoded - rows).abs() <= step / 2 + 1e-6).all())
    assert Int8().encode(rows, 16.0, 0).shape == (6, 4 + 4)  # int(4 * 16 / 16) columns + the scale


def test_schedules() -> None:
    assert RateSchedule("full").rate(0, 10) == 1.0 and RateSchedule("none").rate(3, 10) is None
    assert RateSchedule("fixed", rate_max=16).rate(9, 10) == 16.0
    linear = RateSchedule("linear", rate_max=64, rate_min=1, fraction=0.5)
    assert [linear.rate(e, 10) for e in (0, 5, 9)] == [64.0, 1.0, 1.0]
    assert linear.rate(1, 10) == pytest.approx(64 - 63 / 4.5)  # rate_min at epoch 0.5 * (10 - 1)
    step = RateSchedule("step", rate_max=64, rate_min=1)
    assert [step.rate(e, 8) for e in range(8)] == pytest.approx([64, 64, 16, 16, 4, 4, 1, 1])
    assert RateSchedule("step", steps=(8, 2)).rate(7, 8) == 2.0
    with pytest.raises(Exception, match="rate-min"):
        RateSchedule("linear", rate_max=2, rate_min=4)


def test_an_exact_tail_ends_any_schedule_at_ratio_one() -> None:
    """``tail``: the last epochs exchange exactly; before them the schedule runs as it would (linear still heads
    for --rate-min at the last epoch); ``none`` with a tail ends at 1."""
    none = RateSchedule("none", tail=3)
    assert [none.rate(e, 10) for e in range(10)] == [None] * 7 + [1.0] * 3 and none.final() == 1.0
    linear = RateSchedule("linear", rate_max=64, rate_min=1, tail=2)
    assert [linear.rate(e, 10) for e in (0, 7, 8, 9)] == pytest.approx([64, 64 - 63 * 7 / 9, 1, 1])
    assert RateSchedule("fixed", rate_max=16, tail=1).rate(8, 10) == 16.0
    control = RateController(RateSchedule("adaptive", rate_max=8, patience=100, tail=2), epochs=5)
    assert [control.rate(e) for e in range(5)] == [8.0, 8.0, 8.0, 1.0, 1.0] and control.settled == 3
    with pytest.raises(LadleError, match="--exact-tail must be >= 0"):
        RateSchedule("none", tail=-1)


@pytest.mark.parametrize("epochs", [1, 2, 10, 200])
@pytest.mark.parametrize("kind, first, last", [("full", 1.0, 1.0), ("fixed", 64.0, 64.0), ("linear", 64.0, 1.0),
                                               ("step", 64.0, 1.0), ("none", None, None)])
def test_every_schedule_ends_where_it_says(kind: str, first: float | None, last: float | None, epochs: int) -> None:
    """With the default ``--rate-fraction 1`` linear and step reach ``--rate-min`` by the last epoch (linear
    exactly there), and every schedule starts at its first ratio (a one-epoch run is its last epoch too)."""
    schedule = RateSchedule(kind, rate_max=64, rate_min=1)
    assert schedule.rate(epochs - 1, epochs) == last
    if epochs > 1:
        assert schedule.rate(0, epochs) == first
    if kind == "linear" and epochs > 2:
        assert schedule.rate(epochs - 2, epochs) > 1.0  # reached at the last epoch, not before


# ---------------------------------------------------------------- the halo plan


def _tiny_graph() -> tuple[Data, Tensor]:
    """Six nodes, parts {0, 1, 2} and {3, 4, 5}; node 2 feeds 3 and 4, so part 1 needs one row (2) and
    part 0 needs two (3, 4)."""
    pairs = torch.tensor([[0, 1], [1, 2], [2, 3], [2, 4], [3, 4], [4, 5]]).t()
    edge_index = torch.cat([pairs, pairs.flip(0)], dim=1)
    generator = torch.Generator().manual_seed(0)
    data = Data(x=torch.randn(6, 4, generator=generator), y=torch.tensor([0, 1, 2, 0, 1, 2]),
                edge_index=edge_index, num_nodes=6)
    data.train_mask = torch.tensor([True, False, True, True, False, True])
    data.val_mask = ~data.train_mask
    data.test_mask = ~data.train_mask
    data.num_classes = 3
    return data, torch.tensor([0, 0, 0, 1, 1, 1])


def test_plans_of_all_ranks_agree(cora_data: Data) -> None:
    parts = partition_nodes(cora_data, "random", 3, seed=0)
    plans = [build_plan(cora_data.edge_index, cora_data.num_nodes, parts, r, 3, "gcn") for r in range(3)]
    for r, plan in enumerate(plans):
        assert torch.equal(parts[plan.owned], torch.full_like(plan.owned, r))
        assert plan.send_counts[r] == plan.recv_counts[r] == 0
        for p, peer in enumerate(plans):
            # what r sends p, in order, is what p receives from r
            sent = plan.owned[plan.send_index][sum(plan.send_counts[:p]):sum(plan.send_counts[:p + 1])]
            received = peer.halo[sum(peer.recv_counts[:r]):sum(peer.recv_counts[:r + 1])]
            assert torch.equal(sent, received)
        assert plan.adj.shape == (plan.owned.numel(), plan.owned.numel() + plan.halo.numel())
    data, tiny_parts = _tiny_graph()
    zero, one = (build_plan(data.edge_index, 6, tiny_parts, r, 2, "gcn") for r in range(2))
    assert zero.halo.tolist() == [3, 4] and one.halo.tolist() == [2]
    assert zero.owned[zero.send_index].tolist() == [2] and one.owned[one.send_index].tolist() == [3, 4]


# ---------------------------------------------------------------- ranks on gloo


def _spawn(worker, world: int, *args) -> None:
    start_processes(worker, args=(world, free_port(), *args), nprocs=world, start_method="spawn")


def _worker(rank: int, world: int, port: int, data_root: str, out: Path, models: list[str], count_bytes: bool) -> None:
    """A rank of the checks below: exactness on Cora for ``models``, then (optionally) the byte counts."""
    torch.set_num_threads(1)
    init_group(torch.device("cpu"), 60, f"tcp://127.0.0.1:{port}", rank, world)
    try:
        _exact_step(rank, world, data_root, out, models)
        if count_bytes:
            _count_bytes(rank, world, out)
    finally:
        dist.destroy_process_group()


def _exact_step(rank: int, world: int, data_root: str, out: Path, models: list[str]) -> None:
    """One full-graph (rate 1) step of each model on Cora, exchanging the first layer's projection and with the
    halo's (sparse) input features fetched once: save the owned logits and all-reduced gradients."""
    data = load_dataset("cora", data_root)
    parts = partition_nodes(data, "metis", world, seed=0)
    for kind in models:
        shard = RankData.build(data, parts, rank, world, kind)
        shard.fetch_inputs(data.x[shard.plan.owned])
        for inputs, label in ((None, kind), (shard.inputs, f"{kind}-cached")):
            torch.manual_seed(0)
            model = build_model(load_recipe(None, [*TRUNKLESS, f"model={kind}", "dropout=0.0"]), data.num_features,
                                data.num_classes)
            traffic = Traffic()
            exchange = HaloExchange(shard.plan, Truncate(), 1.0, 0, 0, traffic)
            logits = partition_forward(model, shard.x, shard.plan, exchange, inputs)
            partition_loss(logits, shard).backward()
            halo = traffic.forward_halo
            allreduce_gradients(model, traffic)
            torch.save({"owned": shard.plan.owned, "logits": logits.detach(), "allreduce": traffic.allreduce,
                        "forward_halo": halo, "sent": shard.plan.send_index.numel(),
                        "grads": {name: p.grad for name, p in model.named_parameters()}}, out / f"{label}-{rank}.pt")


def _count_bytes(rank: int, world: int, out: Path) -> None:
    """Per-rank bytes of one step on the tiny graph for several compressors and rates; and the custom
    backward of a compressed exchange against autograd through torch's differentiable all_to_all."""
    data, parts = _tiny_graph()
    shard = RankData.build(data, parts, rank, world, "gcn")
    recipe = load_recipe(None, [*TRUNKLESS, "hidden=8", "dropout=0.0"])
    counts: dict[str, list[int]] = {}
    for label, compressor, rate in [("rate1", Truncate(), 1.0), ("truncate4", Truncate(), 4.0),
                                    ("mask4", RandomMask(), 4.0), ("int8-4", Int8(), 4.0),
                                    ("int8-16", Int8(), 16.0), ("none", None, None)]:
        torch.manual_seed(0)
        model = build_model(recipe, 4, 3)
        traffic = Traffic()
        exchange = None if compressor is None else HaloExchange(shard.plan, compressor, rate, 0, 0, traffic)
        partition_loss(partition_forward(model, shard.x, shard.plan, exchange), shard).backward()
        allreduce_gradients(model, traffic)
        if compressor is not None:
            model.eval()
            with torch.no_grad():
                partition_forward(model, shard.x, shard.plan,
                                  HaloExchange(shard.plan, compressor, 1.0, 0, 0, traffic, evaluating=True))
        counts[label] = traffic.values()
    shard.fetch_inputs(data.x[shard.plan.owned])  # dense rows: 4 float32 columns each
    torch.manual_seed(0)
    model = build_model(recipe, 4, 3)
    traffic = Traffic()
    cached = partition_forward(model, shard.x, shard.plan, HaloExchange(shard.plan, Truncate(), 1.0, 0, 0, traffic),
                               shard.inputs)
    torch.manual_seed(0)
    exchanged = partition_forward(build_model(recipe, 4, 3), shard.x, shard.plan,
                                  HaloExchange(shard.plan, Truncate(), 1.0, 0, 0, Traffic()))
    bf16 = {}
    for dtype in (torch.float32, torch.bfloat16):  # one gradient all-reduce each way
        torch.manual_seed(0)
        model = build_model(recipe, 4, 3)
        partition_loss(partition_forward(model, shard.x, shard.plan, None), shard).backward()
        reduced = Traffic()
        allreduce_gradients(model, reduced, dtype)
        bf16[str(dtype)] = (reduced.allreduce, [p.grad for p in model.parameters()])
    inputs = {"bytes": shard.input_bytes, "forward": traffic.forward_halo, "halo": shard.inputs[shard.plan.owned.numel():],
              "equal": torch.allclose(cached, exchanged, atol=1e-6)}

    plan = shard.plan
    gradients = {}
    for compressor in (Truncate(), RandomMask()):
        rows = torch.randn(plan.owned.numel(), 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        weight = torch.randn(plan.halo.numel(), 8, generator=torch.Generator().manual_seed(10 + rank))
        halo = HaloExchange(plan, compressor, 4.0, 0, 0, Traffic())(rows, 1)
        (halo * weight).sum().backward()
        ours = rows.grad.clone()
        rows.grad = None
        key = exchange_key(0, 0, 1)
        payload = compressor.encode(rows[plan.send_index], 4.0, key).contiguous()
        with warnings.catch_warnings():  # deprecated in favour of a private module; still exact
            warnings.simplefilter("ignore", FutureWarning)
            received = dist_autograd.all_to_all_single(payload.new_empty(sum(plan.recv_counts), payload.size(1)),
                                                       payload, plan.recv_counts, plan.send_counts)
        (compressor.decode(received, 8, 4.0, key) * weight).sum().backward()
        gradients[compressor.name] = (ours, rows.grad.clone())
    torch.save({"counts": counts, "gradients": gradients, "inputs": inputs, "bf16": bf16}, out / f"bytes-{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank session for the exactness (gcn, sage) and byte checks: spawning ranks is the slow part."""
    out = tmp_path_factory.mktemp("two-ranks")
    _spawn(_worker, 2, str(data_root), out, ["gcn", "sage"], True)
    return out


def _reference(data: Data, kind: str) -> tuple[Tensor, dict[str, Tensor]]:
    torch.manual_seed(0)
    model = build_model(load_recipe(None, [*TRUNKLESS, f"model={kind}", "dropout=0.0"]), data.num_features, data.num_classes)
    logits = model(graph_inputs(data, kind))
    F.cross_entropy(logits[data.train_mask], data.y[data.train_mask]).backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def _assert_exact(out: Path, data: Data, world: int, models: list[str]) -> None:
    """Each model's partitioned step, both ways, equals full-graph training; the cached way exchanges only the
    second layer's rows (classes floats a boundary row)."""
    hidden = load_recipe(None, list(TRUNKLESS)).hidden
    for run in models + [f"{kind}-cached" for kind in models]:
        kind = run.removesuffix("-cached")
        logits, grads = _reference(data, kind)
        covered = torch.zeros(data.num_nodes, dtype=torch.bool)
        for rank in range(world):
            result = torch.load(out / f"{run}-{rank}.pt")
            width = data.num_classes + (0 if run.endswith("-cached") else hidden)
            assert result["forward_halo"] == result["sent"] * 4 * width
            assert torch.allclose(result["logits"], logits[result["owned"]], atol=1e-5, rtol=1e-4)
            assert result["grads"].keys() == grads.keys()
            for name, grad in grads.items():
                assert torch.allclose(result["grads"][name], grad, atol=1e-6, rtol=1e-4), (kind, rank, name)
            covered[result["owned"]] = True
            numel = sum(grad.numel() for grad in grads.values())  # its ring share of the float32 gradients
            assert result["allreduce"] == ring_allreduce_bytes(numel, 4, world, rank), (kind, rank)
        assert bool(covered.all())


def test_full_exchange_equals_full_graph_training_on_2_ranks(two_ranks: Path, cora_data: Data) -> None:
    _assert_exact(two_ranks, cora_data, 2, ["gcn", "sage"])


def test_full_exchange_equals_full_graph_training_on_4_ranks(data_root: Path, cora_data: Data, tmp_path: Path) -> None:
    _spawn(_worker, 4, str(data_root), tmp_path, ["gcn"], False)
    _assert_exact(tmp_path, cora_data, 4, ["gcn"])


def test_ring_collective_bytes() -> None:
    """The ring convention by hand: K chunks (the first n % K one item longer); rank r sends all chunks
    but (r+1) % K in the reduce-scatter and all but (r+2) % K in the all-gather."""
    assert ring_chunks(10, 3) == [4, 3, 3] and ring_chunks(2, 4) == [1, 1, 0, 0]
    assert [ring_allreduce_bytes(10, 4, 3, r) for r in range(3)] == [4 * (20 - 3 - 3), 4 * (20 - 3 - 4),
                                                                      4 * (20 - 4 - 3)]
    for numel, world in [(67, 2), (67, 4), (1000, 4), (5, 8), (1, 3)]:
        shares = [ring_allreduce_bytes(numel, 4, world, r) for r in range(world)]
        assert sum(shares) == 2 * (world - 1) * numel * 4  # all ranks: exactly 2 (K - 1) buffers
        if numel % world == 0:
            assert shares == [2 * (world - 1) * numel * 4 // world] * world  # 2 (K - 1) / K of it each
    assert ring_allreduce_bytes(67, 4, 2, 0) == 268 and ring_allreduce_bytes(67, 4, 1, 0) == 0
    assert [ring_broadcast_bytes(80, 4, r, src=0) for r in range(4)] == [80, 80, 80, 0]
    assert [ring_broadcast_bytes(80, 3, r, src=1) for r in range(3)] == [0, 80, 80]


def test_bytes_match_the_hand_count(two_ranks: Path) -> None:
    rank0, rank1 = (torch.load(two_ranks / f"bytes-{r}.pt") for r in range(2))
    # The GCN is 4 -> 8 -> 3: layer 0 exchanges 8 columns, layer 1 exchanges 3. Forward, rank 0 sends one
    # row (node 2) and rank 1 two (nodes 3, 4); backward, each returns the gradients of the rows it
    # received (rank 0 two, rank 1 one). Parameters: 4*8 + 8 + 8*3 + 3 = 67 floats = 268 bytes; a ring
    # all-reduce on 2 ranks sends 2 (2 - 1) / 2 of them a rank: 268 bytes (the chunks are 34 + 33 floats).
    # Columns a row, layer 0 + layer 1, at each setting (4 bytes a float, 1 byte an int8):
    #   rate 1: 8 + 3 floats = 44 B            truncate / mask at 4: int(8/4)=2 + max(1, int(3/4))=1 floats = 12 B
    #   int8 at 4: (8 + 4) + (3 + 4) bytes = 19 B (every column, plus a float32 scale)
    #   int8 at 16: (int(4*8/16)=2 + 4) + (1 + 4) bytes = 11 B      none: no halo
    per_row = {"rate1": 44, "truncate4": 12, "mask4": 12, "int8-4": 19, "int8-16": 11, "none": 0}
    for label, row_bytes in per_row.items():
        for sent, received, result in ((1, 2, rank0), (2, 1, rank1)):
            forward, backward, allreduce, eval_halo, metrics = result["counts"][label]
            assert (forward, backward, allreduce) == (sent * row_bytes, received * row_bytes, 268), label
            assert metrics == 0, label  # counted by the training loop, not by the exchange
            assert eval_halo == (0 if label == "none" else sent * 44), label
    # fetching the halo's dense inputs once: rank 0 sends node 2's 4 floats, rank 1 nodes 3 and 4's; then only
    # layer 1 exchanges (3 floats a row), and the logits are those of the exchanged first layer
    data, _ = _tiny_graph()
    for sent, result, halo in ((1, rank0, [3, 4]), (2, rank1, [2])):
        assert result["inputs"]["bytes"] == sent * 4 * 4 and result["inputs"]["forward"] == sent * 12
        assert torch.equal(result["inputs"]["halo"], data.x[halo]) and result["inputs"]["equal"]
        # a bfloat16 all-reduce: half the bytes (67 parameters, 2 bytes each: 134 on 2 ranks), float32 gradients
        # within bfloat16's rounding (8 bits of mantissa, per rank's share and on the sum) of the float32 all-reduce's
        (full_bytes, full_grads), (half_bytes, half_grads) = result["bf16"].values()
        assert (full_bytes, half_bytes) == (268, 134)
        for exact, rounded in zip(full_grads, half_grads):
            assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)
            assert torch.allclose(rounded, exact, rtol=2 ** -7, atol=2 ** -7 * float(exact.abs().max()))
    for result in (rank0, rank1):
        for name, (ours, reference) in result["gradients"].items():
            assert torch.allclose(ours, reference, atol=1e-6), name


# ---------------------------------------------------------------- launches


def test_torchrun_launch(data_root: Path, cora_data: Data, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "ladle.varrate", "--data-root", str(data_root),
         "--run-dir", str(run_dir), "--schedule", "linear", "--timeout", "60", "epochs=2"],
        capture_output=True, text=True, cwd=PROJECT, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((run_dir / "varrate.json").read_text())
    assert meta["workers"] == 2 and meta["launcher"] == "torchrun" and meta["epochs_run"] == 2
    assert meta["versions"]["torch"] == torch.__version__  # the ranks' libraries, as run.json records a train's
    _assert_byte_totals(meta, cora_data)
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "report.md").is_file()


def _input_halo_bytes(data: Data, partition: str, world: int) -> int:
    """What fetching the halo's input features sends, all ranks: Cora's rows are sparse, so per boundary row an
    int32 count and per non-zero an int32 column and a float32 value."""
    parts = partition_nodes(data, partition, world, seed=0)
    total = 0
    for rank in range(world):
        plan = build_plan(data.edge_index, data.num_nodes, parts, rank, world, "gcn")
        total += 4 * plan.send_index.numel() + 8 * int(torch.count_nonzero(data.x[plan.owned[plan.send_index]]))
    return total


def _assert_byte_totals(meta: dict, data: Data) -> None:
    """Every part of ``bytes`` by its formula (ring collectives, summed over ranks), and the total their sum."""
    sent, world, epochs = meta["bytes"], meta["workers"], meta["epochs_run"]
    params, size = meta["model_bytes"] // 4, {"float32": 4, "bfloat16": 2}[meta["gradients"]]
    assert sent["allreduce"] == epochs * sum(ring_allreduce_bytes(params, size, world, r) for r in range(world))
    assert sent["allreduce"] == epochs * 2 * (world - 1) * params * size
    evaluated = [row for row in meta["history"] if row["val_acc"] is not None]
    assert [row["epoch"] for row in evaluated] == [e for e in range(epochs)
                                                   if (e + 1) % meta["eval_every"] == 0 or e + 1 == epochs]
    assert meta["evaluations"] == len(evaluated)
    # the evaluation's exchange is the training forward's at rate 1: every boundary row, classes floats (and hidden
    # ones when the first layer exchanges its projection instead of fetching the halo's inputs once)
    rows = sum(row["sent"] for row in meta["ranks"])
    width = data.num_classes + (0 if meta["cache_inputs"] else meta["recipe"]["hidden"])
    assert sent["eval_halo"] == len(evaluated) * rows * 4 * width
    # per epoch one float64 reduction of [loss, 5 counters] (+ 4 scores when evaluating)
    metrics = sum(ring_allreduce_bytes(6 + 4 * (row["val_acc"] is not None), 8, world, r)
                  for row in meta["history"] for r in range(world))
    assert sent["metrics"] == metrics
    # setup: the partition (int64 a node) broadcast from rank 0, the size table (K x 5 int64) reduced, the inputs
    inputs = _input_halo_bytes(data, meta["partition"], world) if meta["cache_inputs"] else 0
    assert sent["setup"] == (world - 1) * data.num_nodes * 8 + 2 * (world - 1) * world * 5 * 8 + inputs
    parts = ("forward_halo", "backward_halo", "allreduce", "eval_halo", "metrics", "setup")
    assert sent["total"] == sum(sent[key] for key in parts) == meta["history"][-1]["total_bytes"]
    assert sent["training"] == sent["forward_halo"] + sent["backward_halo"] + sent["allreduce"]


def test_a_dead_rank_stops_the_others_with_a_clear_error(data_root: Path, tmp_path: Path) -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "ladle.varrate", "--data-root", str(data_root), "--run-dir", str(tmp_path / "run"),
               "--timeout", "15", "--schedule", "full", "epochs=100000", "patience=100000"]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=PROJECT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    try:
        assert ranks[0].stderr is not None
        for line in ranks[0].stderr:  # wait until rank 0 has started training
            if "training 2 ranks" in line:
                break
        ranks[1].send_signal(signal.SIGKILL)
        began = time.monotonic()
        _, stderr = ranks[0].communicate(timeout=60)
        assert time.monotonic() - began < 30
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    assert ranks[0].returncode == 1
    assert "another rank died or stalled" in stderr and "Traceback" not in stderr, stderr


def test_cli_rejects_bad_input(data_root: Path) -> None:
    for args, message in [(["model=gat"], "varrate supports gcn/sage"), (["norm=batch"], "norm=none or norm=layer"),
                          (["--rate-min", "8", "--rate-max", "4"], "1 <= --rate-min <= --rate-max"),
                          (["--rate-max", "inf"], "--rate-max, finite; got 1.0, inf"),
                          (["--schedule", "step", "--rate-steps", "4,nan"], "must all be >= 1 and finite"),
                          (["--rate-steps", "64,x"], "comma-separated numbers"),
                          (["--eval-every", "0"], "--eval-every must be >= 1 epoch, got 0"),
                          (["--ranks", "3000"], "cannot split 2708 nodes into 3000 workers"),
                          (["--ranks", "32", "dataset=texas"], r"--partition metis left ranks? [0-9, ]+ of 32 with no "
                                                               "nodes; use fewer --ranks or --partition random"),
                          (["--device", "cuda", "--ranks", "64"], "--device cuda")]:
        with pytest.raises(LadleError, match=message):
            varrate_main(["--data-root", str(data_root), *args])


def test_cli_workers_is_a_deprecated_alias_of_ranks(data_root: Path) -> None:
    with pytest.warns(FutureWarning, match="--workers is deprecated, use --ranks"):
        with pytest.raises(LadleError, match="cannot split 2708 nodes into 3000 workers"):
            varrate_main(["--data-root", str(data_root), "--workers", "3000"])
    with pytest.raises(LadleError, match="pass --ranks only"):
        varrate_main(["--data-root", str(data_root), "--workers", "2", "--ranks", "2"])


def test_cli_run(data_root: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_in_process("ladle.varrate", "--data-root", str(data_root), "--ranks", "2", "--schedule", "step",
                            "--compress", "int8", "--run-dir", str(run_dir), "epochs=4")
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((run_dir / "varrate.json").read_text())
    assert [row["rate"] for row in meta["history"]] == pytest.approx([64, 16, 4, 1])
    assert meta["launcher"] == "local" and "test acc" in result.stdout and "MB in all" in result.stdout


def test_cli_random_partition_and_rate_fraction(data_root: Path, cora_data: Data, tmp_path: Path) -> None:
    """``--partition random`` splits the nodes as the soup's random view does (and cuts far more edges than
    METIS); ``--rate-fraction 0.5`` reaches ``--rate-min`` at epoch 0.5 * (epochs - 1); each epoch's halo bytes
    follow its rate at both layers (``--no-input-cache``: the first exchanges its projection too)."""
    run_dir = tmp_path / "run"
    result = run_in_process("ladle.varrate", "--data-root", str(data_root), "--ranks", "2", "--partition", "random",
                            "--schedule", "linear", "--rate-max", "8", "--rate-fraction", "0.5", "--eval-every", "3",
                            "--no-input-cache", "--run-dir", str(run_dir), "epochs=4")
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((run_dir / "varrate.json").read_text())
    assert meta["partition"] == "random" and meta["schedule"]["fraction"] == 0.5
    assert [row["rate"] for row in meta["history"]] == pytest.approx([8, 8 - 7 / 1.5, 1, 1])  # 8 -> 1 by epoch 0.5 * 3
    parts = partition_nodes(cora_data, "random", 2, seed=0)
    metis = partition_nodes(cora_data, "metis", 2, seed=0)
    for rank, row in enumerate(meta["ranks"]):
        plan = build_plan(cora_data.edge_index, cora_data.num_nodes, parts, rank, 2, "gcn")
        assert (row["owned"], row["halo"], row["sent"]) == (plan.owned.numel(), plan.halo.numel(),
                                                             plan.send_index.numel())
        assert row["halo"] > 2 * build_plan(cora_data.edge_index, cora_data.num_nodes, metis, rank, 2, "gcn").halo.numel()
    rows = sum(row["sent"] for row in meta["ranks"])  # boundary rows sent per layer, all ranks
    hidden, classes = meta["recipe"]["hidden"], cora_data.num_classes
    for row in meta["history"]:  # truncation: int(width / rate) float32 columns a row, per layer
        assert row["forward_halo"] == rows * 4 * (kept_columns(hidden, row["rate"]) + kept_columns(classes, row["rate"]))
    assert [row["val_acc"] is not None for row in meta["history"]] == [False, False, True, True]  # epochs 3, 4
    _assert_byte_totals(meta, cora_data)
