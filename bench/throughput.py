"""Throughput benchmark: how fast K ingredients train with 1 or 2 workers, ladle's epoch vs plain PyG,
and ladle's samplers vs PyG's loaders (``view.sampler``).

One invocation measures, on each dataset, K ingredients (full-graph GCN views) with
1 worker x 1 thread (the baseline), 1 worker x 2 threads and 2 workers x 1 thread, as wall time
(process start and data loading included) and ratios to the baseline; then the time of one
full-batch training epoch (train step + validation forward) of ladle against a plain PyG loop
(GCNConv on edge_index, cached normalisation) on the same graph, in the same process; then, for each
sampled view whose PyG loader can run here, both backends in the same process: view setup seconds,
sampling seconds per epoch (drawing the batches alone) and training seconds per epoch (one
ingredient, setup and validation included), with the ratio PyG / ladle. Raw results go to
``bench/results/throughput.json`` (``--out``). Not a test:

    python bench/throughput.py                       # Cora and Physics, K = 8
    python bench/throughput.py --datasets cora --epochs 100
    python bench/throughput.py --datasets cora --epochs 2 --sections backends --out smoke.json  # smoke
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch_geometric
import torch_geometric.typing
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv

from ladle.core.errors import LadleError
from ladle.core.files import write_json
from ladle.core.recipe import load_recipe
from ladle.graph.datasets import load_dataset
from ladle.graph.pyg_views import with_sampler
from ladle.graph.views import build_view
from ladle.train.launch import train_ingredients
from ladle.train.loop import train_task
from ladle.train.task import IngredientTask

# the 0.1 defaults: ingredients straight from the shared init (the embedded default now has a trunk)
TRUNKLESS = ["trunk.epochs=0", "branch.schedule=constant", "branch.keep=best"]

CONFIGS = [("1 worker x 1 thread", 1, 1), ("1 worker x 2 threads", 1, 2), ("2 workers x 1 thread", 2, 1)]
SECTIONS = ("workers", "epoch", "backends")
SAMPLED_KINDS = ("cluster", "saint-node", "saint-edge", "saint-rw", "neighbor")
RESULTS = Path(__file__).resolve().parent / "results"


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
    recipe = load_recipe(None, [*TRUNKLESS, f"dataset={dataset}", "view.kind=full", f"epochs={epochs}",
                                f"patience={epochs}"])
    data = load_dataset(dataset, data_root, recipe.split, recipe.features)
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        train_task(recipe, data, IngredientTask(0, 1, Path(scratch), "independent", save_every=0))
        return (time.perf_counter() - start) / epochs


def backend_seconds(dataset: str, data: Data, kind: str, backend: str, epochs: int) -> dict[str, float]:
    """One sampled view of ``kind`` under ``backend``: setup s, sampling s/epoch, training s/epoch."""
    recipe = load_recipe(None, [*TRUNKLESS, f"dataset={dataset}", f"view.kind={kind}", f"view.sampler={backend}",
                                f"epochs={epochs}", f"patience={epochs}"])
    start = time.perf_counter()
    view = with_sampler(build_view(data, recipe.view, 0, 1, recipe.seed))
    setup = time.perf_counter() - start
    start = time.perf_counter()
    for epoch in range(epochs):
        for _batch in view.batches(epoch):
            pass
    sample = (time.perf_counter() - start) / epochs
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        train_task(recipe, data, IngredientTask(0, 1, Path(scratch), "independent", save_every=0))
        train = (time.perf_counter() - start) / epochs
    return {"setup_s": setup, "sample_s_per_epoch": sample, "train_s_per_epoch": train}


def compare_backends(dataset: str, epochs: int, data_root: str | None) -> list[dict[str, Any]]:
    """Both backends of every sampled view whose PyG loader runs here, timed in this process (1 thread)."""
    data = load_dataset(dataset, data_root)
    rows = []
    for kind in SAMPLED_KINDS:
        row: dict[str, Any] = {"dataset": dataset, "kind": kind, "epochs": epochs}
        try:
            row["pyg"] = backend_seconds(dataset, data, kind, "pyg", epochs)
        except LadleError as error:
            rows.append({**row, "skipped": str(error)})
            continue
        row["ladle"] = backend_seconds(dataset, data, kind, "ladle", epochs)
        row["pyg_over_ladle"] = {key: row["pyg"][key] / row["ladle"][key] for key in row["ladle"]}
        rows.append(row)
    return rows


def environment() -> dict[str, Any]:
    """What the timings depend on: versions, compiled extras, cores."""
    return {"python": platform.python_version(), "torch": torch.__version__,
            "torch_geometric": torch_geometric.__version__,
            "torch_sparse": torch_geometric.typing.WITH_TORCH_SPARSE, "pyg_lib": torch_geometric.typing.WITH_PYG_LIB,
            "cpu_count": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["cora", "physics"])
    parser.add_argument("--ingredients", type=int, default=8)
    parser.add_argument("--epochs", nargs="+", type=int, default=[200, 50], help="epochs per dataset, in order")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to time")
    parser.add_argument("--data-root")
    parser.add_argument("--out", type=Path, default=RESULTS / "throughput.json", help="raw results (JSON)")
    args = parser.parse_args()
    settings = {k: v for k, v in vars(args).items() if k not in ("data_root", "out")}  # no machine paths
    results: dict[str, Any] = {"args": settings, "environment": environment(),
                               "workers": [], "epoch": [], "backends": []}
    lines = ["| dataset | K | epochs | configuration | wall s | ingredients/s | vs 1x1 |", "|---|---|---|---|---|---|---|"]
    epoch_lines = ["| dataset | plain PyG s/epoch | ladle s/epoch | ladle / PyG |", "|---|---|---|---|"]
    backend_lines = ["| dataset | view | ladle s/epoch (sample, train) | PyG s/epoch (sample, train) | PyG / ladle |",
                     "|---|---|---|---|---|"]
    for i, dataset in enumerate(args.datasets):
        epochs = args.epochs[min(i, len(args.epochs) - 1)]
        recipe = load_recipe(None, [*TRUNKLESS, f"dataset={dataset}", "view.kind=full", f"epochs={epochs}", f"patience={epochs}"])
        base = None
        for label, workers, threads in CONFIGS if "workers" in args.sections else ():
            with tempfile.TemporaryDirectory() as scratch:
                start = time.perf_counter()
                train_ingredients(recipe, ingredients=args.ingredients, workers=workers, threads=threads,
                                  run_dir=Path(scratch) / "run", data_root=args.data_root, save_every=0)
                wall = time.perf_counter() - start
            base = base or wall
            results["workers"].append({"dataset": dataset, "ingredients": args.ingredients, "epochs": epochs,
                                       "configuration": label, "wall_s": wall, "vs_1x1": base / wall})
            lines.append(f"| {dataset} | {args.ingredients} | {epochs} | {label} | {wall:.1f} | "
                         f"{args.ingredients / wall:.3f} | {base / wall:.2f}x |")
            print(lines[-1], flush=True)
        torch.set_num_threads(1)
        if "epoch" in args.sections:
            plain = plain_epoch_seconds(dataset, min(epochs, 50), args.data_root)
            ours = ladle_epoch_seconds(dataset, min(epochs, 50), args.data_root)
            results["epoch"].append({"dataset": dataset, "threads": 1, "plain_pyg_s": plain, "ladle_s": ours})
            epoch_lines.append(f"| {dataset} (1 thread) | {plain:.4f} | {ours:.4f} | {ours / plain:.2f} |")
            print(epoch_lines[-1], flush=True)
        for row in compare_backends(dataset, min(epochs, 50), args.data_root) if "backends" in args.sections else ():
            results["backends"].append(row)
            if "skipped" in row:
                backend_lines.append(f"| {dataset} | {row['kind']} | | | skipped: {row['skipped']} |")
            else:
                ladle, pyg, ratio = row["ladle"], row["pyg"], row["pyg_over_ladle"]
                backend_lines.append(
                    f"| {dataset} | {row['kind']} | {ladle['sample_s_per_epoch']:.4f}, {ladle['train_s_per_epoch']:.4f} | "
                    f"{pyg['sample_s_per_epoch']:.4f}, {pyg['train_s_per_epoch']:.4f} | "
                    f"{ratio['sample_s_per_epoch']:.2f}, {ratio['train_s_per_epoch']:.2f} |")
            print(backend_lines[-1], flush=True)
    write_json(args.out, results)
    print("\n".join(lines + [""] + epoch_lines + [""] + backend_lines))
    print(f"raw results: {args.out}")


if __name__ == "__main__":
    main()
