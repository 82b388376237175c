"""GPU check: ladle's full-batch epoch vs a plain PyG loop on CUDA, and a small run with --device cuda.

Not a test (CI has no GPU). On a machine with CUDA:

    python -m bench.gpu --data-root ../shared/datasets

prints a Markdown table: seconds per epoch on Physics (ladle vs PyG GCNConv on edge_index, both on
the GPU, same process) and the accuracy of K = 4 Cora ingredients trained on CUDA and their soups, and
writes the raw figures to ``bench/results/gpu.json``.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.throughput import PlainGCN
from ladle.core.files import write_json
from ladle.core.recipe import load_recipe
from ladle.graph.datasets import load_dataset
from ladle.graph.inputs import graph_inputs
from ladle.nn.models import build_model
from ladle.soup.pipeline import soup_run
from ladle.train.launch import train_ingredients

# the 0.1 defaults: ingredients straight from the shared init (the embedded default now has a trunk)
TRUNKLESS = ["trunk.epochs=0", "branch.schedule=constant", "branch.keep=best"]

RESULTS = Path(__file__).resolve().parent / "results"


def epoch_seconds(step, epochs: int) -> float:
    """Mean seconds of ``step()`` over ``epochs`` calls after one warm-up call, synchronised."""
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(epochs):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / epochs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root")
    parser.add_argument("--epochs", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    device = torch.device("cuda")
    data = load_dataset("physics", args.data_root)
    recipe = load_recipe(None, [*TRUNKLESS, "dataset=physics", "view.kind=full"])
    model = build_model(recipe, data.num_features, data.num_classes).to(device)
    inputs = graph_inputs(data, "gcn").to(device)
    y, train = data.y.to(device), data.train_mask.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def ladle_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(inputs)[train], y[train]).backward()
        optimizer.step()

    plain = PlainGCN(data.num_features, 64, data.num_classes).to(device)
    x, edge_index = data.x.to(device), data.edge_index.to(device)
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)

    def plain_step() -> None:
        plain_optimizer.zero_grad()
        F.cross_entropy(plain(x, edge_index)[train], y[train]).backward()
        plain_optimizer.step()

    ours, theirs = epoch_seconds(ladle_step, args.epochs), epoch_seconds(plain_step, args.epochs)
    print(f"| {torch.cuda.get_device_name()} | Physics full-batch GCN epoch | ladle {ours * 1e3:.2f} ms | "
          f"PyG {theirs * 1e3:.2f} ms | ratio {ours / theirs:.2f} |")
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        run = train_ingredients(load_recipe("cora-gcn"), ingredients=4, workers=1, run_dir=Path(scratch) / "run",
                                data_root=args.data_root, device="cuda", baseline=True)
        seconds = time.perf_counter() - start
        report = soup_run(run.run_dir, data_root=args.data_root, write=False)
    soups = ", ".join(f"{s['method']} {100 * s['test_acc']:.1f}" for s in report["soups"])
    print(f"| Cora K=4 on CUDA | {seconds:.1f} s | mean ingredient {100 * report['mean_ingredient']['test_acc']:.1f} | "
          f"{soups} |")
    RESULTS.mkdir(exist_ok=True)
    write_json(RESULTS / "gpu.json", {
        "settings": {k: v for k, v in vars(args).items() if k != "data_root"}, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "physics_step_ms": {"ladle": ours * 1e3, "pyg": theirs * 1e3, "steps": args.epochs},
        "cora_k4_cuda": {"wall_seconds": seconds, "mean_ingredient": report["mean_ingredient"]["test_acc"],
                         "soups": {s["method"]: s["test_acc"] for s in report["soups"]}}})


if __name__ == "__main__":
    main()
