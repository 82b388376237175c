"""Periodic model averaging (Zhu et al., 2023, random-partition model aggregation): the one mode where
ingredients communicate.

K trainers each train on their own view (Zhu et al.: ``view.kind=random``, part ``k`` of a random
K-way partition) and every ``average_every`` epochs all weights are replaced by their mean,
``θ_k <- (1/K) Σ_j θ_j``; each trainer keeps its own Adam moments. The trainers run in one process in
lockstep, an in-process stand-in for an all-reduce: each keeps its own RNG stream (saved and restored
around its epoch), so trainer ``k`` draws exactly the dropout masks that ingredient ``k`` of
:func:`ladle.train.loop.train_task` draws, and K = 1 trains bitwise like it. Communication is counted
as a ring all-reduce would send it (:func:`ladle.core.collectives.ring_allreduce_bytes`, the convention of
``ladle.varrate``): about ``2 (K - 1) / K`` model sizes per trainer, exactly ``2 (K - 1) × model_bytes``
over all trainers per average (model bytes: every floating-point entry of the state dict).
The averaged model is validated on the full graph after each average; the best one is kept (early
stopping after ``patience`` epochs without improvement, as for ingredients).
"""
from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch_geometric.data import Data
from tqdm import tqdm

from ladle.core.collectives import ring_allreduce_bytes
from ladle.core.errors import LadleError
from ladle.core.recipe import Recipe
from ladle.core.rundir import AVERAGED, RunDir
from ladle.core.seeds import worker_seed
from ladle.core.storage import StateDict
from ladle.core.weights import average
from ladle.graph.inputs import GraphInputs, graph_inputs
from ladle.graph.pyg_views import with_sampler
from ladle.graph.views import IngredientView, build_view
from ladle.nn.models import GNN, build_model
from ladle.nn.scoring import evaluate
from ladle.train.curves import EpochLogger, check_loggers
from ladle.train.finish import epoch_loop, finish
from ladle.train.loop import BatchInputs, BestEpoch, train_epoch
from ladle.train.task import check_ingredients

log = logging.getLogger(__name__)


class _Trainer:
    """One of the K trainers: its view, model, optimiser and RNG stream (as ``train_task`` sets them)."""

    def __init__(self, recipe: Recipe, data: Data, view: IngredientView, init: StateDict,
                 full_inputs: GraphInputs) -> None:
        self.view = view
        self.model: GNN = build_model(recipe, data.num_features, data.num_classes)
        self.model.load_state_dict(init)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
        self.inputs = BatchInputs(view, full_inputs, recipe.model, "cpu")
        torch.manual_seed(worker_seed(recipe.seed, view.k))
        self.rng = torch.get_rng_state()

    def train_epoch(self, epoch: int) -> float:
        """One epoch over this trainer's batches, on its own RNG stream; return its mean training loss."""
        torch.set_rng_state(self.rng)
        loss, _ = train_epoch(self.model, self.optimizer, self.view, epoch, self.inputs,
                              f"averaging trainer {self.view.k}")
        self.rng = torch.get_rng_state()
        return loss


def average_models(models: list[GNN]) -> int:
    """Set every model's floating-point state to the mean over models (:func:`ladle.core.weights.average`;
    in place, so optimisers keep their parameters); return the bytes of one model's averaged state."""
    states = [m.state_dict() for m in models]
    sent = 0
    with torch.no_grad():
        mean = average(states)
        for key, first in states[0].items():
            if not first.is_floating_point():
                continue
            for state in states:
                state[key].copy_(mean[key])
            sent += first.numel() * first.element_size()
    return sent


def check_averaging(ingredients: int, average_every: int) -> None:
    """Refuse fewer than one trainer or an averaging period under one epoch (a user error)."""
    check_ingredients(ingredients)
    if average_every < 1:
        raise LadleError(f"--average-every must be >= 1 epoch, got {average_every}")


def train_with_averaging(recipe: Recipe, data: Data, ingredients: int, average_every: int,
                         run_dir: Path, log: tuple[str, ...] = ()) -> dict[str, Any]:
    """Train ``ingredients`` trainers for ``recipe.epochs`` epochs, averaging every ``average_every``
    epochs (and after the last); write the ``averaged`` weights (best averaged model on validation) and
    metadata (val/test accuracy, bytes, epochs, seconds) into ``run_dir``; return the metadata.

    Every trainer's curve goes to ``metrics-averaged.csv`` (role ``averaged``, ``k`` the trainer; the
    validation of the averaged model at each average), merged into ``run_dir``'s ``metrics.csv``;
    ``log``: loggers besides the CSV (:mod:`ladle.train.curves`)."""
    check_averaging(ingredients, average_every)
    check_loggers(log)
    start = time.perf_counter()
    files = RunDir(run_dir)
    full_inputs = graph_inputs(data, recipe.model)
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG state is left as it was
        torch.manual_seed(recipe.seed)
        init = build_model(recipe, data.num_features, data.num_classes).state_dict()
        first = with_sampler(build_view(data, recipe.view, 0, ingredients, recipe.seed))
        partition = getattr(first, "parts", None)  # partition views share one partition, computed once
        views = [first] + [with_sampler(build_view(data, recipe.view, k, ingredients, recipe.seed, partition))
                           for k in range(1, ingredients)]
        trainers = [_Trainer(recipe, data, view, init, full_inputs) for view in views]
        with epoch_loop(run_dir, AVERAGED, "averaged", log, recipe.epochs, desc=f"averaging K={ingredients}") as (
                bar, curves):
            meta = _lockstep(recipe, data, trainers, average_every, full_inputs, bar, curves)
    best_state = meta.pop("best_state")
    return finish(trainers[0].model, best_state, files.weights(AVERAGED), files.meta(AVERAGED), meta | {
        "name": AVERAGED, "ingredients": ingredients, "average_every": average_every, "recipe": recipe.to_dict(),
        "views": [t.view.describe() for t in trainers], "lockstep": "in-process",
        "bytes_formula": "ring all-reduce, summed over trainers: 2 (K - 1) x model_bytes per average "
                         "(ladle.core.collectives)",
        "seconds": time.perf_counter() - start,
    }, scored_on=(full_inputs, data), curves_of=run_dir)


def _lockstep(recipe: Recipe, data: Data, trainers: list[_Trainer], average_every: int,
              full_inputs: GraphInputs, bar: tqdm, curves: EpochLogger) -> dict[str, Any]:
    """Step every trainer one epoch at a time; average and validate every ``average_every`` epochs; log a
    row per trainer and epoch."""
    start = time.perf_counter()
    models = [t.model for t in trainers]
    best, averages, sent, model_bytes, last_average = BestEpoch(), 0, 0, 0, -1
    best_state: StateDict = copy.deepcopy(models[0].state_dict())
    history: list[dict[str, Any]] = []
    for epoch in range(recipe.epochs):
        if best.exhausted(recipe.patience):
            break
        losses = [trainer.train_epoch(epoch) for trainer in trainers]
        bar.update(1)
        val = None
        if (epoch + 1) % average_every == 0 or epoch + 1 == recipe.epochs:
            model_bytes = average_models(models)
            averages += 1
            # every trainer's ring share; their sum, 2 (K - 1) x model_bytes, does not depend on the chunking
            sent += sum(ring_allreduce_bytes(model_bytes, 1, len(trainers), k) for k in range(len(trainers)))
            val = evaluate(models[0], full_inputs, data.y, data.val_mask)
            history.append({"epoch": epoch, "val_acc": val.acc, "val_loss": val.loss, "bytes": sent})
            if best.update(epoch, val, elapsed=epoch - last_average):  # stale: epochs since the previous average
                best_state = copy.deepcopy(models[0].state_dict())
            last_average = epoch
            bar.set_postfix(val=f"{val.acc:.3f}", best=f"{best.best_acc:.3f}", sent=f"{sent / 1e6:.1f}MB")
        seconds = time.perf_counter() - start
        for trainer, loss in zip(trainers, losses):
            curves.epoch(epoch, k=trainer.view.k, train_loss=loss, val=val,
                         lr=trainer.optimizer.param_groups[0]["lr"], seconds=seconds)
    return {"best_state": best_state, "best_epoch": best.best_epoch, "epochs_run": last_average + 1,
            "averages": averages, "model_bytes": model_bytes, "bytes": sent, "history": history}
