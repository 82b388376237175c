"""Memory benchmark: peak RSS of one ingredient worker, which maps only its part shard, vs full-graph training.

Physics (34,493 nodes, 8,415 features: 1.16 GB dense), K = 8, ``view.kind=metis``, 2-layer GCN, one
thread. Every figure is a fresh process's own peak, VmHWM from /proc/self/status (not getrusage's
``ru_maxrss``: Linux carries a parent's peak across fork + exec, so a child reads at least its parent's):

    python bench/memory.py                              # Physics, K = 8, 50 epochs
    python bench/memory.py --dataset cora -k 4 --epochs 20
    python bench/memory.py --balance labels --epochs 10   # the physics-metis recipe's parts, and its trunk

Rows: ``imports`` (python + torch + PyG + ladle, no data), ``prepare`` (cold: load, partition and
write the shards), ``part k`` (what a pool worker now does for ingredient k: map part k, train it),
``before`` (what a worker did before shards: load the whole dataset, train the largest part),
``full`` (full-graph training: load the dataset, train the full view), ``full from shard`` (the
baseline's work now: the memory-mapped whole-graph shard), ``trunk`` (with ``--balance labels``: the
trunk of a *-metis recipe, ClusterGCN over the whole-graph shard). Writes ``bench/results/memory.json``
(``memory-labels.json`` with ``--balance labels``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the 0.1 defaults: ingredients straight from the shared init (the embedded default now has a trunk)
TRUNKLESS = ["trunk.epochs=0", "branch.schedule=constant", "branch.keep=best"]

RESULTS = Path(__file__).resolve().parent / "results"


def own_peak_mb() -> float:
    """This process's peak resident memory (its own address space only), in MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def child(mode: str, run_dir: Path, overrides: list[str], ingredients: int, k: int | None,
          data_root: str | None) -> dict[str, Any]:
    """One measurement, run in its own process; returns its peak and what it trained."""
    import torch

    from ladle.core.recipe import load_recipe
    from ladle.core.rundir import TRUNK
    from ladle.graph.datasets import load_dataset
    from ladle.graph.shards import ShardSet, prepare_shards
    from ladle.train.loop import train_task
    from ladle.train.task import IngredientTask
    from ladle.train.worker import ShardWorker

    torch.set_num_threads(1)
    recipe = load_recipe(None, overrides)
    task = IngredientTask(k, ingredients, run_dir / mode, "independent", save_every=0)
    start = time.perf_counter()
    meta: dict[str, Any] = {}
    if mode == "prepare":
        prepare_shards(recipe, ingredients, data_root, force=True)
    elif mode in ("part", "full-shard"):
        meta = ShardWorker(recipe, ShardSet.open(run_dir / "shards"), 0, "cpu").run(task, threads=1)
    elif mode == "trunk":
        trunk = IngredientTask(None, ingredients, run_dir / mode, "independent", save_every=0, role=TRUNK)
        meta = ShardWorker(recipe, ShardSet.open(run_dir / "shards"), 0, "cpu").run(trunk, threads=1)
    elif mode in ("before", "full"):
        data = load_dataset(recipe.dataset, data_root, recipe.split, recipe.features)
        meta = train_task(recipe, data, task)
    return {"mode": mode, "k": k, "peak_mb": own_peak_mb(), "seconds": time.perf_counter() - start,
            "nodes": meta.get("view", {}).get("nodes"), "epochs": meta.get("epochs_run"),
            "test_acc": meta.get("test_acc"), "metrics_on": meta.get("metrics_on")}


def measure(mode: str, run_dir: Path, args: argparse.Namespace, k: int | None = None) -> dict[str, Any]:
    """Run :func:`child` in a fresh interpreter and return its JSON line."""
    command = [sys.executable, __file__, "--child", mode, "--run-dir", str(run_dir), "--dataset", args.dataset,
               "-k", str(args.ingredients), "--epochs", str(args.epochs), "--balance", args.balance]
    command += ["--part", str(k)] if k is not None else []
    command += ["--data-root", args.data_root] if args.data_root else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{mode:<11}{'' if k is None else k:>4}{row['peak_mb']:>10.0f} MiB{row['seconds']:>8.1f} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="physics")
    parser.add_argument("--ingredients", "-k", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--balance", default="none", choices=("none", "labels"),
                        help="labels: the *-metis recipes' label-balanced parts, plus their trunk's worker")
    parser.add_argument("--data-root")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--part", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = [*TRUNKLESS, f"dataset={args.dataset}", "view.kind=metis", f"epochs={args.epochs}",
                 f"patience={args.epochs}", f"view.balance={args.balance}"]
    if args.child:
        trunk = [f"trunk.epochs={args.epochs}"] if args.child == "trunk" else []
        print(json.dumps(child(args.child, args.run_dir, overrides + trunk, args.ingredients, args.part,
                               args.data_root)))
        return

    from ladle.core.recipe import load_recipe
    from ladle.core.storage import save_state
    from ladle.graph.shards import prepare_shards

    with tempfile.TemporaryDirectory(prefix="ladle-memory-") as scratch:
        run_dir = Path(scratch)
        rows = [measure("imports", run_dir, args), measure("prepare", run_dir, args)]
        shards = prepare_shards(load_recipe(None, overrides), args.ingredients, args.data_root)  # cached now
        shards.link(run_dir)
        (run_dir / "before").mkdir()
        save_state(run_dir / "before" / "partition.safetensors", {"parts": shards.partition()})
        parts = [measure("part", run_dir, args, k) for k in range(args.ingredients)]
        largest = max(parts, key=lambda row: row["nodes"])["k"]
        rows += parts + [measure("before", run_dir, args, largest), measure("full", run_dir, args),
                         measure("full-shard", run_dir, args)]
        if args.balance == "labels":
            rows.append(measure("trunk", run_dir, args))
    worker = max(row["peak_mb"] for row in parts)
    by_mode = {row["mode"]: row for row in rows}
    summary = {
        "dataset": args.dataset, "ingredients": args.ingredients, "epochs": args.epochs, "rows": rows,
        "worker_peak_mb": worker, "full_peak_mb": by_mode["full"]["peak_mb"],
        "worker_over_full": worker / by_mode["full"]["peak_mb"],
        "worker_over_before": worker / by_mode["before"]["peak_mb"],
    }
    RESULTS.mkdir(exist_ok=True)
    if args.balance == "labels":
        summary |= {"trunk_peak_mb": by_mode["trunk"]["peak_mb"],
                    "worker_over_full_shard": worker / by_mode["full-shard"]["peak_mb"]}
    name = "memory.json" if args.balance == "none" else f"memory-{args.balance}.json"
    (RESULTS / name).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n| process | peak RSS MiB |\n|---|---|\n| imports only | {by_mode['imports']['peak_mb']:.0f} |\n"
          f"| prepare (cold, once) | {by_mode['prepare']['peak_mb']:.0f} |\n"
          f"| worker, part k (max / min over k) | {worker:.0f} / {min(r['peak_mb'] for r in parts):.0f} |\n"
          f"| worker before shards (whole dataset, part {largest}) | {by_mode['before']['peak_mb']:.0f} |\n"
          f"| full-graph training | {by_mode['full']['peak_mb']:.0f} |\n"
          f"| full-graph training from the shard | {by_mode['full-shard']['peak_mb']:.0f} |\n"
          + (f"| trunk worker (ClusterGCN over the whole-graph shard) | {by_mode['trunk']['peak_mb']:.0f} |\n"
             if "trunk" in by_mode else "") +
          f"\nworker / full-graph: {summary['worker_over_full']:.2f}x; "
          f"worker / worker before shards: {summary['worker_over_before']:.2f}x")


if __name__ == "__main__":
    main()
