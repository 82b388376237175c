"""Throughput benchmark: how fast K ingredients train with 1 or 2 workers, and ladle's epoch vs plain PyG.

One invocation measures, on each dataset, K ingredients (full-graph GCN views) with
1 worker x 1 thread (the baseline), 1 worker x 2 threads and 2 workers x 1 thread, as wall time
(process start and data loading included) and ratios to the baseline; then the time of one
full-batch training epoch (train step + validation forward) of ladle against a plain PyG loop
(GCNConv on edge_index, cached normalisation) on the same graph, in the same process. Prints Markdown
tables and writes the raw figures to ``bench/results/throughput.json``. Not a test:

    python bench/throughput.py                       # Cora and Physics, K = 8
    python bench/throughput.py --datasets cora --epochs 100
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch_geometric.nn import GCNConv

from ladle.checkpoints import write_json
from ladle.config import load_recipe
from ladle.data import load_dataset
from ladle.engine import IngredientTask, train_ingredient
from ladle.launch import train_ingredients
from ladle.resources import available_cores

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = [("1 worker x 1 thread", 1, 1), ("1 worker x 2 threads", 1, 2), ("2 workers x 1 thread", 2, 1)]


class PlainGCN(torch.nn.Module):
    """The textbook PyG GCN (examples/gcn.py): dropout, GCNConv on edge_index, cached normalisation."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = GCNConv(in_channels, hidden, cached=True)
        self.conv2 = GCNConv(hidden, out_channels, cached=True)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x, edge_index))
        return self.conv2(F.dropout(x, 0.5, self.training), edge_index)


def plain_epoch_seconds(dataset: str, epochs: int, data_root: str | None) -> float:
    """Seconds per epoch (train step + validation forward) of the plain PyG loop."""
    data = load_dataset(dataset, data_root)
    model = PlainGCN(data.num_features, 64, data.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    start = 0.0
    for epoch in range(epochs + 1):
        if epoch == 1:
            start = time.perf_counter()  # the first epoch fills the cache: not counted
        model.train()
        optimizer.zero_grad()
        out = model(data.x, data.edge_index)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            pred = model(data.x, data.edge_index)[data.val_mask].argmax(-1)
            (pred == data.y[data.val_mask]).float().mean().item()
    return (time.perf_counter() - start) / epochs


def ladle_epoch_seconds(dataset: str, epochs: int, data_root: str | None) -> float:
    """Seconds per epoch of ladle's ingredient loop on the full graph (input preparation included)."""
    recipe = load_recipe(None, [f"dataset={dataset}", "view.kind=full", f"epochs={epochs}", f"patience={epochs}"])
    data = load_dataset(dataset, data_root, recipe.split, recipe.features)
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        train_ingredient(recipe, data, IngredientTask(0, 1, Path(scratch), "independent", save_every=0))
        return (time.perf_counter() - start) / epochs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["cora", "physics"])
    parser.add_argument("--ingredients", type=int, default=8)
    parser.add_argument("--epochs", nargs="+", type=int, default=[200, 50], help="epochs per dataset, in order")
    parser.add_argument("--data-root")
    args = parser.parse_args()
    lines = ["| dataset | K | epochs | configuration | wall s | ingredients/s | vs 1x1 |", "|---|---|---|---|---|---|---|"]
    epoch_lines = ["| dataset | plain PyG s/epoch | ladle s/epoch | ladle / PyG |", "|---|---|---|---|"]
    raw: dict = {"settings": {k: v for k, v in vars(args).items() if k != "data_root"}, "cores": available_cores(),
                 "torch": torch.__version__, "ingredients": args.ingredients, "runs": [], "epochs": []}
    for i, dataset in enumerate(args.datasets):
        epochs = args.epochs[min(i, len(args.epochs) - 1)]
        recipe = load_recipe(None, [f"dataset={dataset}", "view.kind=full", f"epochs={epochs}", f"patience={epochs}"])
        base = None
        for label, workers, threads in CONFIGS:
            with tempfile.TemporaryDirectory() as scratch:
                start = time.perf_counter()
                train_ingredients(recipe, ingredients=args.ingredients, workers=workers, threads=threads,
                                  run_dir=Path(scratch) / "run", data_root=args.data_root, save_every=0)
                wall = time.perf_counter() - start
            base = base or wall
            raw["runs"].append({"dataset": dataset, "epochs": epochs, "configuration": label, "workers": workers,
                                "threads": threads, "wall_seconds": wall, "vs_1x1": base / wall})
            lines.append(f"| {dataset} | {args.ingredients} | {epochs} | {label} | {wall:.1f} | "
                         f"{args.ingredients / wall:.3f} | {base / wall:.2f}x |")
            print(lines[-1], flush=True)
        torch.set_num_threads(1)
        plain = plain_epoch_seconds(dataset, min(epochs, 50), args.data_root)
        ours = ladle_epoch_seconds(dataset, min(epochs, 50), args.data_root)
        raw["epochs"].append({"dataset": dataset, "threads": 1, "plain_pyg_seconds": plain, "ladle_seconds": ours})
        epoch_lines.append(f"| {dataset} (1 thread) | {plain:.4f} | {ours:.4f} | {ours / plain:.2f} |")
        print(epoch_lines[-1], flush=True)
    print("\n".join(lines + [""] + epoch_lines))
    RESULTS.mkdir(exist_ok=True)
    write_json(RESULTS / "throughput.json", raw)


if __name__ == "__main__":
    main()
