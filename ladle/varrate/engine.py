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
from tqdm import tqdm

from ladle.checkpoints import save_state, write_json
from ladle.config import Recipe
from ladle.engine import BestEpoch
from ladle.errors import LadleError
from ladle.evaluation import Metrics, metric_sums
from ladle.models import GNN, Features, GCNLayer, SAGELayer, build_model, project_features, use_sparse_features
from ladle.report import report_entry, write_bytes_report
from ladle.rundir import RunDir
from ladle.sparse import SparseMatrix
from ladle.varrate.compression import RateSchedule, build_compressor
from ladle.varrate.halo import HaloExchange, HaloPlan, PeerFailure, Traffic, build_plan, collective

log = logging.getLogger(__name__)

SUPPORTED_MODELS = ("gcn", "sage")


def check_model(recipe: Recipe) -> None:
    """varrate drives GCN and SAGE layers and per-node norms; anything else is a user error."""
    if recipe.model not in SUPPORTED_MODELS:
        raise LadleError(f"varrate supports gcn/sage; got model={recipe.model} (use model=gcn or model=sage)")
    if recipe.norm == "batch":
        raise LadleError("varrate supports norm=none or norm=layer (batch norm would need statistics "
                         "synchronised across ranks)")


def partition_forward(model: GNN, x: Features, plan: HaloPlan, exchange: HaloExchange | None) -> Tensor:
    """Logits of the owned nodes: each layer projects the owned rows, appends the halo rows it
    receives and aggregates with the plan's rows of ``Â`` (``exchange=None``: the induced subgraph)."""
    h: Features = x
    adj = plan.adj if exchange is not None else plan.induced_adj
    last = len(model.convs) - 1
    for i, conv in enumerate(model.convs):
        if isinstance(conv, GCNLayer):
            out = adj.matmul(_with_halo(project_features(h, conv.lin), exchange, i))
            out = out + conv.bias if conv.bias is not None else out
        elif isinstance(conv, SAGELayer):
            out = adj.matmul(_with_halo(project_features(h, conv.lin_l), exchange, i)) + conv.lin_l.bias
            out = out + project_features(h, conv.lin_r)
        else:
            raise LadleError(f"varrate supports gcn/sage; got a {type(conv).__name__} layer")
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

    ``totals`` are the whole graph's train / val / test counts: losses and accuracies divide by them.
    """

    plan: HaloPlan
    x: Features
    y: Tensor
    train: Tensor
    val: Tensor
    test: Tensor
    totals: tuple[int, int, int]
    num_classes: int

    @classmethod
    def build(cls, data: Data, parts: Tensor, rank: int, world: int, model: str,
              device: torch.device | str = "cpu") -> RankData:
        """Slice ``data`` for ``rank``; features go sparse when the whole matrix would (as in ladle.engine)."""
        plan = build_plan(data.edge_index, data.num_nodes, parts, rank, world, model)
        x = data.x[plan.owned]
        features: Features = SparseMatrix.from_dense(x) if use_sparse_features(data.x, model) else x
        totals = (int(data.train_mask.sum()), int(data.val_mask.sum()), int(data.test_mask.sum()))
        masks = [data[key][plan.owned].to(device) for key in ("train_mask", "val_mask", "test_mask")]
        return cls(plan.to(device), features.to(device), data.y[plan.owned].to(device), *masks, totals,
                   int(data.num_classes))


def partition_loss(logits: Tensor, part: RankData) -> Tensor:
    """This rank's share of the full-graph mean training loss: ``sum(ce over own train nodes) / |V_train|``.

    Summed over ranks (the gradient all-reduce), the gradients are those of the full-graph mean.
    """
    return F.cross_entropy(logits[part.train], part.y[part.train], reduction="sum") / max(1, part.totals[0])


def allreduce_gradients(model: GNN, traffic: Traffic) -> None:
    """Sum every parameter's gradient over ranks in one flat ``all_reduce``; count it as one model size sent."""
    params = list(model.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    with collective("gradient all-reduce"):
        dist.all_reduce(flat)
    traffic.allreduce += flat.numel() * flat.element_size()
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


@dataclass(frozen=True)
class VarrateOptions:
    """Settings of a varrate run besides the recipe (the command line's flags)."""

    ranks: int = 4
    partition: str = "metis"
    schedule: RateSchedule = field(default_factory=RateSchedule)
    compressor: str = "truncate"
    device: str = "cpu"
    timeout: float = 300.0
    threads: int = 0  # 0: cores / ranks on this machine


def _metrics(model: GNN, part: RankData, exchange: HaloExchange) -> list[float]:
    """This rank's correct train, val and test predictions and val loss sum (exact exchange, no dropout)."""
    model.eval()
    with torch.no_grad():
        logits = partition_forward(model, part.x, part.plan, exchange)
    train, _ = metric_sums(logits[part.train], part.y[part.train])
    val, val_loss = metric_sums(logits[part.val], part.y[part.val])
    test, _ = metric_sums(logits[part.test], part.y[part.test])
    return [train, val, test, val_loss]


def train_partition(recipe: Recipe, part: RankData, options: VarrateOptions,
                    run_dir: Path | None) -> dict[str, Any] | None:
    """Train one rank's side of the run (call on every rank of an initialised process group).

    Adam on the rank's share of the loss, gradients all-reduced, validation and test accuracy from an
    exact exchange, summed over ranks; the best-validation epoch's weights and test accuracy are
    kept, with early stopping after ``patience`` epochs. Rank 0 writes the weights, the metadata and
    the report into ``run_dir`` (:class:`~ladle.rundir.RunDir`) and returns the metadata; other ranks
    return None.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = part.y.device
    compressor = build_compressor(options.compressor)
    torch.manual_seed(recipe.seed)  # the soup's shared initialisation, identical on every rank
    model = build_model(recipe, part.x.shape[1], part.num_classes).to(device)
    torch.manual_seed(recipe.seed * 1_000 + rank)  # dropout differs by rank
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sizes = _gather_rows([*part.plan.describe().values(), int(part.train.sum())], device)
    n_train, n_val, n_test = part.totals

    history: list[dict[str, Any]] = []
    best, best_state, best_test = BestEpoch(), copy.deepcopy(model.state_dict()), 0.0
    cumulative = 0
    bar = tqdm(total=recipe.epochs, desc=f"varrate {options.schedule.kind}", dynamic_ncols=True,
               disable=True if rank != 0 else None)
    if rank == 0:
        log.info("training %d ranks, %s partition, schedule %s, compressor %s, %d epochs", world, options.partition,
                 options.schedule.kind, options.compressor, recipe.epochs)
    epoch = 0
    for epoch in range(recipe.epochs):
        traffic = Traffic()
        rate = options.schedule.rate(epoch, recipe.epochs)
        began = time.perf_counter()
        try:
            model.train()
            exchange = None if rate is None else HaloExchange(part.plan, compressor, rate, recipe.seed, epoch, traffic)
            loss = partition_loss(partition_forward(model, part.x, part.plan, exchange), part)
            optimizer.zero_grad()
            loss.backward()
            allreduce_gradients(model, traffic)
            optimizer.step()
            step_seconds = time.perf_counter() - began
            exact = HaloExchange(part.plan, compressor, 1.0, recipe.seed, epoch, traffic, evaluating=True)
            local = torch.tensor(_metrics(model, part, exact) + [float(loss.detach())] + traffic.values(),
                                 dtype=torch.float64, device=device)
            with collective("metrics all-reduce"):
                dist.all_reduce(local)
        except PeerFailure as error:
            bar.close()
            raise PeerFailure(f"rank {rank}, epoch {epoch}: {error}; another rank died or stalled for more than "
                              f"{options.timeout:g} s (--timeout) - check its output") from None
        total = local.cpu().tolist()
        val_acc, val_loss = total[1] / max(1, n_val), total[3] / max(1, n_val)
        test_acc = total[2] / max(1, n_test)
        forward, backward, allreduce, eval_halo = (int(v) for v in total[5:9])
        cumulative += forward + backward + allreduce
        if best.update(epoch, Metrics(val_acc, val_loss)):
            best_test = test_acc
            if rank == 0:
                best_state = copy.deepcopy(model.state_dict())
        history.append({
            "epoch": epoch, "rate": rate, "loss": total[4], "train_acc": total[0] / max(1, n_train),
            "val_acc": val_acc, "val_loss": val_loss, "test_acc": test_acc, "best_test_acc": best_test,
            "forward_halo": forward, "backward_halo": backward, "allreduce": allreduce, "eval_halo": eval_halo,
            "training_bytes": cumulative, "step_seconds": step_seconds,
            "eval_seconds": time.perf_counter() - began - step_seconds,
        })
        bar.update(1)
        bar.set_postfix(rate="-" if rate is None else f"{rate:.1f}", val=f"{val_acc:.3f}", best=f"{best.best_acc:.3f}",
                        halo=_megabytes(forward + backward), allreduce=_megabytes(allreduce))
        if best.exhausted(recipe.patience):
            break
    bar.close()
    if rank != 0:
        return None
    assert run_dir is not None
    files = RunDir(run_dir)
    model.load_state_dict(best_state)
    save_state(files.varrate_model, model.state_dict())
    meta = _summary(recipe, options, world, history, best, best_test, epoch + 1, sizes, model)
    meta["run_dir"] = str(run_dir.resolve())
    write_json(files.varrate_json, meta)
    write_bytes_report(run_dir, f"varrate on {recipe.dataset}: {options.schedule.kind}", [report_entry(meta)])
    return meta


def _gather_rows(values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``values``, as a list by rank (a sum-reduce of one row per rank)."""
    table = torch.zeros(dist.get_world_size(), len(values), dtype=torch.long, device=device)
    table[dist.get_rank()] = torch.tensor(values, device=device)
    dist.all_reduce(table)
    return table.cpu().tolist()


def _summary(recipe: Recipe, options: VarrateOptions, world: int, history: list[dict[str, Any]], best: BestEpoch,
             best_test: float, epochs_run: int, sizes: list[list[int]], model: GNN) -> dict[str, Any]:
    def total(key: str) -> int:
        return sum(row[key] for row in history)

    return {
        "recipe": recipe.to_dict(), "workers": world, "partition": options.partition, "compressor": options.compressor,
        "schedule": options.schedule.describe(), "device": options.device, "threads": options.threads,
        "ranks": [{"rank": r, "owned": s[0], "halo": s[1], "sent": s[2], "train": s[3]} for r, s in enumerate(sizes)],
        "epochs_run": epochs_run, "best_epoch": best.best_epoch, "val_acc": best.best_acc,
        "val_loss": -best.best_neg_loss,
        "test_acc": best_test, "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "bytes": {"forward_halo": total("forward_halo"), "backward_halo": total("backward_halo"),
                  "allreduce": total("allreduce"), "eval_halo": total("eval_halo"),
                  "training": history[-1]["training_bytes"] if history else 0},
        "seconds_per_epoch": {"step": total("step_seconds") / max(1, len(history)),
                              "eval": total("eval_seconds") / max(1, len(history))},
        "history": history, "status": "done",
        "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "local",
    }


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.2f}MB"
