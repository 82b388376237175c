"""Sampled batches of a bag-of-words graph: dense batch features (before) vs the rows' non-zeros (now).

Before, every ClusterGCN batch gathered its nodes' dense feature rows (4,300 x 8,415 floats on Physics), and
GCN then scanned them for their non-zeros, while GIN and APPNP multiplied (GIN: summed over every edge) the
dense rows. Now a batch takes its rows' non-zeros from the whole graph's sparse features and every built-in
model projects them first. Both ways run here in one process, from the run's prepared shards as a worker
reads them, on the default recipe's trunk view (4 of 32 clusters a batch): seconds per epoch of batches
(drawing, inputs, one Adam step each) and of one whole-graph validation forward, and the ratio. Not a test:

    python bench/sparse_batches.py                   # Physics and Cora, GCN, GIN and APPNP, 5 epochs each
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path
from typing import Any

import torch

from ladle.core.files import write_json
from ladle.core.recipe import load_recipe
from ladle.graph.inputs import GraphInputs, graph_inputs
from ladle.graph.shards import load_shard, prepare_shards
from ladle.graph.views import build_view
from ladle.nn.models import build_model
from ladle.nn.scoring import evaluate
from ladle.train.loop import BatchInputs, batch_loss

RESULTS = Path(__file__).resolve().parent / "results"


def epoch_seconds(dataset: str, model: str, sparse_rows: bool, epochs: int, data_root: str | None) -> dict[str, float]:
    """Mean seconds of a training epoch and of a validation forward, one thread, after one warm-up epoch."""
    recipe = load_recipe("default", [f"dataset={dataset}", f"model={model}"])
    shard = load_shard(prepare_shards(recipe, 1, data_root).graph())
    shard.data.feature_rows = shard.feature_rows()
    data = shard.data
    view = build_view(data, recipe.trunk_view(), 0, 1, recipe.seed)
    if sparse_rows:
        whole = shard.inputs(model)
        inputs = BatchInputs(view, whole, model, "cpu")
    else:  # before: dense batches; GCN scans them for non-zeros, GIN and APPNP multiply them dense
        whole = shard.inputs(model) if model == "gcn" else graph_inputs(data, model, sparse_features=False)

        def inputs(batch: Any) -> GraphInputs:
            return graph_inputs(batch, model, sparse_features=None if model == "gcn" else False)
    torch.manual_seed(0)
    net = build_model(recipe, data.num_features, int(data.y.max()) + 1)
    optimizer = torch.optim.Adam(net.parameters(), lr=recipe.lr)
    train_seconds = eval_seconds = 0.0
    for epoch in range(epochs + 1):
        began = time.perf_counter()
        net.train()
        for batch in view.batches(epoch):
            optimizer.zero_grad()
            batch_loss(net(inputs(batch)), batch).backward()
            optimizer.step()
        middle = time.perf_counter()
        evaluate(net, whole, data.y, data.val_mask)
        if epoch:  # the first epoch warms caches up
            train_seconds += middle - began
            eval_seconds += time.perf_counter() - middle
    return {"train_epoch_s": train_seconds / epochs, "val_forward_s": eval_seconds / epochs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["physics", "cora"])
    parser.add_argument("--models", nargs="+", default=["gcn", "gin", "appnp"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--data-root")
    parser.add_argument("--out", type=Path, default=RESULTS / "sparse-batches.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print("| dataset | model | train epoch s, dense batches | sparse rows | ratio | val forward s, dense | sparse | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for dataset in args.datasets:
        for model in args.models:
            before = epoch_seconds(dataset, model, False, args.epochs, args.data_root)
            after = epoch_seconds(dataset, model, True, args.epochs, args.data_root)
            rows.append({"dataset": dataset, "model": model, "dense_batches": before, "sparse_rows": after})
            print(f"| {dataset} | {model} | {before['train_epoch_s']:.3f} | {after['train_epoch_s']:.3f} | "
                  f"{before['train_epoch_s'] / after['train_epoch_s']:.1f}x | {before['val_forward_s']:.3f} | "
                  f"{after['val_forward_s']:.3f} | {before['val_forward_s'] / after['val_forward_s']:.1f}x |",
                  flush=True)
    write_json(args.out, {"machine": {"cpu": platform.processor() or platform.machine(), "threads": 1,
                                      "torch": torch.__version__}, "epochs": args.epochs, "rows": rows})


if __name__ == "__main__":
    main()
