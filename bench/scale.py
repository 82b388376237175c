"""Scale benchmark: prepare + K ``metis`` ingredients + soup, end to end, on synthetic graphs up to 1M nodes.

For each size (``synthetic:nodes=N,degree=10,features=64,classes=10``: about 10 N directed edges),
three stages, each its own process tree:

1. prepare: ``python -m ladle.prepare ... --force`` (cold: generate, METIS, write the shards);
2. train: ``python -m ladle.train -k K --workers 2 view.kind=metis epochs=E`` (the shards from the cache);
3. soup: every ingredient's full-graph val/test accuracy, the uniform, greedy and GIS soups (fast alpha
   search) and the logit ensemble, all by layer-wise inference (:mod:`ladle.inference`) over the
   memory-mapped whole-graph shard: what ``ladle.soup`` computes once its Evaluator uses it;
4. for comparison, today's ``ladle.evaluation.Evaluator`` on the same shard: its setup (the validation
   neighbourhood), one validation score and one full-graph test score.

A monitor polls ``/proc`` every 0.2 s for every process of a stage: the largest process's peak
(VmHWM: its own address space) and the largest sum of the stage's resident sets at one time (a
conservative bound: shared pages of the memory-mapped shards count once per process).

    python bench/scale.py                                  # 100k and 1M nodes, K = 8, 30 epochs
    python bench/scale.py --nodes 100000 --epochs 20

Writes ``bench/results/scale.json`` and prints a table; the runs stay in ``--out`` (default
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


def soup_child(run_dir: Path) -> dict[str, Any]:
    """The soup stage: full-graph scores and soups of a run's ingredients by layer-wise inference."""
    import torch

    from ladle.config import recipe_from_dict
    from ladle.evaluation import Metrics, metrics
    from ladle.inference import LayerwiseInference
    from ladle.models import build_model
    from ladle.rundir import load_ingredients
    from ladle.shards import ShardSet, load_shard
    from ladle.soups import greedy_interpolation_soup, greedy_soup, uniform_soup

    torch.set_num_threads(2)
    start = time.perf_counter()
    bundle = load_ingredients(run_dir)
    recipe = recipe_from_dict(bundle.metas[0]["recipe"])
    shard = load_shard(ShardSet.open(run_dir / "shards").graph())
    data = shard.data
    inference = LayerwiseInference.from_shard(shard)
    model = build_model(recipe, data.num_features, data.num_classes)
    evaluations = 0

    def logits(state: dict[str, torch.Tensor]) -> torch.Tensor:
        nonlocal evaluations
        evaluations += 1
        model.load_state_dict(state)
        return inference.logits(model)

    def score(state: dict[str, torch.Tensor]) -> Metrics:
        return metrics(logits(state)[data.val_mask], data.y[data.val_mask])

    def test(out: torch.Tensor) -> float:
        return metrics(out[data.test_mask], data.y[data.test_mask]).acc

    setup = time.perf_counter() - start
    ingredients, ensemble = [], torch.zeros(data.num_nodes, data.num_classes)
    for state in bundle.states:
        out = logits(state)
        ensemble += out / len(bundle.states)
        val = metrics(out[data.val_mask], data.y[data.val_mask])
        ingredients.append({"val_acc": val.acc, "val_loss": val.loss, "test_acc": test(out)})
    order = sorted(range(len(ingredients)), key=lambda i: (ingredients[i]["val_acc"], -ingredients[i]["val_loss"]),
                   reverse=True)
    first_pass = time.perf_counter() - start
    soups = {"uniform": uniform_soup(bundle.states),
             "greedy": greedy_soup(bundle.states, order, score, "acc+loss").state,
             "gis": greedy_interpolation_soup(bundle.states, order, score, "acc+loss", 21, fast=True).state}
    results = {name: {"val_acc": score(state).acc, "test_acc": test(logits(state))} for name, state in soups.items()}
    one = time.perf_counter()
    logits(bundle.states[0])
    per_evaluation = time.perf_counter() - one
    return {"seconds": time.perf_counter() - start, "setup_s": setup, "first_pass_s": first_pass,
            "evaluations": evaluations, "seconds_per_evaluation": per_evaluation, "ingredients": ingredients,
            "soups": results, "ensemble_test_acc": test(ensemble),
            "mean_ingredient_test_acc": sum(r["test_acc"] for r in ingredients) / len(ingredients)}


def evaluator_child(run_dir: Path) -> dict[str, Any]:
    """Today's soup Evaluator (a full forward on the validation neighbourhood / whole graph), for comparison."""
    import torch

    from ladle.config import recipe_from_dict
    from ladle.evaluation import Evaluator
    from ladle.rundir import load_ingredients
    from ladle.shards import ShardSet, load_shard

    torch.set_num_threads(2)
    bundle = load_ingredients(run_dir)
    data = load_shard(ShardSet.open(run_dir / "shards").graph()).data
    start = time.perf_counter()
    evaluator = Evaluator(recipe_from_dict(bundle.metas[0]["recipe"]), data)
    setup = time.perf_counter() - start
    evaluator.validation(bundle.states[0])
    one = time.perf_counter()
    evaluator.validation(bundle.states[0])
    validation = time.perf_counter() - one
    one = time.perf_counter()
    evaluator.split(bundle.states[0], "test_mask")
    return {"setup_s": setup, "validation_s": validation, "first_test_split_s": time.perf_counter() - one,
            "val_neighbourhood_nodes": evaluator.val[0].num_nodes}


def run_size(nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    """The three stages for one graph size."""
    spec = f"synthetic:nodes={nodes},degree=10,features=64,classes=10"
    recipe = [f"dataset={spec}", f"view.kind={args.view}", f"epochs={args.epochs}", f"patience={args.epochs}"]
    run_dir = args.out / f"n{nodes}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun, maybe with other settings, starts afresh
    python = sys.executable
    prepare = stage(f"prepare {nodes}", [python, "-m", "ladle.prepare", *recipe, "-k", str(args.ingredients),
                                         "--force"])
    train = stage(f"train {nodes}", [python, "-m", "ladle.train", *recipe, "-k", str(args.ingredients),
                                     "--workers", str(args.workers), "--run-dir", str(run_dir), "--save-every", "0"])
    soup = stage(f"soup {nodes}", [python, __file__, "--soup-child", str(run_dir)])
    evaluator = stage(f"evaluator {nodes}", [python, __file__, "--evaluator-child", str(run_dir)])
    metas = [json.loads((run_dir / f"ingredient-{k:02d}.json").read_text()) for k in range(args.ingredients)]
    shards = json.loads((run_dir / "shards" / "shards.json").read_text())
    soup_result = json.loads(soup.pop("stdout"))
    evaluator_result = json.loads(evaluator.pop("stdout"))
    for stage_result in (prepare, train):
        stage_result.pop("stdout")
    return {
        "nodes": nodes, "edges": shards["graph"]["num_edges"], "epochs": args.epochs,
        "ingredients": args.ingredients, "workers": args.workers,
        "prepare": prepare | {"prepare_s": shards["seconds"]},
        "train": train | {"ingredient_s": [m["train_seconds"] for m in metas],
                          "ingredient_nodes": [m["view"]["nodes"] for m in metas],
                          "ingredient_part_test_acc": [m["test_acc"] for m in metas]},
        "soup": soup | soup_result,
        "evaluator_today": evaluator | evaluator_result,
        "total_s": prepare["wall_s"] + train["wall_s"] + soup["wall_s"],
        "largest_peak_mb": max(s["largest_peak_mb"] for s in (prepare, train, soup)),
    }


def table(results: list[dict[str, Any]]) -> str:
    """The Markdown table of the figures that matter."""
    lines = ["| nodes | edges | prepare s | train wall s | mean s / ingredient | sum ingredient s | soup s "
             "| soup evals | s / eval | soup MiB | Evaluator today: MiB, s / val eval | total s "
             "| largest process MiB | train sum RSS MiB | gis test | mean ingredient test |", "|" + "---|" * 16]
    for r in results:
        times = r["train"]["ingredient_s"]
        lines.append(
            f"| {r['nodes']:,} | {r['edges']:,} | {r['prepare']['wall_s']:.0f} | {r['train']['wall_s']:.0f} "
            f"| {sum(times) / len(times):.1f} | {sum(times):.0f} | {r['soup']['wall_s']:.0f} "
            f"| {r['soup']['evaluations']} | {r['soup']['seconds_per_evaluation']:.2f} "
            f"| {r['soup']['largest_peak_mb']:.0f} | {r['evaluator_today']['largest_peak_mb']:.0f}, "
            f"{r['evaluator_today']['validation_s']:.2f} | {r['total_s']:.0f} "
            f"| {r['largest_peak_mb']:.0f} | {r['train']['max_sum_rss_mb']:.0f} "
            f"| {r['soup']['soups']['gis']['test_acc']:.3f} | {r['soup']['mean_ingredient_test_acc']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--ingredients", "-k", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--view", default="metis", choices=("metis", "random"))
    parser.add_argument("--out", type=Path, default=PROJECT / "checkpoints" / "bench-scale")
    parser.add_argument("--soup-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--evaluator-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.soup_child:
        print(json.dumps(soup_child(args.soup_child)))
        return
    if args.evaluator_child:
        print(json.dumps(evaluator_child(args.evaluator_child)))
        return
    results = []
    for nodes in args.nodes:
        results.append(run_size(nodes, args))
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "scale.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
