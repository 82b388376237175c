"""Varrate's training on one rank: the model's forward over its partition with the halo, its share of
the loss, the gradient all-reduce, and the loop that keeps the best-validation epoch."""
from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.data import Data

from ladle.core.collectives import ring_allreduce_bytes
from ladle.core.errors import LadleError
from ladle.core.recipe import Recipe
from ladle.core.rundir import RunDir
from ladle.core.seeds import worker_seed
from ladle.core.versions import library_versions
from ladle.graph.inputs import Features, use_sparse_features
from ladle.graph.sparse import SparseMatrix
from ladle.nn.models import GNN, GCNLayer, SAGELayer, build_model, project_features
from ladle.nn.scoring import Metrics, metric_sums
from ladle.train.finish import epoch_loop, finish
from ladle.train.loop import BestEpoch
from ladle.varrate.compression import RateController, RateSchedule, build_compressor
from ladle.varrate.halo import (
    HaloExchange,
    HaloPlan,
    PeerFailure,
    Traffic,
    build_plan,
    collective,
    fetch_input_halo,
)
from ladle.varrate.memory import ErrorFeedback, SelectiveExchange
from ladle.varrate.report import report_entry, write_bytes_report

log = logging.getLogger(__name__)

SUPPORTED_MODELS = ("gcn", "sage")
EVAL_EVERY = 10  # epochs between exact evaluations: their halo then costs 1/20 of full training's


def check_model(recipe: Recipe) -> None:
    """varrate drives GCN and SAGE layers and per-node norms; anything else is a user error."""
    if recipe.model not in SUPPORTED_MODELS:
        raise LadleError(f"varrate supports gcn/sage; got model={recipe.model} (use model=gcn or model=sage)")
    if recipe.norm == "batch":
        raise LadleError("varrate supports norm=none or norm=layer (batch norm would need statistics "
                         "synchronised across ranks)")


def partition_forward(model: GNN, x: Features, plan: HaloPlan, exchange: HaloExchange | None,
                      inputs: Features | None = None) -> Tensor:
    """Logits of the owned nodes: each layer projects the owned rows, appends the halo rows it
    receives and aggregates with the plan's rows of ``Â`` (``exchange=None``: the induced subgraph).

    ``inputs``: the owned and halo rows of the features (:func:`~ladle.varrate.halo.fetch_input_halo`); the
    first layer then projects the halo's rows itself and exchanges nothing.
    """
    h: Features = x
    adj = plan.adj if exchange is not None else plan.induced_adj
    last = len(model.convs) - 1
    for i, conv in enumerate(model.convs):
        if not isinstance(conv, GCNLayer | SAGELayer):
            raise LadleError(f"varrate supports gcn/sage; got a {type(conv).__name__} layer")
        neighbour = conv.lin if isinstance(conv, GCNLayer) else conv.lin_l
        if i == 0 and exchange is not None and inputs is not None:
            out = adj.matmul(project_features(inputs, neighbour))
        else:
            out = adj.matmul(_with_halo(project_features(h, neighbour), exchange, i))
        if isinstance(conv, GCNLayer):
            out = out + conv.bias if conv.bias is not None else out
        else:
            out = out + conv.lin_l.bias + project_features(h, conv.lin_r)
        h = out
        if i < last:
            h = F.dropout(F.relu(model.norms[i](h)), model.dropout, model.training)
    assert isinstance(h, Tensor)
    return h


def _with_halo(rows: Tensor, exchange: HaloExchange | None, layer: int) -> Tensor:
    return rows if exchange is None else torch.cat([rows, exchange(rows, layer)])


@dataclass(eq=False)
class RankData:
    """What one rank holds: its plan and its rows of the features, labels and split masks.

    ``totals`` are the whole graph's train / val / test counts: losses and accuracies divide by them;
    ``setup_bytes`` what this rank sent to set up (its share of the partition broadcast). ``inputs``: the owned
    and halo rows of the features when fetched (:meth:`fetch_inputs`), ``input_bytes`` what that sent.
    """

    plan: HaloPlan
    x: Features
    y: Tensor
    train: Tensor
    val: Tensor
    test: Tensor
    totals: tuple[int, int, int]
    num_classes: int
    setup_bytes: int = 0
    inputs: Features | None = None
    input_bytes: int = 0

    @classmethod
    def build(cls, data: Data, parts: Tensor, rank: int, world: int, model: str,
              device: torch.device | str = "cpu", setup_bytes: int = 0) -> RankData:
        """Slice ``data`` for ``rank``; features go sparse when the whole matrix would (as in ladle.train.loop)."""
        plan = build_plan(data.edge_index, data.num_nodes, parts, rank, world, model)
        x = data.x[plan.owned]
        features: Features = SparseMatrix.from_dense(x) if use_sparse_features(data.x, model) else x
        totals = (int(data.train_mask.sum()), int(data.val_mask.sum()), int(data.test_mask.sum()))
        masks = [data[key][plan.owned].to(device) for key in ("train_mask", "val_mask", "test_mask")]
        return cls(plan.to(device), features.to(device), data.y[plan.owned].to(device), *masks, totals,
                   int(data.num_classes), setup_bytes)

    def fetch_inputs(self, x: Tensor) -> None:
        """Fetch the halo's rows of the features from their owners (a collective: every rank calls it).
        ``x``: this rank's own rows, dense."""
        sparse = isinstance(self.x, SparseMatrix)
        self.inputs, self.input_bytes = fetch_input_halo(x.to(self.y.device), self.plan, sparse)
        if not sparse:  # dense: the own rows are the first rows of the inputs, held once
            self.x = self.inputs[: self.plan.owned.numel()]


def partition_loss(logits: Tensor, part: RankData) -> Tensor:
    """This rank's share of the full-graph mean training loss: ``sum(ce over own train nodes) / |V_train|``.

    Summed over ranks (the gradient all-reduce), the gradients are those of the full-graph mean.
    """
    return F.cross_entropy(logits[part.train], part.y[part.train], reduction="sum") / max(1, part.totals[0])


GRADIENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def allreduce_gradients(model: GNN, traffic: Traffic, dtype: torch.dtype = torch.float32) -> None:
    """Sum every parameter's gradient over ranks in one flat ``all_reduce``, sent as ``dtype``; count this rank's
    ring share (:func:`ladle.core.collectives.ring_allreduce_bytes`, about ``2 (K - 1) / K`` model sizes).

    ``bfloat16`` halves the bytes as DDP's ``bf16_compress_hook`` does: float32's range, 8 bits of mantissa.
    """
    params = list(model.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]).to(dtype)
    with collective("gradient all-reduce"):
        dist.all_reduce(flat)
    traffic.allreduce += ring_allreduce_bytes(flat.numel(), flat.element_size(), dist.get_world_size(),
                                              dist.get_rank())
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype, copy=True)
        offset += p.numel()


@dataclass(frozen=True)
class VarrateOptions:
    """Settings of a varrate run besides the recipe (the command line's flags)."""

    ranks: int = 4
    partition: str = "metis"
    schedule: RateSchedule = field(default_factory=RateSchedule)  # adaptive
    compressor: str = "mask"
    device: str = "cpu"
    timeout: float = 300.0
    threads: int = 0  # 0: cores / ranks on this machine
    eval_every: int = EVAL_EVERY
    log: tuple[str, ...] = ()  # metric loggers besides the CSV (ladle.train.curves.LOGGERS)
    error_feedback: bool = False  # senders carry what compression lost into the next step (memory.ErrorFeedback)
    select: float = 1.0  # fraction of the boundary rows a training exchange sends (memory.SelectiveExchange)
    cache_inputs: bool = True  # fetch the halo's input features once; the first layer then exchanges nothing
    gradients: str = "bfloat16"  # the gradient all-reduce's dtype (GRADIENT_DTYPES); float32 for exact sums

    def __post_init__(self) -> None:
        if self.eval_every < 1:
            raise LadleError(f"--eval-every must be >= 1 epoch, got {self.eval_every}")
        if not 0 < self.select <= 1:
            raise LadleError(f"--select must be in (0, 1] (the fraction of boundary rows sent a step), "
                             f"got {self.select}")
        if self.schedule.kind == "none" and (self.error_feedback or self.select < 1):
            raise LadleError("--error-feedback and --select act on the halo exchange, and --schedule none has "
                             "none: choose another --schedule or drop them")
        if self.gradients not in GRADIENT_DTYPES:
            raise LadleError(f"--gradients must be one of {', '.join(GRADIENT_DTYPES)}, got {self.gradients!r}")
        if self.error_feedback and self.compressor == "truncate":
            raise LadleError("--error-feedback has nothing to carry over with --compress truncate (it is exact on the "
                             "columns it sends and never sends the others): use --compress mask or int8")


def _metrics(model: GNN, part: RankData, exchange: HaloExchange, inputs: Features | None) -> list[float]:
    """This rank's correct train, val and test predictions and val loss sum (exact exchange, no dropout)."""
    model.eval()
    with torch.no_grad():
        logits = partition_forward(model, part.x, part.plan, exchange, inputs)
    train, _ = metric_sums(logits[part.train], part.y[part.train])
    val, val_loss = metric_sums(logits[part.val], part.y[part.val])
    test, _ = metric_sums(logits[part.test], part.y[part.test])
    return [train, val, test, val_loss]


def train_partition(recipe: Recipe, part: RankData, options: VarrateOptions,
                    run_dir: Path | None) -> dict[str, Any] | None:
    """Train one rank's side of the run (call on every rank of an initialised process group).

    Adam on the rank's share of the loss, gradients all-reduced; every ``options.eval_every`` epochs
    (and at the last) validation and test accuracy from an exact exchange, summed over ranks; the
    best-validation evaluation's weights and test accuracy are kept, with early stopping after
    ``patience`` epochs. Every epoch all-reduces the loss and the byte counters (counted as
    ``metrics``). Rank 0 writes the weights, the metadata and the report into ``run_dir``
    (:class:`~ladle.core.rundir.RunDir`) and returns the metadata; other ranks return None. Rank 0 also logs
    the run's curve (:mod:`ladle.train.curves`, role ``varrate``): the all-reduced training loss every epoch,
    validation at each evaluation.

    The ratio comes from :class:`~ladle.varrate.compression.RateController` (``adaptive`` reads the all-reduced
    loss), and early stopping counts only epochs at the schedule's final ratio: a run is never stopped while
    its ratio is still falling. ``options.error_feedback`` and ``options.select`` give the training exchanges
    their memory (:mod:`ladle.varrate.memory`); evaluations stay exact. ``options.cache_inputs`` needs
    ``part.inputs`` (:meth:`RankData.fetch_inputs`); their bytes count as setup.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = part.y.device
    compressor = build_compressor(options.compressor, options.error_feedback)
    rates = RateController(options.schedule, recipe.epochs)
    feedback = ErrorFeedback() if options.error_feedback else None
    selection = SelectiveExchange(options.select) if options.select < 1 else None
    inputs = part.inputs if options.cache_inputs else None
    if options.cache_inputs and inputs is None:
        raise ValueError("cache_inputs needs the halo's features: call RankData.fetch_inputs on every rank first")
    torch.manual_seed(recipe.seed)  # the soup's shared initialisation, identical on every rank
    model = build_model(recipe, part.x.shape[1], part.num_classes).to(device)
    torch.manual_seed(worker_seed(recipe.seed, rank))  # dropout differs by rank
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    setup_bytes = part.setup_bytes + (part.input_bytes if options.cache_inputs else 0)
    sizes, setup = _gather_sizes([*part.plan.describe().values(), int(part.train.sum())], setup_bytes, device)
    n_train, n_val, n_test = part.totals

    history: list[dict[str, Any]] = []
    best, best_state, best_test = BestEpoch(), copy.deepcopy(model.state_dict()), 0.0
    training, sent_total, last_eval = 0, setup, -1
    start = time.perf_counter()
    if rank == 0:
        memory = (" with error feedback" if options.error_feedback else "") + (
            f", sending {options.select:g} of the boundary rows a step" if selection is not None else "")
        memory += ", the halo's input features fetched once" if options.cache_inputs else ""
        memory += f", gradients all-reduced as {options.gradients}" if options.gradients != "float32" else ""
        log.info("training %d ranks, %s partition, schedule %s, compressor %s%s, %d epochs, evaluating every %d",
                 world, options.partition, options.schedule.kind, options.compressor, memory, recipe.epochs,
                 options.eval_every)
    epoch = 0
    with epoch_loop(run_dir if rank == 0 else None, "varrate", "varrate", options.log, recipe.epochs,
                    desc=f"varrate {options.schedule.kind}", show=rank == 0) as (bar, curves):
        for epoch in range(recipe.epochs):
            traffic = Traffic()
            rate = rates.rate(epoch)
            evaluating = (epoch + 1) % options.eval_every == 0 or epoch + 1 == recipe.epochs
            began = time.perf_counter()
            try:
                model.train()
                exchange = None if rate is None else HaloExchange(part.plan, compressor, rate, recipe.seed, epoch,
                                                                  traffic, feedback=feedback, selection=selection)
                loss = partition_loss(partition_forward(model, part.x, part.plan, exchange, inputs), part)
                optimizer.zero_grad()
                loss.backward()
                allreduce_gradients(model, traffic, GRADIENT_DTYPES[options.gradients])
                optimizer.step()
                step_seconds = time.perf_counter() - began
                scores = [] if not evaluating else _metrics(model, part, HaloExchange(
                    part.plan, compressor, 1.0, recipe.seed, epoch, traffic, evaluating=True), inputs)
                size = 1 + len(Traffic.FIELDS) + len(scores)
                traffic.metrics += ring_allreduce_bytes(size, 8, world, rank)  # this very reduction, float64
                local = torch.tensor([float(loss.detach())] + traffic.values() + scores, dtype=torch.float64,
                                     device=device)
                with collective("metrics all-reduce"):
                    dist.all_reduce(local)
            except PeerFailure as error:
                raise PeerFailure(f"rank {rank}, epoch {epoch}: {error}; another rank died or stalled for more than "
                                  f"{options.timeout:g} s (--timeout) - check its output") from None
            total = local.cpu().tolist()
            rates.observe(total[0])  # the same all-reduced loss on every rank, so the same next ratio
            counts = dict(zip(Traffic.FIELDS, (int(v) for v in total[1:1 + len(Traffic.FIELDS)])))
            training += counts["forward_halo"] + counts["backward_halo"] + counts["allreduce"]
            sent_total += sum(counts.values())
            row: dict[str, Any] = {"epoch": epoch, "rate": rate, "loss": total[0], "train_acc": None,
                                   "val_acc": None, "val_loss": None, "test_acc": None}
            if evaluating:
                train_hits, val_hits, test_hits, val_loss_sum = total[1 + len(Traffic.FIELDS):]
                val = Metrics(val_hits / max(1, n_val), val_loss_sum / max(1, n_val))
                row |= {"train_acc": train_hits / max(1, n_train), "val_acc": val.acc, "val_loss": val.loss,
                        "test_acc": test_hits / max(1, n_test)}
                if best.update(epoch, val, elapsed=epoch - last_eval):
                    best_test = row["test_acc"]
                    if rank == 0:
                        best_state = copy.deepcopy(model.state_dict())
                last_eval = epoch
            if curves is not None:
                checked = Metrics(row["val_acc"], row["val_loss"]) if evaluating else None
                curves.epoch(epoch, k=None, train_loss=total[0], val=checked, lr=optimizer.param_groups[0]["lr"],
                             seconds=time.perf_counter() - start)
            history.append(row | counts | {
                "best_test_acc": best_test, "training_bytes": training, "total_bytes": sent_total,
                "step_seconds": step_seconds, "eval_seconds": time.perf_counter() - began - step_seconds,
            })
            bar.update(1)
            bar.set_postfix(rate="-" if rate is None else f"{rate:.1f}", best=f"{best.best_acc:.3f}",
                            halo=_megabytes(counts["forward_halo"] + counts["backward_halo"]),
                            allreduce=_megabytes(counts["allreduce"]))
            if best.exhausted(recipe.patience) and rates.epochs_final(epoch) >= recipe.patience:
                break
    if rank != 0:
        return None
    assert run_dir is not None
    files = RunDir(run_dir)
    meta = _summary(recipe, options, world, history, best, best_test, epoch + 1, sizes, setup, model)
    meta = finish(model, best_state, files.varrate_model, files.varrate_json, meta | {"run_dir": str(run_dir.resolve())},
                  curves_of=run_dir)
    write_bytes_report(run_dir, f"varrate on {recipe.dataset}: {options.schedule.kind}", [report_entry(meta)])
    return meta


def _gather_sizes(values: list[int], setup_bytes: int, device: torch.device) -> tuple[list[list[int]], int]:
    """Every rank's ``values`` by rank (a sum-reduce of one row per rank) and the setup bytes of all ranks:
    each rank's ``setup_bytes`` plus its share of this reduction."""
    world, rank = dist.get_world_size(), dist.get_rank()
    table = torch.zeros(world, len(values) + 1, dtype=torch.long, device=device)
    sent = setup_bytes + ring_allreduce_bytes(table.numel(), table.element_size(), world, rank)
    table[rank] = torch.tensor([*values, sent], device=device)
    dist.all_reduce(table)
    rows = table.cpu().tolist()
    return [row[:-1] for row in rows], sum(row[-1] for row in rows)


def _summary(recipe: Recipe, options: VarrateOptions, world: int, history: list[dict[str, Any]], best: BestEpoch,
             best_test: float, epochs_run: int, sizes: list[list[int]], setup: int, model: GNN) -> dict[str, Any]:
    def total(key: str) -> int:
        return sum(row[key] for row in history)

    parts = {name: total(name) for name in Traffic.FIELDS}
    evaluations = sum(row["val_acc"] is not None for row in history)
    return {
        "recipe": recipe.to_dict(), "workers": world, "partition": options.partition, "compressor": options.compressor,
        "error_feedback": options.error_feedback, "select": options.select, "cache_inputs": options.cache_inputs,
        "gradients": options.gradients, "versions": library_versions(),
        "schedule": options.schedule.describe(), "device": options.device, "threads": options.threads,
        "eval_every": options.eval_every, "evaluations": evaluations,
        "ranks": [{"rank": r, "owned": s[0], "halo": s[1], "sent": s[2], "train": s[3]} for r, s in enumerate(sizes)],
        "epochs_run": epochs_run, "best_epoch": best.best_epoch, "val_acc": best.best_acc,
        "val_loss": -best.best_neg_loss,
        "test_acc": best_test, "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "bytes": parts | {"setup": setup,
                          "training": parts["forward_halo"] + parts["backward_halo"] + parts["allreduce"],
                          "total": sum(parts.values()) + setup},
        "bytes_convention": "payload bytes each rank sends, summed over ranks; collectives as ring algorithms "
                            "(all-reduce: 2 (K-1)/K x size per rank; see ladle.core.collectives)",
        "seconds_per_epoch": {"step": total("step_seconds") / max(1, len(history)),
                              "eval": total("eval_seconds") / max(1, evaluations)},
        "history": history, "status": "done",
        "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "local",
    }


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.2f}MB"
