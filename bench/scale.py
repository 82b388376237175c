"""Scale benchmark: synthetic graphs up to ogbn-products' node count through the shipped commands, end to end.

For each size N (``synthetic:nodes=N,degree=26,features=100,classes=47``: about 26 N directed edges, and
ogbn-products' feature width and class count; at 2.45M nodes, its node count and ~64M directed edges), three
stages, each a process tree run exactly as a user runs it:

1. ``python -m ladle.prepare <recipe> -k K --force`` (cold: generate, METIS, write the shards);
2. ``python -m ladle.train <recipe> -k K --workers 2 --run-dir RUN`` (the shards from the cache);
3. ``python -m ladle.soup --run-dir RUN --method gis --search fast``: every ingredient's and the soup's whole-split
   accuracy and the logit ensemble; candidates scored on the validation sample (``ladle.nn.scoring``).

The recipe is the embedded default with ``view.kind=metis view.balance=labels epochs=E patience=E``
(label-balanced METIS: on this graph, whose classes cluster, plain METIS parts hold a few classes each).
A monitor polls ``/proc`` every 0.2 s for every process of a stage: the largest process's peak (VmHWM: its own address
space) and the largest sum of the stage's resident sets at one time (a conservative bound: shared pages
of the memory-mapped shards count once per process).

    python bench/scale.py                                  # 100k, 1M and 2.45M nodes, K = 8, 30 epochs
    python bench/scale.py --nodes 100000 --epochs 20

Writes ``bench/results/scale.json`` (``--json``) and prints a table; the runs stay in ``--out`` (default
``checkpoints/bench-scale``), their shards in the ladle cache.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# the 0.1 defaults: ingredients straight from the shared init (the embedded default now has a trunk)
TRUNKLESS = ["trunk.epochs=0", "branch.schedule=constant", "branch.keep=best"]

RESULTS = Path(__file__).resolve().parent / "results"
PROJECT = Path(__file__).resolve().parents[1]


class TreeMonitor:
    """Polls the memory of a process and all its descendants until stopped."""

    def __init__(self, root: int, interval: float = 0.2) -> None:
        self.root, self.interval = root, interval
        self.peak_mb: dict[int, float] = {}  # VmHWM per pid, last seen
        self.names: dict[int, str] = {}
        self.max_sum_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
        tree, frontier = [self.root], [self.root]
        while frontier:
            frontier = [pid for pid, parent in parents.items() if parent in frontier]
            tree += frontier
        return tree

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0.0
            for pid in self._tree():
                try:
                    status = Path(f"/proc/{pid}/status").read_text().splitlines()
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                except OSError:
                    continue
                fields = {line.split(":")[0]: line.split()[1] for line in status if line[:5] in ("VmHWM", "VmRSS")}
                if "VmHWM" in fields:
                    self.peak_mb[pid] = int(fields["VmHWM"]) / 1024
                    self.names[pid] = process_role(argv)
                    total += int(fields["VmRSS"]) / 1024
            self.max_sum_mb = max(self.max_sum_mb, total)
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, Any]:
        """Stop polling; the largest process (its peak and command) and the largest simultaneous sum."""
        self._stop.set()
        self._thread.join()
        pid = max(self.peak_mb, key=self.peak_mb.__getitem__)
        return {"largest_peak_mb": self.peak_mb[pid], "largest_process": self.names[pid],
                "processes": len(self.peak_mb), "max_sum_rss_mb": self.max_sum_mb}


def process_role(argv: list[str]) -> str:
    """What a process is, without machine paths: ``ladle.prepare``, ``worker``, ``scale.py --soup-child``..."""
    if any("spawn_main" in arg for arg in argv):
        return "worker"
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        return argv[argv.index("-m") + 1]
    scripts = [Path(arg).name + (" --soup-child" if "--soup-child" in argv else "") for arg in argv[1:2]]
    return scripts[0] if scripts else Path(argv[0]).name


def stage(name: str, command: list[str]) -> dict[str, Any]:
    """Run one stage as a process tree under a :class:`TreeMonitor`; its wall time, memory, last stdout line."""
    print(f"[{name}] {' '.join(command)}", flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=os.environ | {"PYTHONUNBUFFERED": "1"})
    monitor = TreeMonitor(process.pid)
    out, err = process.communicate()
    memory = monitor.stop()
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"{name} failed ({process.returncode}):\n{err[-3000:]}")
    print(f"[{name}] {wall:.1f} s, largest process {memory['largest_peak_mb']:.0f} MiB, "
          f"stage sum {memory['max_sum_rss_mb']:.0f} MiB", flush=True)
    return {"wall_s": wall, **memory, "stdout": out.strip().splitlines()[-1] if out.strip() else ""}


def run_size(nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    """The three stages for one graph size."""
    spec = f"synthetic:nodes={nodes},degree={args.degree},features={args.features},classes={args.classes}"
    recipe = [*TRUNKLESS, f"dataset={spec}", f"view.kind={args.view}", f"epochs={args.epochs}",
              f"patience={args.epochs}"]
    if args.view == "metis":
        recipe.append(f"view.balance={args.balance}")
    run_dir = args.out / f"n{nodes}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun, maybe with other settings, starts afresh
    python = sys.executable
    k = str(args.ingredients)
    prepare = stage(f"prepare {nodes}", [python, "-m", "ladle.prepare", *recipe, "-k", k, "--force"])
    train = stage(f"train {nodes}", [python, "-m", "ladle.train", *recipe, "-k", k, "--workers", str(args.workers),
                                     "--run-dir", str(run_dir), "--save-every", "0"])
    flags = [] if args.method == "default" else ["--method", args.method, "--search", args.search]
    soup = stage(f"soup {nodes}", [python, "-m", "ladle.soup", "--run-dir", str(run_dir), *flags])
    metas = [json.loads((run_dir / f"ingredient-{i:02d}.json").read_text()) for i in range(args.ingredients)]
    shards = json.loads((run_dir / "shards" / "shards.json").read_text())
    report = json.loads((run_dir / "report.json").read_text())
    for stage_result in (prepare, train, soup):
        stage_result.pop("stdout")
    ingredient_seconds = sum(m["train_seconds"] for m in metas)
    return {
        "nodes": nodes, "edges": shards["graph"]["num_edges"], "dataset": spec, "epochs": args.epochs,
        "ingredients": args.ingredients, "workers": args.workers, "method": args.method, "search": args.search, "recipe": recipe,
        "prepare": prepare | {"prepare_s": shards["seconds"]},
        "train": train | {"ingredient_s": [m["train_seconds"] for m in metas],
                          "ingredient_peak_rss_mb": [m.get("peak_rss_mb") for m in metas],
                          "ingredient_nodes": [m["view"]["nodes"] for m in metas]},
        "soup": soup | {"soup_s": report["soup_seconds"], "validation": report["validation"],
                        "soup_wall_over_training": soup["wall_s"] / ingredient_seconds,
                        "soup_threads": report.get("soup_threads"), "scaled": report.get("scaled"),
                        "best_soup": (report["parallel_phase"] or {}).get("best_soup", f"soup-{args.method}"),
                        "soup_core_seconds_over_training": (report["soup_threads"] * soup["wall_s"]
                                                            / report["ingredient_core_seconds"]),
                        "rows": {r["name"]: r["test_acc"] for r in report["soups"] + report["references"]},
                        "best_ingredient_test_acc": report["best_ingredient"]["test_acc"],
                        "mean_ingredient_test_acc": report["mean_ingredient"]["test_acc"]},
        "total_s": prepare["wall_s"] + train["wall_s"] + soup["wall_s"],
        "largest_peak_mb": max(s["largest_peak_mb"] for s in (prepare, train, soup)),
    }


def table(results: list[dict[str, Any]]) -> str:
    """The Markdown table of the figures that matter."""
    lines = ["| nodes | edges | prepare s | prepare MiB | train wall s | sum ingredient s | largest worker MiB "
             "| soup s | soup s / Σ ingredient s | soup MiB | total s | largest process MiB | soup test | best ingredient "
             "| mean ingredient | ensemble |", "|" + "---|" * 16]
    for r in results:
        soup = r["soup"]
        lines.append(
            f"| {r['nodes']:,} | {r['edges']:,} | {r['prepare']['wall_s']:.0f} | {r['prepare']['largest_peak_mb']:.0f} "
            f"| {r['train']['wall_s']:.0f} | {sum(r['train']['ingredient_s']):.0f} "
            f"| {max(m or 0 for m in r['train']['ingredient_peak_rss_mb']):.0f} "
            f"| {soup['wall_s']:.0f} | {soup['wall_s'] / sum(r['train']['ingredient_s']):.2f} | {soup['largest_peak_mb']:.0f} "
            f"| {r['total_s']:.0f} | {r['largest_peak_mb']:.0f} | {soup['rows'][soup['best_soup']]:.3f} "
            f"| {soup['best_ingredient_test_acc']:.3f} | {soup['mean_ingredient_test_acc']:.3f} "
            f"| {soup['rows']['ensemble']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100_000, 1_000_000, 2_450_000])
    parser.add_argument("--degree", type=int, default=26)
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--classes", type=int, default=47)
    parser.add_argument("--ingredients", "-k", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--view", default="metis", choices=("metis", "random"))
    parser.add_argument("--balance", default="labels", choices=("labels", "none"),
                        help="view.balance of the metis view (default labels: every part holds every class)")
    parser.add_argument("--method", default="gis",
                        help="ladle.soup --method (default gis); 'default': ladle.soup with no --method or --search")
    parser.add_argument("--search", default="fast", choices=("grid", "fast"), help="ladle.soup --search (default fast)")
    parser.add_argument("--out", type=Path, default=PROJECT / "checkpoints" / "bench-scale")
    parser.add_argument("--json", type=Path, default=RESULTS / "scale.json")
    args = parser.parse_args()
    results = []
    for nodes in args.nodes:
        results.append(run_size(nodes, args))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
