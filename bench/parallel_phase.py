"""Does the parallel phase pay? The shipped recipes through the shipped commands, several seeds.

For each recipe, dataset and seed it runs, as a user would,

    python -m ladle.train --recipe R -k 8 --baseline dataset=D seed=S --run-dir <scratch>
    python -m ladle.soup --run-dir <scratch> --test-barrier

and reads the soup's report: the trunk, the trunk continued (the same worker training on for a branch's
epochs), the mean and best-validation ingredient, each soup, the logit ensemble, the full-graph baseline,
the largest interpolation barrier (on validation, and on the test nodes), each model's ``view_agreement``, and
what the branches added (the best soup by validation, learned soups left out, minus the trunk and minus the trunk
continued). Not a test: run it by hand, e.g.

    python bench/parallel_phase.py --recipes default cora-metis --datasets cora citeseer --seeds 5
    python bench/parallel_phase.py --recipes default --datasets physics --seeds 3 --workers 2

Raw JSON: bench/results/parallel-phase.json (one record per recipe, dataset and seed; a rerun replaces its
records); a Markdown table of means over seeds on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROJECT = Path(__file__).resolve().parents[1]
COLUMNS = ("baseline", "trunk", "trunk-continued", "mean ingredient", "best ingredient", "uniform", "greedy", "gis",
           "ensemble", "best soup")


def run_one(recipe: str, dataset: str, seed: int, ingredients: int, workers: int, scratch: Path,
            extra: list[str]) -> dict[str, Any]:
    """Train and soup one seed through the commands; return the report's figures (test accuracy, %)."""
    run_dir = scratch / f"{recipe}-{dataset}-{seed}"
    began, wall = time.perf_counter(), {}
    for command in (["ladle.train", "--recipe", recipe, "-k", str(ingredients), "--workers", str(workers),
                     "--baseline", f"dataset={dataset}", f"seed={seed}", *extra],
                    ["ladle.soup", "--test-barrier"]):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", *command, "--run-dir", str(run_dir)], cwd=PROJECT, check=True,
                       stdout=subprocess.DEVNULL)
        wall[command[0]] = time.perf_counter() - started
    report = json.loads((run_dir / "report.json").read_text())
    references = {ref["name"]: ref for ref in report["references"]}
    soups = {soup["method"]: soup for soup in report["soups"]}
    phase = report["parallel_phase"]
    metas = _metas(run_dir, report)
    figures = {name: 100 * references[name]["test_acc"] for name in ("baseline", "trunk", "trunk-continued", "ensemble")
               if name in references}
    figures |= {method: 100 * soups[method]["test_acc"] for method in ("uniform", "greedy", "gis", "learned")
                if method in soups}
    figures |= {"mean ingredient": 100 * report["mean_ingredient"]["test_acc"],
                "best ingredient": 100 * report["best_ingredient"]["test_acc"],
                "best soup": 100 * phase["test_acc"]}
    if "by_validation" in phase:
        figures["best soup, plain validation"] = 100 * phase["by_validation"]["test_acc"]
    validation = {name: 100 * ref["val_acc"] for name, ref in references.items()}
    validation |= {"mean ingredient": 100 * report["mean_ingredient"]["val_acc"],
                   "best ingredient": 100 * report["best_ingredient"]["val_acc"], "best soup": 100 * phase["val_acc"]}
    return {"recipe": recipe, "dataset": dataset, "seed": seed, "ingredients": ingredients, "overrides": extra,
            "test": figures, "validation": validation, "view_fallback": report.get("view_fallback"),
            "partition": report.get("partition"), "versions": report.get("versions"),
            "best_soup": phase["best_soup"], "gain_points": phase["gain_points"],
            "chosen_by": phase.get("chosen_by", "validation"),
            "by_validation": phase.get("by_validation", {}).get("name", phase["best_soup"]),
            "max_barrier": report["basin"]["max_barrier"], "max_test_barrier": report["basin"].get("max_test_barrier"),
            "seconds": time.perf_counter() - began,
            "command_seconds": wall,
            "steps": {name: references[name].get("steps") for name in ("trunk", "trunk-continued", "baseline")
                      if name in references},
            "train_seconds": {name: meta.get("train_seconds") for name, meta in metas.items()},
            "peak_rss_mb": {name: meta.get("peak_rss_mb") for name, meta in metas.items()},
            "view_agreement": {name: meta.get("view_agreement") for name, meta in metas.items()}}


def _metas(run_dir: Path, report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The metadata each trained model of the run wrote (its time, its worker's peak RSS), by name."""
    names = [row["name"] for row in report["ingredients"]] + ["trunk", "trunk-continued", "baseline"]
    return {name: json.loads((run_dir / f"{name}.json").read_text()) for name in names
            if (run_dir / f"{name}.json").is_file()}


def summary(records: list[dict[str, Any]]) -> str:
    """Markdown: means over seeds per recipe and dataset, then the gains."""
    lines = ["| recipe | dataset | seeds | " + " | ".join(COLUMNS) + " | max barrier | max test barrier "
             "| best soup − trunk | best soup − trunk continued |", "|" + "---|" * (len(COLUMNS) + 7)]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["recipe"], record["dataset"]), []).append(record)
    for (recipe, dataset), rows in groups.items():
        cells = [f"{statistics.mean(r['test'][c] for r in rows):.1f}" if all(c in r["test"] for r in rows) else "–"
                 for c in COLUMNS]
        gains = [statistics.mean(r["gain_points"].get(name, float("nan")) for r in rows)
                 for name in ("trunk", "trunk-continued")]
        on_test = [r["max_test_barrier"] for r in rows if r.get("max_test_barrier") is not None]
        lines.append(f"| {recipe} | {dataset} | {len(rows)} | " + " | ".join(cells)
                     + f" | {max(r['max_barrier'] for r in rows):.1f} | {f'{max(on_test):.1f}' if on_test else '–'} "
                     + f"| {gains[0]:+.2f} | {gains[1]:+.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["default", "cora-metis"])
    parser.add_argument("--datasets", nargs="+", default=["cora", "citeseer"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--ingredients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "parallel-phase.json")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides (default: none, the shipped recipe)")
    args = parser.parse_args()
    records = json.loads(args.out.read_text()) if args.out.exists() else []
    with tempfile.TemporaryDirectory() as scratch:
        for recipe in args.recipes:
            for dataset in args.datasets:
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    record = run_one(recipe, dataset, seed, args.ingredients, args.workers, Path(scratch),
                                     args.overrides)
                    key = (recipe, dataset, seed, tuple(args.overrides))
                    records = [r for r in records if (r["recipe"], r["dataset"], r["seed"],
                                                      tuple(r["overrides"])) != key] + [record]
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(records, indent=1))
                    print(f"{recipe} {dataset} seed {seed}: best soup {record['test']['best soup']:.1f}, "
                          f"+{record['gain_points']} points", flush=True)
    print(summary([r for r in records if r["recipe"] in args.recipes and r["dataset"] in args.datasets
                   and r["overrides"] == args.overrides]))


if __name__ == "__main__":
    main()
