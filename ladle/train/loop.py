"""The one-ingredient loop: what one worker does to train one model of a run, and the pieces it shares.

One model is a plain full-batch / mini-batch loop (OGB-example style): Adam, cross-entropy on the
view's training nodes, validation every epoch. A run's models are the ingredients, the full-graph
baseline and, when the recipe has one, the trunk the ingredients branch from and the trunk continued
(:class:`Plan` says how each trains: epochs, learning rate and its schedule, and which weights it keeps:
best validation with early stopping after ``patience`` epochs without improvement (:class:`BestEpoch`,
also used by periodic averaging and varrate), the last, or their mean over the second half). Every
``save_every`` epochs the full state is saved, so an interrupted model resumes bitwise-identically.
The launchers (:mod:`ladle.train.launch`, :mod:`ladle.train.ray_tasks`) build the task list with
:class:`~ladle.train.task.RunSpec` and hand each task to :func:`train_task`.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data

from ladle.core.errors import LadleError
from ladle.core.recipe import IngredientSettings, Recipe, ViewConfig
from ladle.core.rundir import BASELINE, CONTINUED, TRUNK
from ladle.core.seeds import worker_seed
from ladle.core.storage import (
    StateDict,
    load_state,
    load_state_and_metadata,
    save_state,
)
from ladle.core.weights import running_mean
from ladle.graph.inputs import SPARSE_MIN_ENTRIES, GraphInputs, drop_edges, graph_inputs
from ladle.graph.pyg_views import with_sampler
from ladle.graph.sparse import CSRRows, SparseMatrix
from ladle.graph.views import TRUNK_STREAM, IngredientView, build_view
from ladle.nn.models import build_model
from ladle.nn.scoring import Metrics, evaluate
from ladle.train.finish import epoch_loop, finish
from ladle.train.task import INGREDIENT, IngredientTask

log = logging.getLogger(__name__)


# Below this many validation nodes in its view, a model does not select its best epoch: one node is
# then more than 2 points of accuracy (Coauthor Physics' K=8 METIS parts hold about 19); it keeps its
# last weights instead and its metadata says so ("keep", "keep_reason").
MIN_SELECTION_NODES = 50


@dataclass
class BestEpoch:
    """The best validation so far (accuracy, lower loss breaking ties; the earliest epoch wins a tie)
    and the epochs since it last improved, for early stopping."""

    best_acc: float = -1.0
    best_neg_loss: float = 0.0
    best_epoch: int = -1
    stale: int = 0

    @property
    def best_key(self) -> tuple[float, float]:
        return (self.best_acc, self.best_neg_loss)

    def update(self, epoch: int, val: Metrics, elapsed: int = 1) -> bool:
        """Record ``epoch``'s validation; True when it is the new best, else ``stale`` grows by ``elapsed``."""
        if (val.acc, -val.loss) > self.best_key:
            self.best_acc, self.best_neg_loss, self.best_epoch, self.stale = val.acc, -val.loss, epoch, 0
            return True
        self.stale += elapsed
        return False

    def exhausted(self, patience: int) -> bool:
        """Whether ``patience`` epochs have passed without improvement."""
        return self.stale >= patience


def batch_loss(logits: Tensor, batch: Data) -> Tensor:
    """Cross-entropy over the batch's loss nodes, GraphSAINT-weighted when the view gives weights."""
    mask = batch.loss_mask
    losses = F.cross_entropy(logits[mask], batch.y[mask], reduction="none")
    weight = batch.get("loss_weight")
    return (losses * weight[mask]).sum() if weight is not None else losses.mean()


class Teacher:
    """The trunk's predictions on a batch, for ``branch.distill``: a frozen copy of the start, run in eval mode;
    the last batch's log-probabilities are kept, so a static view (one batch, every epoch) computes them once."""

    def __init__(self, model: nn.Module, weight: float) -> None:
        self.model, self.weight = copy.deepcopy(model).eval(), weight
        self._last: tuple[GraphInputs, Tensor] | None = None

    @torch.no_grad()
    def log_probs(self, inputs: GraphInputs) -> Tensor:
        if self._last is None or self._last[0] is not inputs:
            self._last = (inputs, F.log_softmax(self.model(inputs), dim=-1))
        return self._last[1]

    def loss(self, logits: Tensor, inputs: GraphInputs) -> Tensor:
        """``weight`` × KL(trunk ‖ model), averaged over the batch's nodes."""
        return self.weight * F.kl_div(F.log_softmax(logits, dim=-1), self.log_probs(inputs), reduction="batchmean",
                                      log_target=True)


class BatchInputs:
    """Model inputs of a view's batches: built once for static views (``whole`` itself when the batch is
    that graph), every batch for sampled views; a sampled batch of a graph whose features ``whole`` holds
    sparse takes its rows' non-zeros from there (never scanning a dense batch for them)."""

    def __init__(self, view: IngredientView, whole: GraphInputs, model: str, device: torch.device | str) -> None:
        self.view, self.whole, self.model, self.device = view, whole, model, device
        self._static: GraphInputs | None = None
        self._rows = (CSRRows.of(whole.x) if isinstance(whole.x, SparseMatrix) and whole.x.csr.device.type == "cpu"
                      and whole.num_nodes == view.data.num_nodes else None)
        if self._rows is not None:
            view.batch_features = False

    def __call__(self, batch: Data, drop_edge: float = 0.0) -> GraphInputs:
        """``batch``'s inputs; with ``drop_edge`` > 0 (training), its adjacency from the edges that
        :func:`~ladle.graph.inputs.drop_edges` leaves, drawn afresh each call."""
        if not self.view.static:
            features = None if self._rows is None else (
                self._rows.sparse(batch.n_id) if batch.num_nodes * self._rows.shape[1] >= SPARSE_MIN_ENTRIES
                else self._rows(batch.n_id))
            return graph_inputs(drop_edges(batch, drop_edge), self.model, features=features).to(self.device)
        if self._static is None:
            self._static = (self.whole if batch.num_nodes == self.whole.num_nodes
                            else graph_inputs(batch, self.model).to(self.device))
        if not drop_edge:
            return self._static
        return graph_inputs(drop_edges(batch, drop_edge), self.model, features=self._static.x).to(self.device)


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, view: IngredientView, epoch: int,
                inputs: BatchInputs, name: str, device: torch.device | str = "cpu",
                teacher: Teacher | None = None, drop_edge: float = 0.0) -> tuple[float, int]:
    """One epoch of Adam steps over ``view``'s batches (plus ``teacher``'s term; each batch's edges dropped with
    probability ``drop_edge``); return the mean batch loss (NaN when no batch had a loss node) and the optimizer
    steps taken; a non-finite loss raises ``FloatingPointError``."""
    model.train()
    losses: list[float] = []
    for batch in view.batches(epoch):
        batch_input = inputs(batch, drop_edge)
        if not bool(batch.loss_mask.any()):
            continue
        logits = model(batch_input)
        loss = batch_loss(logits, batch.to(device))
        if teacher is not None:
            loss = loss + teacher.loss(logits, batch_input)
        value = loss.item()  # one device sync a batch: the finiteness check and the epoch's mean loss
        if not math.isfinite(value):
            raise FloatingPointError(f"{name}: loss became {value} at epoch {epoch}; "
                                     "lower lr or check the features")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(value)
    return (sum(losses) / len(losses) if losses else float("nan")), len(losses)


AGREEMENT_NODES = 500  # training nodes a model's batch predictions are compared on, at least ...
AGREEMENT_BATCHES = 32  # ... unless this many batches hold fewer


@torch.no_grad()
def view_agreement(model: nn.Module, view: IngredientView, inputs: BatchInputs, whole: GraphInputs,
                   epoch: int) -> float | None:
    """The share of the loss nodes of ``view``'s batches from ``epoch`` on (:data:`AGREEMENT_NODES` of them, or
    those of :data:`AGREEMENT_BATCHES` batches) that ``model`` (eval mode) classifies the same in its batch as in the
    whole graph (``whole``); None for a static view, or batches without loss nodes. A view whose batches
    aggregate unlike the graph gives a model that fits them and fails on the graph: this figure says so without a
    full-graph model to compare with (:mod:`ladle.train.view_check`)."""
    if view.static:
        return None
    model.eval()
    whole_pred = model(whole).argmax(-1).cpu()
    same = total = 0
    batches = (batch for later in range(epoch, epoch + AGREEMENT_BATCHES) for batch in view.batches(later))
    for _, batch in zip(range(AGREEMENT_BATCHES), batches):
        pred = model(inputs(batch)).argmax(-1).cpu()[batch.loss_mask]
        same += int((pred == whole_pred[batch.n_id[batch.loss_mask]]).sum())
        total += pred.numel()
        if total >= AGREEMENT_NODES:
            break
    return same / total if total else None


@dataclass(frozen=True)
class Plan:
    """How one model trains: ``epochs``, Adam's ``lr`` (``constant`` or ``cos``: decayed to 0 along a
    half cosine; epoch e < ``warmup`` scaled by (e + 1) / (warmup + 1)), and the weights it ``keep``s: ``best``
    validation (early stopping after ``patience``), ``last``, or ``swa`` (the running mean of the weights after
    each epoch of the second half)."""

    epochs: int
    lr: float
    schedule: str
    keep: str
    patience: int
    warmup: int = 0

    def lr_at(self, epoch: int) -> float:
        """The learning rate of ``epoch`` (0-based)."""
        lr = self.lr
        if self.schedule == "cos":
            lr = 0.5 * lr * (1.0 + math.cos(math.pi * epoch / self.epochs))
        if epoch < self.warmup:
            lr *= (epoch + 1) / (self.warmup + 1)
        return lr

    @property
    def swa_start(self) -> int:
        """The first epoch whose weights enter the ``swa`` mean."""
        return self.epochs // 2


def plan(recipe: Recipe, task: IngredientTask) -> Plan:
    """The trunk trains ``trunk.*``; the baseline trains ``trunk.epochs + epochs`` at ``lr`` (the same total
    epochs as a trunk and its branches), keeping its best; ingredients train ``epochs`` as ``branch.*`` says,
    and so does the trunk continued, which keeps its best (the counterfactual a branch is measured against)."""
    if task.role == TRUNK:
        return Plan(recipe.trunk.epochs, recipe.trunk.lr, recipe.trunk.schedule, recipe.trunk.keep, recipe.patience)
    if task.role == BASELINE:
        return Plan(recipe.trunk.epochs + recipe.epochs, recipe.lr, "constant", "best", recipe.patience)
    keep = "best" if task.role == CONTINUED else recipe.branch.keep
    return Plan(recipe.epochs, task_settings(recipe, task).lr, recipe.branch.schedule, keep, recipe.patience,
                recipe.branch.warmup)


def task_settings(recipe: Recipe, task: IngredientTask) -> IngredientSettings:
    """Dropout, weight decay, branch learning rate and DropEdge rate of a task: an ingredient's own
    (:meth:`Recipe.ingredient_settings`), the recipe's (and no DropEdge) for every other task."""
    if task.k is not None:
        return recipe.ingredient_settings(task.k)
    return IngredientSettings(recipe.dropout, recipe.weight_decay, recipe.branch_lr)


def from_trunk(recipe: Recipe, task: IngredientTask) -> bool:
    """Whether ``task`` starts from the trunk's weights: ingredients and the trunk continued, when the recipe
    has a trunk."""
    return bool(recipe.trunk.epochs) and task.role in (INGREDIENT, CONTINUED)


def initial_state(recipe: Recipe, task: IngredientTask) -> StateDict | None:
    """The weights a task starts from: the trunk (see :func:`from_trunk`), else the shared init
    (``None``: an independent init, drawn from the task's seed)."""
    if from_trunk(recipe, task):
        return load_state(task.files.weights(TRUNK))
    return load_state(task.files.init) if task.init == "shared" else None


def task_view(recipe: Recipe, task: IngredientTask) -> ViewConfig:
    """The view a task trains on: an ingredient's the recipe's, the trunk's (and its continuation's)
    :meth:`Recipe.trunk_view`, the baseline's the full graph."""
    if task.role == INGREDIENT:
        return recipe.view
    if task.role in (TRUNK, CONTINUED):
        return recipe.trunk_view()
    return type(recipe.view)(kind="full")


def build_task_view(recipe: Recipe, data: Data, task: IngredientTask) -> IngredientView:
    """The view of :func:`task_view`, built on ``data``: an ingredient's batches drawn from its own stream ``k``,
    the trunk's and its continuation's from :data:`TRUNK_STREAM`, so no ingredient replays the trunk's batches."""
    files = task.files
    partition = load_state(files.partition)["parts"] if task.k is not None and files.partition.exists() else None
    return with_sampler(build_view(data, task_view(recipe, task), task.k or 0,
                                   task.num_ingredients if task.k is not None else 1, recipe.seed, partition,
                                   stream=TRUNK_STREAM if task.role in (TRUNK, CONTINUED) else None))


@dataclass
class Progress(BestEpoch):
    """Where a model's training stands; with the tensors, enough to resume bitwise-identically.
    ``averaged``: epochs in the ``swa`` mean so far; ``steps``: optimizer steps so far."""

    next_epoch: int = 0
    seconds: float = 0.0
    averaged: int = 0
    steps: int = 0


def save_progress(task: IngredientTask, model: nn.Module, optimizer: torch.optim.Optimizer, best_state: StateDict,
                  progress: Progress) -> None:
    """One atomic file: weights, kept weights (best or mean), optimiser state, RNG states (CPU, and every
    GPU's when the model is on CUDA: dropout there draws from the GPU's generator), counters (header)."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"best.{k}": v for k, v in best_state.items()}
    optim = optimizer.state_dict()
    for index, slots in optim["state"].items():
        tensors |= {f"optim.{index}.{name}": value for name, value in slots.items()}
    tensors["rng"] = torch.get_rng_state()
    if next(model.parameters()).is_cuda:
        tensors |= {f"rng.cuda.{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())}
    header = {"progress": json.dumps(asdict(progress)), "param_groups": json.dumps(optim["param_groups"])}
    save_state(task.progress_path, tensors, header)


def load_progress(task: IngredientTask, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Progress, StateDict]:
    """Restore what :func:`save_progress` wrote into ``model`` and ``optimizer``; return counters, kept weights.

    A damaged file, or one of another architecture, is a :class:`LadleError` (the caller restores what was
    partly loaded and trains from the start)."""
    tensors, header = load_state_and_metadata(task.progress_path)
    try:
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        state: dict[int, dict[str, Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optim."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = value
        optimizer.load_state_dict({"state": state, "param_groups": json.loads(header["param_groups"])})
        torch.set_rng_state(tensors["rng"])
        cuda_states = [tensors[f"rng.cuda.{i}"] for i in range(sum(k.startswith("rng.cuda.") for k in tensors))]
        if cuda_states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_states[:torch.cuda.device_count()])
        best_state = {k[5:]: v for k, v in tensors.items() if k.startswith("best.")}
        return Progress(**json.loads(header["progress"])), best_state
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        raise LadleError(f"{task.progress_path} does not fit this model ({type(error).__name__})") from None


def train_task(recipe: Recipe, data: Data, task: IngredientTask, full_inputs: GraphInputs | None = None,
                     progress_position: int = 0, device: torch.device | str = "cpu",
                     part_view: IngredientView | None = None) -> dict[str, Any]:
    """Train one model of a run as :func:`plan` says; write its kept weights and metadata; return that.

    Every ``task.save_every`` epochs the full training state is saved; if such a file exists when
    this starts, training resumes from it and ends bitwise-identical to an uninterrupted run.
    ``part_view``: the view of a part shard (:mod:`ladle.graph.shards`), ``data`` being that part alone;
    the val/test metrics in the JSON are then the part's own (``"metrics_on": "part"``).
    """
    start, started_at = time.perf_counter(), time.time()
    files = task.files
    seed = worker_seed(recipe.seed, task.seed_index)
    schedule = plan(recipe, task)
    settings = task_settings(recipe, task)
    # the trunk continued goes on with the trunk's batch stream where the trunk left it
    first_view_epoch = recipe.trunk.epochs if task.role == CONTINUED else 0
    view = part_view if part_view is not None else build_task_view(recipe, data, task)
    torch.manual_seed(seed if task.init == "independent" else recipe.seed)
    model = build_model(recipe.replace(dropout=settings.dropout), data.num_features, data.num_classes, task.model_class)
    start_state = initial_state(recipe, task)
    if start_state is not None:
        model.load_state_dict(start_state)
    torch.manual_seed(seed)
    model.to(device)
    teacher = Teacher(model, recipe.branch.distill) if recipe.branch.distill and from_trunk(recipe, task) else None
    optimizer = torch.optim.Adam(model.parameters(), lr=schedule.lr, weight_decay=settings.weight_decay)
    progress, kept = Progress(), copy.deepcopy(model.state_dict())
    if task.progress_path.exists():
        fresh_optimizer, fresh_rng = copy.deepcopy(optimizer.state_dict()), torch.get_rng_state()
        try:
            progress, kept = load_progress(task, model, optimizer)
            log.info("%s: resuming at epoch %d", task.name, progress.next_epoch)
        except LadleError as error:  # damaged: undo what was partly loaded, train from the start
            log.warning("%s: %s; training it from the start", task.name, error)
            model.load_state_dict(kept)
            optimizer.load_state_dict(fresh_optimizer)
            torch.set_rng_state(fresh_rng)
            task.progress_path.unlink(missing_ok=True)

    if full_inputs is None:
        full_inputs = graph_inputs(data, recipe.model)
    full_inputs = full_inputs.to(device)
    eval_graph = view.eval_graph()
    eval_inputs = full_inputs if eval_graph.num_nodes == data.num_nodes else graph_inputs(
        eval_graph, recipe.model).to(device)
    batch_inputs = BatchInputs(view, eval_inputs, recipe.model, device)
    keep, keep_reason = schedule.keep, ""
    val_nodes = int(eval_graph.val_mask.sum())
    if keep == "best" and val_nodes < MIN_SELECTION_NODES:
        keep = "last"
        keep_reason = (f"{val_nodes} validation nodes in its view (< {MIN_SELECTION_NODES}): too few to select an "
                       "epoch on, kept the last weights")
        log.warning("%s: %s", task.name, keep_reason)
    if keep == "best" and from_trunk(recipe, task) and progress.next_epoch == 0:
        # the trunk's weights are epoch -1 of the selection: a branch never keeps worse than its start
        progress.update(-1, evaluate(model, eval_inputs, eval_graph.y.to(device), eval_graph.val_mask.to(device)))

    with epoch_loop(files.path, task.name, task.role, task.log, schedule.epochs, progress.next_epoch,
                    position=progress_position) as (bar, curves):
        for epoch in range(progress.next_epoch, schedule.epochs):
            if keep == "best" and progress.exhausted(schedule.patience):
                break
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr_at(epoch)
            train_loss, steps = train_epoch(model, optimizer, view, first_view_epoch + epoch, batch_inputs, task.name,
                                            device, teacher, settings.drop_edge)
            val = evaluate(model, eval_inputs, eval_graph.y.to(device), eval_graph.val_mask.to(device))
            curves.epoch(epoch, k=task.k, train_loss=train_loss, val=val, lr=optimizer.param_groups[0]["lr"],
                         seconds=progress.seconds + time.perf_counter() - start)
            if progress.update(epoch, val) and keep == "best":
                kept = copy.deepcopy(model.state_dict())
            if keep == "swa" and epoch >= schedule.swa_start:
                progress.averaged += 1
                kept = running_mean(kept, model.state_dict(), progress.averaged)
            progress.next_epoch, progress.steps = epoch + 1, progress.steps + steps
            if task.save_every and progress.next_epoch % task.save_every == 0 and progress.next_epoch < schedule.epochs:
                save_progress(task, model, optimizer, kept,
                              replace(progress, seconds=progress.seconds + time.perf_counter() - start))
            bar.update(1)
            bar.set_postfix(val=f"{val.acc:.3f}", best=f"{progress.best_acc:.3f}")

    if keep != "last":  # the kept weights, once: the agreement and finish read the model as it is
        model.load_state_dict(kept)
    agreement = (view_agreement(model, view, batch_inputs, eval_inputs, first_view_epoch + schedule.epochs)
                 if eval_graph.num_nodes == data.num_nodes and part_view is None else None)
    meta = finish(model, None, files.weights(task.name), files.meta(task.name), {
        "name": task.name, "role": task.role, "k": task.k, "num_ingredients": task.num_ingredients, "seed": seed,
        "init": task.init, "recipe": recipe.to_dict(), "view": view.describe(),
        "epochs_run": progress.next_epoch, "steps": progress.steps, "best_epoch": progress.best_epoch,
        "view_val_acc": progress.best_acc, "metrics_on": "graph" if part_view is None else "part",
        "plan": asdict(schedule), "settings": asdict(settings), "keep": keep, "keep_reason": keep_reason,
        "view_val_nodes": val_nodes, "view_agreement": agreement,
        "start": TRUNK if from_trunk(recipe, task) else task.init,
        "train_seconds": progress.seconds + time.perf_counter() - start, "pid": os.getpid(),
        "started_at": started_at, "ended_at": time.time(),  # this process's epochs (a resumed run's: since resuming)
        "process_group": bool(torch.distributed.is_available() and torch.distributed.is_initialized()),
    }, scored_on=(full_inputs, data))
    task.progress_path.unlink(missing_ok=True)
    return meta
