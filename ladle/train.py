"""``python -m ladle.train``: train K ingredients, each alone on its own view of the graph.

One ingredient is a plain full-batch / mini-batch loop (OGB-example style): Adam, cross-entropy on
the view's training nodes, validation every epoch, the best-validation weights kept, early stopping
after ``patience`` epochs without improvement. Ingredients never talk to each other; the launcher
(:mod:`ladle.launch`) only starts them and collects their metadata.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.data import Data
from tqdm import tqdm

from ladle.checkpoints import ingredient_name, save_state, write_json
from ladle.config import Recipe, load_recipe
from ladle.errors import LadleError, run_cli
from ladle.models import GNN, GraphInputs, build_model, graph_inputs
from ladle.views import build_view

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


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class IngredientTask:
    """What one worker needs to train one ingredient (or the full-graph baseline when ``k`` is None)."""

    k: int | None
    num_ingredients: int
    run_dir: Path
    init: str  # "shared" | "independent"

    @property
    def name(self) -> str:
        return "baseline" if self.k is None else ingredient_name(self.k)


def train_ingredient(recipe: Recipe, data: Data, task: IngredientTask, full_inputs: GraphInputs | None = None,
                     progress_position: int = 0, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Train one ingredient to its best-validation weights; write them and their metadata; return it."""
    start = time.perf_counter()
    k = -1 if task.k is None else task.k
    seed = ingredient_seed(recipe.seed, k)
    view_config = recipe.view if task.k is not None else type(recipe.view)(kind="full")
    view = build_view(data, view_config, max(k, 0), task.num_ingredients if task.k is not None else 1, recipe.seed)
    torch.manual_seed(seed if task.init == "independent" else recipe.seed)
    model = build_model(recipe, data.num_features, data.num_classes)
    if task.init == "shared":
        from ladle.checkpoints import load_state

        model.load_state_dict(load_state(task.run_dir / "init.safetensors"))
    torch.manual_seed(seed)
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)

    if full_inputs is None:
        full_inputs = graph_inputs(data, recipe.model)
    eval_graph = view.eval_graph()
    eval_inputs = full_inputs if eval_graph.num_nodes == data.num_nodes else graph_inputs(eval_graph, recipe.model)
    static_inputs: GraphInputs | None = None

    best_state, best_key, best_epoch, stale = copy.deepcopy(model.state_dict()), (-1.0, 0.0), -1, 0
    bar = tqdm(total=recipe.epochs, desc=task.name, position=progress_position, leave=False,
               dynamic_ncols=True, disable=None)
    epoch = 0
    for epoch in range(recipe.epochs):
        model.train()
        for batch in view.batches(epoch):
            if view.static:
                if static_inputs is None:
                    static_inputs = eval_inputs if batch.num_nodes == eval_graph.num_nodes else graph_inputs(
                        batch, recipe.model)
                inputs = static_inputs
            else:
                inputs = graph_inputs(batch, recipe.model)
            if not bool(batch.loss_mask.any()):
                continue
            loss = batch_loss(model(inputs), batch)
            if not torch.isfinite(loss):
                bar.close()
                raise FloatingPointError(f"{task.name}: loss became {loss.item()} at epoch {epoch}")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val_acc, val_loss = evaluate(model, eval_inputs, eval_graph.y, eval_graph.val_mask)
        if (val_acc, -val_loss) > best_key:
            best_key, best_epoch, stale = (val_acc, -val_loss), epoch, 0
            best_state = copy.deepcopy(model.state_dict())
        else:
            stale += 1
        bar.update(1)
        bar.set_postfix(val=f"{val_acc:.3f}", best=f"{best_key[0]:.3f}")
        if stale >= recipe.patience:
            break
    bar.close()

    model.load_state_dict(best_state)
    val_acc, val_loss = evaluate(model, full_inputs, data.y, data.val_mask)
    test_acc, _ = evaluate(model, full_inputs, data.y, data.test_mask)
    save_state(task.run_dir / f"{task.name}.safetensors", model.state_dict())
    meta = {
        "name": task.name, "k": task.k, "num_ingredients": task.num_ingredients, "seed": seed,
        "init": task.init, "recipe": recipe.to_dict(), "view": {"kind": view_config.kind, **view.describe()},
        "epochs_run": epoch + 1, "best_epoch": best_epoch, "view_val_acc": best_key[0],
        "val_acc": val_acc, "val_loss": val_loss, "test_acc": test_acc,
        "train_seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb(), "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "process_group": bool(torch.distributed.is_available() and torch.distributed.is_initialized()),
        "status": "done",
    }
    write_json(task.run_dir / f"{task.name}.json", meta)
    return meta


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ladle.train`` command line."""
    parser = argparse.ArgumentParser(
        prog="python -m ladle.train",
        description="Train K GNN ingredients, each in its own process with no communication.",
        epilog="Any recipe key can be overridden as key=value, e.g. dataset=citeseer view.kind=metis epochs=50",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    parser.add_argument("--recipe", help="recipe name in recipes/ or a .yaml path (default: the embedded default)")
    parser.add_argument("--ingredients", "-k", type=int, default=8, help="number of ingredients K (default 8)")
    parser.add_argument("--workers", "-w", type=int, default=None,
                        help="processes training at once (default: min(K, cores))")
    parser.add_argument("--run-dir", type=Path, help="output folder (default checkpoints/<recipe>-<time>)")
    parser.add_argument("--seed", type=int, help="base seed (same as the override seed=S)")
    init = parser.add_mutually_exclusive_group()
    init.add_argument("--shared-init", dest="init", action="store_const", const="shared",
                      help="all ingredients start from the same weights (default)")
    init.add_argument("--independent-init", dest="init", action="store_const", const="independent",
                      help="each ingredient draws its own initial weights")
    parser.set_defaults(init="shared")
    parser.add_argument("--baseline", action="store_true",
                        help="also train one full-graph model for the same epochs (the soup's reference)")
    parser.add_argument("--data-root", help="dataset root folder (default $LADLE_DATA, ../shared/datasets, ./data)")
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
    from ladle.launch import train_ingredients

    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.seed is not None:
        overrides.append(f"seed={args.seed}")
    recipe = load_recipe(args.recipe, overrides)
    run = train_ingredients(recipe, ingredients=args.ingredients, workers=args.workers, run_dir=args.run_dir,
                            init=args.init, baseline=args.baseline, data_root=args.data_root, device=args.device,
                            backend=args.backend,
                            ray_options={"address": args.address, "cpus": args.cpus_per_ingredient,
                                         "gpus": args.gpus_per_ingredient, "gather": args.gather})
    print(run.summary_table())
    print(f"run directory: {run.run_dir}")
    return 0 if not run.failed else 1


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
