"""``python -m ladle.train``: train K ingredients, each alone on its own view of the graph.

One ingredient is a plain full-batch / mini-batch loop (OGB-example style): Adam, cross-entropy on
the view's training nodes, validation every epoch, the best-validation weights kept, early stopping
after ``patience`` epochs without improvement. Ingredients never talk to each other; the launcher
(:mod:`ladle.launch`) only starts them and collects their metadata.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import resource
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.data import Data
from tqdm import tqdm

from ladle.checkpoints import (StateDict, ingredient_name, load_state, load_state_and_metadata, save_state,
                               write_json)
from ladle.config import Recipe, add_recipe_arguments, recipe_from_args
from ladle.errors import LadleError, run_cli
from ladle.models import GNN, GraphInputs, build_model, graph_inputs
from ladle.views import IngredientView, build_view

log = logging.getLogger(__name__)


def ingredient_seed(base_seed: int, k: int) -> int:
    """The seed of ingredient ``k`` of a run seeded ``base_seed`` (the baseline uses k = -1)."""
    return base_seed * 1_000 + k + 1


@torch.no_grad()
def evaluate(model: GNN, inputs: GraphInputs, y: Tensor, mask: Tensor) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``model`` on the nodes in ``mask``."""
    model.eval()
    logits = model(inputs)[mask]
    target = y[mask]
    if target.numel() == 0:
        return 0.0, float("inf")
    accuracy = (logits.argmax(dim=-1) == target).float().mean().item()
    return accuracy, F.cross_entropy(logits, target).item()


def batch_loss(logits: Tensor, batch: Data) -> Tensor:
    """Cross-entropy over the batch's loss nodes, GraphSAINT-weighted when the view gives weights."""
    mask = batch.loss_mask
    losses = F.cross_entropy(logits[mask], batch.y[mask], reduction="none")
    weight = batch.get("loss_weight")
    return (losses * weight[mask]).sum() if weight is not None else losses.mean()


class BatchInputs:
    """Model inputs of a view's batches: built once for static views (``whole`` itself when the batch is
    that graph), every batch for sampled views."""

    def __init__(self, view: IngredientView, whole: GraphInputs, model: str, device: torch.device | str) -> None:
        self.view, self.whole, self.model, self.device = view, whole, model, device
        self._static: GraphInputs | None = None

    def __call__(self, batch: Data) -> GraphInputs:
        if not self.view.static:
            return graph_inputs(batch, self.model).to(self.device)
        if self._static is None:
            self._static = (self.whole if batch.num_nodes == self.whole.num_nodes
                            else graph_inputs(batch, self.model).to(self.device))
        return self._static


def train_epoch(model: GNN, optimizer: torch.optim.Optimizer, view: IngredientView, epoch: int,
                inputs: BatchInputs, name: str, device: torch.device | str = "cpu") -> None:
    """One epoch of Adam steps over ``view``'s batches; a non-finite loss raises ``FloatingPointError``."""
    model.train()
    for batch in view.batches(epoch):
        batch_input = inputs(batch)
        if not bool(batch.loss_mask.any()):
            continue
        loss = batch_loss(model(batch_input), batch.to(device))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{name}: loss became {loss.item()} at epoch {epoch}; "
                                     "lower lr or check the features")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def peak_rss_mb() -> float:
    """This process's own peak resident memory, in MiB (``VmHWM``: ``ru_maxrss`` inherits the parent's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class IngredientTask:
    """What one worker needs to train one ingredient (or the full-graph baseline when ``k`` is None)."""

    k: int | None
    num_ingredients: int
    run_dir: Path
    init: str  # "shared" | "independent"
    save_every: int = 10  # epochs between resumable progress checkpoints (0: never)

    @property
    def name(self) -> str:
        return "baseline" if self.k is None else ingredient_name(self.k)

    @property
    def progress_path(self) -> Path:
        return self.run_dir / f"{self.name}.progress.safetensors"


@dataclass
class Progress:
    """Where an ingredient's training stands; with the tensors, enough to resume bitwise-identically."""

    next_epoch: int = 0
    best_acc: float = -1.0
    best_neg_loss: float = 0.0
    best_epoch: int = -1
    stale: int = 0
    seconds: float = 0.0

    @property
    def best_key(self) -> tuple[float, float]:
        return (self.best_acc, self.best_neg_loss)


def save_progress(task: IngredientTask, model: GNN, optimizer: torch.optim.Optimizer, best_state: StateDict,
                  progress: Progress) -> None:
    """One atomic file: weights, best weights, optimiser state, RNG state, counters (in the header)."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"best.{k}": v for k, v in best_state.items()}
    optim = optimizer.state_dict()
    for index, slots in optim["state"].items():
        tensors |= {f"optim.{index}.{name}": value for name, value in slots.items()}
    tensors["rng"] = torch.get_rng_state()
    header = {"progress": json.dumps(asdict(progress)), "param_groups": json.dumps(optim["param_groups"])}
    save_state(task.progress_path, tensors, header)


def load_progress(task: IngredientTask, model: GNN, optimizer: torch.optim.Optimizer) -> tuple[Progress, StateDict]:
    """Restore what :func:`save_progress` wrote into ``model`` and ``optimizer``; return counters, best weights."""
    tensors, header = load_state_and_metadata(task.progress_path)
    try:
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    except RuntimeError:
        raise LadleError(f"{task.progress_path} was written by another architecture; delete it to restart") from None
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": json.loads(header["param_groups"])})
    torch.set_rng_state(tensors["rng"])
    best_state = {k[5:]: v for k, v in tensors.items() if k.startswith("best.")}
    return Progress(**json.loads(header["progress"])), best_state


def train_ingredient(recipe: Recipe, data: Data, task: IngredientTask, full_inputs: GraphInputs | None = None,
                     progress_position: int = 0, device: torch.device | str = "cpu",
                     part_view: IngredientView | None = None) -> dict[str, Any]:
    """Train one ingredient to its best-validation weights; write them and their metadata; return it.

    Every ``task.save_every`` epochs the full training state is saved; if such a file exists when
    this starts, training resumes from it and ends bitwise-identical to an uninterrupted run.
    ``part_view``: the view of a part shard (:mod:`ladle.shards`), ``data`` being that part alone;
    the val/test metrics in the JSON are then the part's own (``"metrics_on": "part"``).
    """
    start = time.perf_counter()
    k = -1 if task.k is None else task.k
    seed = ingredient_seed(recipe.seed, k)
    view_config = recipe.view if task.k is not None else type(recipe.view)(kind="full")
    if part_view is not None:
        view = part_view
    else:
        partition_path = task.run_dir / "partition.safetensors"
        partition = load_state(partition_path)["parts"] if task.k is not None and partition_path.exists() else None
        view = build_view(data, view_config, max(k, 0), task.num_ingredients if task.k is not None else 1,
                          recipe.seed, partition)
    torch.manual_seed(seed if task.init == "independent" else recipe.seed)
    model = build_model(recipe, data.num_features, data.num_classes)
    if task.init == "shared":
        model.load_state_dict(load_state(task.run_dir / "init.safetensors"))
    torch.manual_seed(seed)
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    if task.progress_path.exists():
        progress, best_state = load_progress(task, model, optimizer)
        log.info("%s: resuming at epoch %d", task.name, progress.next_epoch)
    else:
        progress, best_state = Progress(), copy.deepcopy(model.state_dict())

    if full_inputs is None:
        full_inputs = graph_inputs(data, recipe.model)
    full_inputs = full_inputs.to(device)
    eval_graph = view.eval_graph()
    eval_inputs = full_inputs if eval_graph.num_nodes == data.num_nodes else graph_inputs(
        eval_graph, recipe.model).to(device)
    batch_inputs = BatchInputs(view, eval_inputs, recipe.model, device)

    bar = tqdm(total=recipe.epochs, initial=progress.next_epoch, desc=task.name, position=progress_position,
               leave=False, dynamic_ncols=True, disable=None)
    for epoch in range(progress.next_epoch, recipe.epochs):
        if progress.stale >= recipe.patience:
            break
        try:
            train_epoch(model, optimizer, view, epoch, batch_inputs, task.name, device)
        except FloatingPointError:
            bar.close()
            raise
        val_acc, val_loss = evaluate(model, eval_inputs, eval_graph.y.to(device), eval_graph.val_mask.to(device))
        if (val_acc, -val_loss) > progress.best_key:
            progress.best_acc, progress.best_neg_loss, progress.best_epoch, progress.stale = (
                val_acc, -val_loss, epoch, 0)
            best_state = copy.deepcopy(model.state_dict())
        else:
            progress.stale += 1
        progress.next_epoch = epoch + 1
        if task.save_every and progress.next_epoch % task.save_every == 0 and progress.next_epoch < recipe.epochs:
            save_progress(task, model, optimizer, best_state,
                          replace(progress, seconds=progress.seconds + time.perf_counter() - start))
        bar.update(1)
        bar.set_postfix(val=f"{val_acc:.3f}", best=f"{progress.best_acc:.3f}")
    bar.close()

    model.load_state_dict(best_state)
    val_acc, val_loss = evaluate(model, full_inputs, data.y.to(device), data.val_mask.to(device))
    test_acc, _ = evaluate(model, full_inputs, data.y.to(device), data.test_mask.to(device))
    save_state(task.run_dir / f"{task.name}.safetensors", model.state_dict())
    meta = {
        "name": task.name, "k": task.k, "num_ingredients": task.num_ingredients, "seed": seed,
        "init": task.init, "recipe": recipe.to_dict(), "view": {"kind": view_config.kind, **view.describe()},
        "epochs_run": progress.next_epoch, "best_epoch": progress.best_epoch, "view_val_acc": progress.best_acc,
        "val_acc": val_acc, "val_loss": val_loss, "test_acc": test_acc,
        "metrics_on": "graph" if part_view is None else "part",
        "train_seconds": progress.seconds + time.perf_counter() - start, "peak_rss_mb": peak_rss_mb(),
        "pid": os.getpid(), "threads": torch.get_num_threads(),
        "process_group": bool(torch.distributed.is_available() and torch.distributed.is_initialized()),
        "status": "done",
    }
    write_json(task.run_dir / f"{task.name}.json", meta)
    task.progress_path.unlink(missing_ok=True)
    return meta


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ladle.train`` command line."""
    parser = argparse.ArgumentParser(
        prog="python -m ladle.train",
        description="Train K GNN ingredients, each in its own process with no communication.",
        epilog="Any recipe key can be overridden as key=value, e.g. dataset=citeseer view.kind=metis epochs=50",
    )
    add_recipe_arguments(parser)
    parser.add_argument("--ingredients", "-k", type=int, default=8, help="number of ingredients K (default 8)")
    parser.add_argument("--workers", "-w", type=int, default=None,
                        help="processes training at once (default: min(K, cores))")
    parser.add_argument("--run-dir", type=Path, help="output folder (default checkpoints/<recipe>-<time>)")
    init = parser.add_mutually_exclusive_group()
    init.add_argument("--shared-init", dest="init", action="store_const", const="shared",
                      help="all ingredients start from the same weights (default)")
    init.add_argument("--independent-init", dest="init", action="store_const", const="independent",
                      help="each ingredient draws its own initial weights")
    parser.set_defaults(init="shared")
    parser.add_argument("--resume", action="store_true",
                        help="finish an interrupted run (--run-dir, default checkpoints/latest); recipe flags are ignored")
    parser.add_argument("--save-every", type=int, default=10, metavar="N",
                        help="save the resumable training state every N epochs (default 10, 0: never)")
    parser.add_argument("--average-every", type=int, metavar="T",
                        help="instead of independent ingredients: K trainers whose weights are averaged every T "
                             "epochs (periodic averaging, the one mode that communicates); writes averaged.*")
    parser.add_argument("--baseline", action="store_true",
                        help="also train one full-graph model for the same epochs (the soup's reference)")
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"), help="where to train")
    parser.add_argument("--backend", default="local", choices=("local", "ray"),
                        help="local worker processes (default) or a Ray cluster (pip install 'ladle[ray]')")
    parser.add_argument("--address", help="Ray cluster address (auto, HOST:PORT); default: start a local one")
    parser.add_argument("--cpus-per-ingredient", type=float, default=1.0, help="Ray: CPUs per ingredient task")
    parser.add_argument("--gpus-per-ingredient", type=float, default=0.0, help="Ray: GPUs per ingredient task")
    parser.add_argument("--gather", action="store_true",
                        help="Ray: return weights to the driver and write them there (no shared storage needed)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ladle.train``."""
    from ladle.launch import resume_run, train_ingredients

    args = build_parser().parse_args(argv)
    ray_options = {"address": args.address, "cpus": args.cpus_per_ingredient, "gpus": args.gpus_per_ingredient,
                   "gather": args.gather}
    if args.save_every < 0:
        raise LadleError(f"--save-every must be >= 0, got {args.save_every}")
    if args.resume:
        run = resume_run(args.run_dir, args.workers, args.data_root, ray_options=ray_options)
        print(run.summary_table())
        print(f"run directory: {run.run_dir}")
        return 0 if not run.failed else 1
    recipe = recipe_from_args(args)
    if args.average_every is not None:
        return _train_averaged(recipe, args)
    run = train_ingredients(recipe, ingredients=args.ingredients, workers=args.workers, run_dir=args.run_dir,
                            init=args.init, baseline=args.baseline, data_root=args.data_root, device=args.device,
                            backend=args.backend, ray_options=ray_options, save_every=args.save_every)
    print(run.summary_table())
    print(f"run directory: {run.run_dir}")
    return 0 if not run.failed else 1


def _train_averaged(recipe: Recipe, args: argparse.Namespace) -> int:
    """``--average-every T``: periodic averaging into ``--run-dir`` (an ingredient run's, to compare)."""
    from ladle.averaging import train_with_averaging
    from ladle.data import load_dataset

    torch.set_num_threads(args.workers or torch.get_num_threads())
    data = load_dataset(recipe.dataset, args.data_root, recipe.split, recipe.features)
    run_dir = args.run_dir or Path("checkpoints") / f"{recipe.name}-averaged-every-{args.average_every}"
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = train_with_averaging(recipe, data, args.ingredients, args.average_every, run_dir)
    print(f"averaged every {args.average_every} epochs, K={args.ingredients}: val {meta['val_acc']:.4f} "
          f"test {meta['test_acc']:.4f}, {meta.get('bytes', 0) / 1e6:.1f} MB sent, {meta['seconds']:.1f} s")
    print(f"written: {run_dir / 'averaged.safetensors'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
