"""Variable-rate mode's exchanges with memory and its adaptive ratio: error feedback, selective exchange,
``--schedule adaptive`` and early stopping that waits for the final ratio.

In-process checks of the rules, one 2-rank gloo session for the exchanges themselves (tiny graph and Cora),
and one end-to-end 2-rank run on Cora per new option.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_in_process
from test_varrate import _spawn, _tiny_graph
from torch_geometric.data import Data

from bench.varrate import Modifiers, parse_modifiers, parse_run
from ladle.core.errors import LadleError
from ladle.graph.datasets import load_dataset
from ladle.nn.scoring import Metrics
from ladle.train.loop import BestEpoch
from ladle.varrate import (
    ErrorFeedback,
    HaloExchange,
    Int8,
    RandomMask,
    RankData,
    RateController,
    RateSchedule,
    SelectiveExchange,
    Traffic,
    Truncate,
    VarrateOptions,
    build_compressor,
    build_parser,
    build_plan,
    init_group,
    kept_columns,
    partition_nodes,
)
from ladle.varrate import main as varrate_main
from ladle.varrate.memory import pick

torch.set_num_threads(1)


# ---------------------------------------------------------------- error feedback


@pytest.mark.parametrize("name, rate", [("mask", 4.0), ("int8", 4.0), ("int8", 16.0)])
def test_error_feedback_sent_plus_residual_is_exact(name: str, rate: float) -> None:
    """Each step ``decoded + new residual = rows + old residual`` on the columns a payload can carry (all of them
    but int8's tail at ratio 16, whose residual is dropped); summed over steps, what was decoded plus the
    residual still held is exactly the sum of the rows; rows not sent keep their residual."""
    compressor = build_compressor(name, error_feedback=True)
    n = compressor.sendable_columns(16, rate)
    assert n == (4 if rate == 16 else 16)
    feedback, generator = ErrorFeedback(), torch.Generator().manual_seed(0)
    total, decoded_sum, previous = torch.zeros(6, n), torch.zeros(6, n), torch.zeros(6, 16)
    for step in range(5):
        rows = torch.randn(6, 16, generator=generator)
        payload = feedback.encode(compressor, rows, rate, step, layer=1, sent=None, total=6)
        decoded = compressor.decode(payload, 16, rate, step)
        residual = feedback.residuals[1]
        assert torch.allclose((decoded + residual)[:, :n], (rows + previous)[:, :n], atol=1e-5)
        assert residual[:, :n].abs().sum() > 0 and not residual[:, n:].any()
        total, decoded_sum, previous = total + rows[:, :n], decoded_sum + decoded[:, :n], residual.clone()
    assert torch.allclose(decoded_sum + feedback.residuals[1][:, :n], total, atol=1e-4)

    sent = torch.tensor([1, 4])
    rows = torch.randn(2, 16, generator=generator)
    payload = feedback.encode(compressor, rows, rate, 9, layer=1, sent=sent, total=6)
    residual = feedback.residuals[1]
    assert torch.allclose((compressor.decode(payload, 16, rate, 9) + residual[sent])[:, :n],
                          (rows + previous[sent])[:, :n], atol=1e-5)
    assert torch.equal(residual[[0, 2, 3, 5]], previous[[0, 2, 3, 5]])
    assert 0 not in feedback.residuals  # per layer


def test_error_feedback_holds_back_nothing_a_payload_cannot_carry() -> None:
    """Truncation is exact on the columns it sends, so it has nothing to carry; int8's tail at ratio 16 is never
    sent, and a later, lower ratio that sends it must not receive 20 steps of it at once."""
    rows = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    feedback = ErrorFeedback()
    for step in range(5):
        payload = feedback.encode(Truncate(), rows, 4.0, step, layer=0, sent=None, total=3)
        assert torch.equal(payload, Truncate().encode(rows, 4.0, step))
    assert not feedback.residuals[0].any()
    feedback, int8 = ErrorFeedback(), Int8()
    for step in range(20):
        feedback.encode(int8, rows, 16.0, step, layer=0, sent=None, total=3)
    decoded = int8.decode(feedback.encode(int8, rows, 4.0, 20, layer=0, sent=None, total=3), 16, 4.0, 20)
    assert (decoded - rows).abs().max() < 0.1 * rows.abs().max()


def test_error_feedback_at_ratio_one_flushes_the_residual() -> None:
    feedback, rows = ErrorFeedback(), torch.randn(3, 8)
    feedback.encode(Truncate(), rows, 8.0, 0, layer=0, sent=None, total=3)
    payload = feedback.encode(Truncate(), rows, 1.0, 0, layer=0, sent=None, total=3)
    assert not feedback.residuals[0].any() and payload.shape == (3, 8)


def test_error_feedback_unscales_the_mask() -> None:
    """The scaled mask is not contractive (its kept columns' error is (d/k - 1) x the value), so its
    residual explodes under error feedback; the unscaled mask that ``build_compressor`` picks stays bounded."""
    assert build_compressor("mask", error_feedback=True).scaled is False  # type: ignore[attr-defined]
    assert build_compressor("mask").scaled is True  # type: ignore[attr-defined]
    rows = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    norms = {}
    for scaled in (True, False):
        feedback = ErrorFeedback()
        for step in range(30):
            feedback.encode(RandomMask(scaled), rows, 4.0, step, layer=0, sent=None, total=4)
        norms[scaled] = float(feedback.residuals[0].norm() / rows.norm())
    assert norms[False] < 10 < 1000 < norms[True]


# ---------------------------------------------------------------- the adaptive ratio and early stopping


def test_adaptive_halves_on_a_flat_loss_and_keeps_an_improving_one() -> None:
    schedule = RateSchedule("adaptive", rate_max=64, rate_min=4, patience=3, tolerance=0.01)
    flat = RateController(schedule, epochs=100)
    rates = []
    for epoch in range(20):
        rates.append(flat.rate(epoch))
        flat.observe(1.0)  # the first observation sets the best; then nothing improves
    # three stale epochs per halving: 64 for epochs 0-3, 32 for 4-6, 16 for 7-9, 8 for 10-12, then 4 (= rate_min)
    assert rates == [64.0] * 4 + [32.0] * 3 + [16.0] * 3 + [8.0] * 3 + [4.0] * 7
    assert flat.settled == 13 and flat.epochs_final(19) == 7

    improving = RateController(schedule, epochs=100)
    for epoch in range(50):
        assert improving.rate(epoch) == 64.0
        improving.observe(0.97 ** epoch)  # 3% better every epoch: at least 1% of the first loss in 3 epochs
    assert improving.settled is None and improving.epochs_final(49) == 0

    # the tolerance is a share of the first loss, over the patience: falling 0.5% an epoch is 1.5% in 3 epochs
    # and keeps the ratio; 0.2% an epoch (0.6% in 3) halves it
    for fall, after in ((0.005, 64.0), (0.002, 32.0)):
        slow = RateController(schedule, epochs=100)
        for epoch in range(4):
            slow.rate(epoch)
            slow.observe((1 - fall) ** epoch)
        assert slow.rate(4) == after


def test_adaptive_measures_progress_against_the_first_loss() -> None:
    """A power-law loss ``1 / (1 + t)`` still falls 1% of itself an epoch at epoch 99: a tolerance relative to the
    current loss would keep ``rate_max`` that long. Measured against the first loss, progress is slow by epoch
    ~20 and the ratio reaches ``rate_min`` within 60 epochs."""
    control = RateController(RateSchedule("adaptive", rate_max=64, rate_min=1, patience=3, tolerance=0.01), 100)
    rates = []
    for epoch in range(60):
        rates.append(control.rate(epoch))
        control.observe(1 / (1 + epoch))
    assert rates[:10] == [64.0] * 10 and rates[-1] == 1.0


def test_adaptive_keeps_its_best_across_a_halving_and_never_goes_below_rate_min() -> None:
    schedule = RateSchedule("adaptive", rate_max=48, rate_min=1.5, patience=2, tolerance=0.1)
    control = RateController(schedule, epochs=100)
    losses = [1.0, 0.95, 0.95, 0.85, 2.0, 2.0, float("nan")] + [1.0] * 20
    seen = []
    for epoch, loss in enumerate(losses):
        seen.append(control.rate(epoch))
        control.observe(loss)
    # 0.95 is not 10% below 1.0: halve after epoch 2; 0.85 is: best 0.85, then two stale epochs, and so on
    assert seen[:8] == [48.0, 48.0, 48.0, 24.0, 24.0, 24.0, 12.0, 12.0]
    assert control.best == 0.85
    assert min(seen) == 1.5 and seen[-1] == 1.5
    assert all(b in (a, max(1.5, a / 2)) for a, b in zip(seen, seen[1:]))  # only ever halved


def test_rate_controller_follows_fixed_schedules() -> None:
    linear = RateController(RateSchedule("linear", rate_max=64, rate_min=2, fraction=0.5), epochs=11)
    assert [linear.rate(e) for e in range(11)] == pytest.approx([64, 51.6, 39.2, 26.8, 14.4, 2, 2, 2, 2, 2, 2])
    linear.observe(1.0)  # ignored
    assert linear.settled == 5 and linear.epochs_final(10) == 6
    assert RateSchedule("linear", rate_max=7.3, rate_min=1.1).rate(9, 10) == 1.1  # the final ratio itself
    for kind, final in [("full", 1.0), ("fixed", 64.0), ("none", None), ("adaptive", 1.0), ("step", 1.0)]:
        schedule = RateSchedule(kind)
        assert schedule.final() == final
        if kind != "adaptive":
            control = RateController(schedule, epochs=10)
            assert [control.rate(e) for e in range(10)][-1] == final and control.epochs_final(9) >= 1
    assert RateSchedule("step", steps=(8, 2)).final() == 2.0
    with pytest.raises(ValueError, match="RateController"):
        RateSchedule("adaptive").rate(0, 10)


# ---------------------------------------------------------------- selective exchange, in process


def test_both_ends_of_a_pair_pick_the_same_rows() -> None:
    # rank 0 sends 5 rows to rank 1 and 3 to rank 2; rank 1 receives 5 from rank 0 and 7 from rank 2
    sent, counts = pick([0, 5, 3], 0.4, [(0, 0), (0, 1), (0, 2)], seed=3, step=2, layer=1)
    received, recv_counts = pick([5, 0, 7], 0.4, [(0, 1), (1, 1), (2, 1)], seed=3, step=2, layer=1)
    assert counts == [0, 2, 2] and recv_counts == [2, 0, 3]  # ceil(0.4 n)
    assert torch.equal(sent[:2], received[:2])  # the pair (0 -> 1), same positions within it
    assert bool((sent[2:] >= 5).all()) and bool((received[2:] >= 5).all())  # each peer's own block
    assert not torch.equal(sent, pick([0, 5, 3], 0.4, [(0, 0), (0, 1), (0, 2)], seed=3, step=3, layer=1)[0])
    everything, all_counts = pick([4, 0, 2], 1.0, [(1, 0), (1, 1), (1, 2)], seed=0, step=0, layer=0)
    assert torch.equal(everything, torch.arange(6)) and all_counts == [4, 0, 2]


def test_selective_exchange_reuses_its_stale_copy() -> None:
    selection = SelectiveExchange(0.5)
    first = selection.route(0, [0, 4], [0, 6], seed=0, step=0, layer=0, device=torch.device("cpu"))
    assert first.sent is None and first.received is None and first.send_counts == [0, 4]  # a layer's first: all
    fresh = torch.randn(6, 3, requires_grad=True)
    assert selection.merge(0, fresh, first) is fresh and selection.halos[0].requires_grad is False
    route = selection.route(0, [0, 4], [0, 6], seed=0, step=1, layer=0, device=torch.device("cpu"))
    assert route.send_counts == [0, 2] and route.recv_counts == [0, 3] and route.received is not None
    halo = selection.merge(0, torch.ones(3, 3), route)
    stale = torch.ones(6, dtype=torch.bool)
    stale[route.received] = False
    assert torch.equal(halo[route.received], torch.ones(3, 3)) and torch.equal(halo[stale], fresh.detach()[stale])
    assert torch.equal(selection.halos[0], halo)
    assert selection.route(0, [0, 4], [0, 6], seed=0, step=1, layer=1, device=torch.device("cpu")).sent is None


def test_an_evaluation_exchange_takes_no_memory() -> None:
    data, parts = _tiny_graph()
    plan = build_plan(data.edge_index, 6, parts, 0, 2, "gcn")
    for memory in ({"feedback": ErrorFeedback()}, {"selection": SelectiveExchange(0.5)}):
        with pytest.raises(ValueError, match="exact"):
            HaloExchange(plan, Truncate(), 1.0, 0, 0, Traffic(), evaluating=True, **memory)


# ---------------------------------------------------------------- the command line


def test_cli_rejects_bad_new_options(data_root: Path) -> None:
    for args, message in [(["--select", "0"], r"--select must be in \(0, 1\]"),
                          (["--select", "1.5"], r"--select must be in \(0, 1\]"),
                          (["--select", "-0.1"], r"--select must be in \(0, 1\]"),
                          (["--select", "nan"], r"--select must be in \(0, 1\]"),
                          (["--schedule", "none", "--select", "0.5"], "--schedule none has none"),
                          (["--schedule", "none", "--error-feedback"], "--schedule none has none"),
                          (["--compress", "truncate", "--error-feedback"], "nothing to carry over with --compress truncate"),
                          (["--schedule", "adaptive", "--rate-patience", "0"], "--rate-patience must be >= 1"),
                          (["--schedule", "adaptive", "--rate-tolerance", "1"], r"--rate-tolerance must be in \[0, 1"),
                          (["--schedule", "adaptive", "--rate-min", "8", "--rate-max", "4"], "--rate-min <= --rate")]:
        with pytest.raises(LadleError, match=message):
            varrate_main(["--data-root", str(data_root), *args])
    with pytest.raises(SystemExit):  # argparse: not a number
        varrate_main(["--data-root", str(data_root), "--select", "half"])


def test_the_measured_default_is_adaptive_mask_with_cached_inputs_and_bfloat16_gradients() -> None:
    """bench/RESULTS.md chose it on csbm and Physics (3 seeds each), with bfloat16 gradient all-reduces; the
    library's options agree with the CLI."""
    args = build_parser().parse_args([])
    assert (args.schedule, args.compress, args.cache_inputs, args.exact_tail, args.gradients) == (
        "adaptive", "mask", True, 0, "bfloat16")
    options = VarrateOptions()
    assert (options.schedule.kind, options.compressor, options.cache_inputs, options.gradients) == (
        "adaptive", "mask", True, "bfloat16")


def test_bench_run_specs_take_memory_modifiers() -> None:
    spec = "fixed:64/mask+ef+select=0.25"
    name, schedule, compressor = parse_run(spec, 64.0)
    assert (name, schedule.kind, schedule.rate_max, compressor) == ("fixed-64-mask-ef-select-0.25", "fixed", 64.0, "mask")
    assert parse_modifiers(spec) == Modifiers(error_feedback=True, select=0.25)
    assert parse_modifiers("linear/int8") == Modifiers()
    assert parse_modifiers("none+tail=23+nocache") == Modifiers(tail=23, cache_inputs=False)
    assert parse_modifiers("adaptive/mask+bf16") == Modifiers(gradients="bfloat16")
    assert parse_run("none+tail=23", 64.0)[1].tail == 23
    assert parse_run("adaptive", 32.0, patience=4)[1].patience == 4
    for bad in ("full+select=x", "full+select", "full+foo", "fixed:8/int8+ef=1", "none+tail=x", "full+nocache=1", "full+bf16=1"):
        with pytest.raises(LadleError, match="run "):
            parse_modifiers(bad)


# ---------------------------------------------------------------- the exchanges on 2 gloo ranks


def _worker(rank: int, world: int, port: int, data_root: str, out: Path) -> None:
    torch.set_num_threads(1)
    init_group(torch.device("cpu"), 60, f"tcp://127.0.0.1:{port}", rank, world)
    try:
        _feedback_steps(rank, world, out)
        _selective_steps(rank, world, data_root, out)
    finally:
        dist.destroy_process_group()


def _feedback_steps(rank: int, world: int, out: Path) -> None:
    """Four steps of an (unscaled) mask exchange at ratio 4 with error feedback on the tiny graph: per step the
    rows sent, the halo received and the residual after; and the gradient, with and without feedback."""
    data, parts = _tiny_graph()
    plan = RankData.build(data, parts, rank, world, "gcn").plan
    feedback, generator, steps = ErrorFeedback(), torch.Generator().manual_seed(rank), []
    mask = build_compressor("mask", error_feedback=True)
    for step in range(4):
        rows = torch.randn(plan.owned.numel(), 8, generator=generator, requires_grad=True)
        halo = HaloExchange(plan, mask, 4.0, 0, step, Traffic(), feedback=feedback)(rows, 0)
        weight = torch.randn(halo.shape, generator=generator)
        (halo * weight).sum().backward()
        plain = rows.detach().clone().requires_grad_()
        (HaloExchange(plan, mask, 4.0, 0, step, Traffic())(plain, 0) * weight).sum().backward()
        steps.append({"sent": rows.detach()[plan.send_index], "halo": halo.detach(),
                      "residual": feedback.residuals[0].clone(), "grad": rows.grad, "plain_grad": plain.grad})
    torch.save(steps, out / f"feedback-{rank}.pt")


def _selective_steps(rank: int, world: int, data_root: str, out: Path) -> None:
    """Three exact (ratio 1) steps on Cora's METIS plan sending a quarter of the rows, and the same with
    ``SelectiveExchange(1.0)`` against the plain exchange: halos, routes, bytes and gradients."""
    data = load_dataset("cora", data_root)
    plan = build_plan(data.edge_index, data.num_nodes, partition_nodes(data, "metis", world, 0), rank, world, "gcn")
    generator, steps = torch.Generator().manual_seed(10 + rank), []
    selection, whole = SelectiveExchange(0.25), SelectiveExchange(1.0)
    for step in range(3):
        rows = torch.randn(plan.owned.numel(), 5, generator=generator, requires_grad=True)
        traffic = Traffic()
        exchange = HaloExchange(plan, Truncate(), 1.0, 0, step, traffic, selection=selection)
        route = exchange.route(1, torch.device("cpu"))  # what the exchange below will draw
        halo = exchange(rows, 1)
        halo.sum().backward()
        full_rows = rows.detach().clone().requires_grad_()
        full_traffic, one_traffic = Traffic(), Traffic()
        full = HaloExchange(plan, Truncate(), 1.0, 0, step, full_traffic)(full_rows, 1)
        full.sum().backward()
        one_rows = rows.detach().clone().requires_grad_()
        one = HaloExchange(plan, Truncate(), 1.0, 0, step, one_traffic, selection=whole)(one_rows, 1)
        one.sum().backward()
        steps.append({"rows": rows.detach(), "halo": halo.detach(), "grad": rows.grad, "sent": route.sent,
                      "received": route.received, "recv_counts": route.recv_counts,
                      "traffic": traffic.values(), "full": full.detach(), "full_grad": full_rows.grad,
                      "full_traffic": full_traffic.values(), "one": one.detach(), "one_grad": one_rows.grad,
                      "one_traffic": one_traffic.values(), "send_index": plan.send_index,
                      "send_counts": plan.send_counts})
    torch.save(steps, out / f"select-{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exchange-ranks")
    _spawn(_worker, 2, str(data_root), out)
    return out


def test_error_feedback_through_the_exchange(two_ranks: Path) -> None:
    """What a rank receives plus what its peer still holds back is the peer's rows plus the residual it held
    before; the gradient is the one without feedback (the residual is a constant)."""
    ranks = [torch.load(two_ranks / f"feedback-{r}.pt") for r in range(2)]
    for receiver, sender in ((0, 1), (1, 0)):
        previous = torch.zeros_like(ranks[sender][0]["residual"])
        for step, (got, gave) in enumerate(zip(ranks[receiver], ranks[sender])):
            assert torch.allclose(got["halo"] + gave["residual"], gave["sent"] + previous, atol=1e-6), step
            assert gave["residual"].abs().sum() > 0
            assert torch.allclose(gave["grad"], gave["plain_grad"])
            previous = gave["residual"]


def test_selective_exchange_between_ranks(two_ranks: Path) -> None:
    ranks = [torch.load(two_ranks / f"select-{r}.pt") for r in range(2)]
    for receiver, sender in ((0, 1), (1, 0)):
        got, gave = ranks[receiver], ranks[sender]
        send_index, rows = gave[0]["send_index"], gave[0]["send_counts"][receiver]
        assert rows > 20  # Cora's cut: enough rows for a quarter to be a proper subset
        # the first exchange sends every row: the exact halo, the full exchange's bytes and gradient
        assert torch.equal(got[0]["halo"], gave[0]["rows"][send_index])
        assert gave[0]["traffic"] == gave[0]["full_traffic"] and torch.equal(gave[0]["grad"], gave[0]["full_grad"])
        for step in (1, 2):
            source = gave[step]
            fresh = torch.zeros(rows, dtype=torch.bool)
            fresh[got[step]["received"]] = True
            assert got[step]["recv_counts"][sender] == math.ceil(0.25 * rows) == int(fresh.sum())
            exact = source["rows"][send_index]
            assert torch.equal(got[step]["halo"][fresh], exact[fresh])  # sent rows arrive exactly
            assert torch.equal(got[step]["halo"][~fresh], got[step - 1]["halo"][~fresh])  # others: the stale copy
            assert not torch.equal(got[step]["halo"], exact)
            # bytes: ratio 1, 5 float32 columns, only the rows sent, forward and back
            forward, backward = source["traffic"][:2]
            returned = math.ceil(0.25 * got[0]["send_counts"][sender])  # gradients of the rows it received
            assert (forward, backward) == (math.ceil(0.25 * rows) * 5 * 4, returned * 5 * 4)
            assert forward < source["full_traffic"][0]
            # gradients reach only the rows sent this step (halo.sum(): one per sending)
            sent_rows = send_index[source["sent"]]
            expected = torch.zeros_like(source["grad"]).index_add_(0, sent_rows, torch.ones(sent_rows.numel(), 5))
            assert torch.equal(source["grad"], expected)
        for step in range(3):  # SelectiveExchange(1.0) is the plain exchange
            assert torch.equal(gave[step]["one"], gave[step]["full"])
            assert torch.equal(gave[step]["one_grad"], gave[step]["full_grad"])
            assert gave[step]["one_traffic"] == gave[step]["full_traffic"]


# ---------------------------------------------------------------- end to end on Cora, 2 ranks


def _run(data_root: Path, run_dir: Path, *args: str) -> dict:
    result = run_in_process("ladle.varrate", "--data-root", str(data_root), "--ranks", "2", "--run-dir",
                            str(run_dir), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "varrate.json").read_text())


def _boundary_rows(cora_data: Data) -> list[list[int]]:
    """Per rank, the boundary rows it sends each peer at a layer (METIS, 2 ranks, the runs' seed 0)."""
    parts = partition_nodes(cora_data, "metis", 2, seed=0)
    return [build_plan(cora_data.edge_index, cora_data.num_nodes, parts, r, 2, "gcn").send_counts for r in range(2)]


def test_cli_error_feedback_and_select(data_root: Path, cora_data: Data, tmp_path: Path) -> None:
    """Fixed ratio 32, a column mask with error feedback, half the rows a step: accuracy above 0.75; the first epoch
    sends every row, later ones ``ceil(0.5 n)`` of each peer's ``n``, each int(d / 32) float32 columns (feedback adds
    no byte); the evaluations stay exact (every row, every column). The first layer, its halo's inputs fetched
    once, exchanges nothing: only the second layer's rows travel."""
    meta = _run(data_root, tmp_path / "run", "--schedule", "fixed", "--rate-max", "32", "--compress", "mask",
                "--error-feedback", "--select", "0.5", "epochs=60")
    assert meta["error_feedback"] is True and meta["select"] == 0.5 and meta["test_acc"] > 0.75
    counts = _boundary_rows(cora_data)
    width = 4 * kept_columns(cora_data.num_classes, 32)
    every = sum(sum(c) for c in counts) * width
    half = sum(math.ceil(0.5 * n) for c in counts for n in c) * width
    assert [row["forward_halo"] for row in meta["history"]] == [every] + [half] * 59
    assert [row["backward_halo"] for row in meta["history"]] == [every] + [half] * 59
    exact = sum(sum(c) for c in counts) * 4 * cora_data.num_classes
    assert {row["eval_halo"] for row in meta["history"] if row["val_acc"] is not None} == {exact}


def test_cli_adaptive(data_root: Path, cora_data: Data, tmp_path: Path) -> None:
    """The ratio starts at --rate-max, only ever halves, reaches --rate-min, and early stopping (patience 10)
    ends the run only after 10 epochs at --rate-min; each epoch's bytes follow its ratio."""
    meta = _run(data_root, tmp_path / "run", "--schedule", "adaptive", "--rate-max", "8", "--rate-patience", "3",
                "--eval-every", "2", "epochs=200", "patience=10")
    assert meta["schedule"]["kind"] == "adaptive" and meta["test_acc"] > 0.75
    rates = [row["rate"] for row in meta["history"]]
    assert rates[0] == 8.0 and rates[-1] == 1.0
    assert all(b in (a, a / 2) for a, b in zip(rates, rates[1:]))
    if meta["epochs_run"] < 200:
        assert rates[-10:] == [1.0] * 10
    rows = sum(sum(c) for c in _boundary_rows(cora_data))
    for row in meta["history"]:
        kept = kept_columns(cora_data.num_classes, row["rate"])  # the first layer's halo inputs are fetched once
        assert row["forward_halo"] == rows * 4 * kept


def test_early_stopping_waits_for_the_final_ratio(data_root: Path, tmp_path: Path) -> None:
    """``linear`` 16 -> 1 over 40 epochs with patience 2 (evaluated every epoch): the validation stalls long
    before the ratio reaches 1 (both layers compressed: ``--no-input-cache``), which used to end the run; now it runs
    until 2 epochs at ratio 1."""
    meta = _run(data_root, tmp_path / "run", "--schedule", "linear", "--rate-max", "16", "--eval-every", "1",
                "--no-input-cache", "epochs=40", "patience=2")
    assert meta["epochs_run"] == 40 and meta["history"][-1]["rate"] == 1.0
    best, stopped = BestEpoch(), None  # the old rule, replayed: stop once patience epochs pass unimproved
    for row in meta["history"]:
        best.update(row["epoch"], Metrics(row["val_acc"], row["val_loss"]))
        if best.exhausted(2):
            stopped = row
            break
    assert stopped is not None and stopped["rate"] > 1, "the old rule would not have stopped early here"


def test_cli_none_with_an_exact_tail(data_root: Path, cora_data: Data, tmp_path: Path) -> None:
    """``--schedule none --exact-tail 5``: 15 epochs on the induced subgraphs (no halo byte), then 5 exact ones in
    which only the second layer exchanges (the halo's inputs were fetched once, as setup); accuracy above 0.75.
    ``--gradients bfloat16``: the all-reduce sends 2 bytes a parameter."""
    meta = _run(data_root, tmp_path / "run", "--schedule", "none", "--exact-tail", "5", "--eval-every", "5",
                "--gradients", "bfloat16", "epochs=20")
    assert meta["schedule"]["tail"] == 5 and meta["cache_inputs"] is True and meta["test_acc"] > 0.75
    assert meta["gradients"] == "bfloat16" and meta["bytes"]["allreduce"] == 20 * 2 * (2 - 1) * meta["model_bytes"] // 2
    assert [row["rate"] for row in meta["history"]] == [None] * 15 + [1.0] * 5
    rows = sum(sum(c) for c in _boundary_rows(cora_data))
    assert [row["forward_halo"] for row in meta["history"]] == [0] * 15 + [rows * 4 * cora_data.num_classes] * 5
