"""Soup accuracy benchmark: test accuracy at best validation, mean ± std over seeds, K ingredients.

For each experiment and seed it trains K ingredients and a full-graph baseline (same epochs), soups
them with every method and validation metric, and compares with the baseline and the logit ensemble.
Not a test: run it by hand (a few minutes to an hour), e.g.

    python bench/soup_accuracy.py --experiments main --seeds 5
    python bench/soup_accuracy.py --experiments views init bn --seeds 3
    python bench/soup_accuracy.py --experiments metis trunk --seeds 5 --quick

Results go to bench/results/<label>.json (the ``trunk`` and ``metis`` experiments: also every label in
bench/results/<experiment>.json) and a Markdown table on stdout. Rows of runs with a trunk also give
the trunk alone, the best soup by validation and the largest interpolation barrier.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ladle.core.recipe import load_recipe
from ladle.soup.pipeline import soup_run
from ladle.train.launch import train_ingredients

# label -> (recipe, overrides, init)
EXPERIMENTS: dict[str, list[tuple[str, str, list[str], str]]] = {
    "main": [
        ("Cora GCN", "cora-gcn", [], "shared"),
        ("CiteSeer GCN", "citeseer-gcn", [], "shared"),
        ("Physics GCN", "physics-gcn", ["view.kind=full"], "shared"),
        ("Cora SAGE", "cora-sage", ["view.kind=full"], "shared"),
        ("Cora GAT", "cora-gat", [], "shared"),
    ],
    "sampled": [
        ("Cora GCN saint-edge", "cora-gcn", ["view.kind=saint-edge"], "shared"),
        ("CiteSeer GCN saint-edge", "citeseer-gcn", ["view.kind=saint-edge"], "shared"),
        ("Physics GCN saint-edge", "physics-gcn", ["view.kind=saint-edge"], "shared"),
    ],
    "views": [
        (f"Cora GCN {kind}", "cora-gcn", [f"view.kind={kind}"], "shared")
        for kind in ("cluster", "saint-node", "saint-edge", "saint-rw", "neighbor", "metis", "random")
    ],
    "init": [
        ("Cora GCN full, independent init", "cora-gcn", [], "independent"),
        ("CiteSeer GCN full, independent init", "citeseer-gcn", [], "independent"),
    ],
    "bn": [("Cora GCN full, batch norm", "cora-gcn", ["norm=batch"], "shared")],
    # The shipped trunk recipes: the default (sampled ClusterGCN views) on each dataset, and the three
    # *-metis recipes (each ingredient on one label-balanced METIS part).
    "trunk": [
        (f"{name} default (cluster, trunk)", "default", [f"dataset={dataset}"], "shared")
        for name, dataset in (("Cora", "cora"), ("CiteSeer", "citeseer"), ("Physics", "physics"))
    ],
    "metis": [
        (f"{name} metis (labels, trunk)", f"{dataset}-metis", [], "shared")
        for name, dataset in (("Cora", "cora"), ("CiteSeer", "citeseer"), ("Physics", "physics"))
    ],
}
TRUNK_EXPERIMENTS = ("trunk", "metis")
METRICS = ("acc", "loss", "acc+loss")


def run_one(recipe_name: str, overrides: list[str], init: str, seed: int, ingredients: int, workers: int,
            root: Path, data_root: str | None, bn_variants: bool, metrics: tuple[str, ...] = METRICS,
            searches: tuple[str, ...] = ("grid", "fast")) -> dict[str, Any]:
    """Train one seed's ingredients + baseline and soup them every way; return the figures."""
    recipe = load_recipe(recipe_name, [*overrides, f"seed={seed}"])
    start = time.perf_counter()
    run = train_ingredients(recipe, ingredients=ingredients, workers=workers, run_dir=root / f"seed{seed}",
                            init=init, baseline=True, data_root=data_root)
    train_seconds = time.perf_counter() - start
    result: dict[str, Any] = {"seed": seed, "train_wall_seconds": train_seconds}
    written: dict[str, Any] = {}
    for metric in metrics:
        for search in searches if metric == "acc+loss" else ("grid",):
            began = time.perf_counter()
            report = soup_run(run.run_dir, metric=metric, search=search, data_root=data_root,
                              write=metric == "acc+loss" and search == "grid")
            suffix = f"{metric}/{search}"
            result[f"soup_seconds/{suffix}"] = time.perf_counter() - began
            if metric == "acc+loss" and search == "grid":
                written = report
            for soup in report["soups"]:
                result[f"{soup['method']}/{suffix}"] = soup["test_acc"]
                result[f"{soup['method']}/{suffix}/evals"] = soup["evaluations"]
                result[f"{soup['method']}/{suffix}/kept"] = len(soup["kept"])
    result["baseline"] = next(r["test_acc"] for r in report["references"] if r["name"] == "baseline")
    result["ensemble"] = next(r["test_acc"] for r in report["references"] if r["name"] == "ensemble")
    result["mean ingredient"] = report["mean_ingredient"]["test_acc"]
    result["best ingredient"] = report["best_ingredient"]["test_acc"]
    result["ingredient_train_seconds"] = report["ingredient_train_seconds"]
    if report.get("trunk") and written:
        best = max(written["soups"], key=lambda soup: (soup["val_acc"], -soup["val_loss"]))
        result["best soup"], result["best soup/method"] = best["test_acc"], best["method"]
        result["trunk"] = next(r["test_acc"] for r in written["references"] if r["name"] == "trunk")
        result["max barrier"] = written["basin"]["max_barrier"]
        result["barriers"] = [step["barrier"] for step in written["basin"]["steps"]]
        result["trunk_seconds"] = report["trunk"]["train_seconds"]
        result["trunk_peak_rss_mb"] = report["trunk"]["peak_rss_mb"]
        result["ingredient_peak_rss_mb"] = max(m["peak_rss_mb"] for m in run.ingredients)
        result["baseline_peak_rss_mb"] = run.baseline["peak_rss_mb"] if run.baseline else None
        result["keeps"] = [row["keep"] for row in written["keeps"]]
    result["label_histograms"] = [v.get("label_histogram") for v in report["views"]]
    if bn_variants:
        off = soup_run(run.run_dir, recompute_bn=False, data_root=data_root, write=False)
        for soup in off["soups"]:
            result[f"{soup['method']}/no-bn-recompute"] = soup["test_acc"]
    return result


def mean_std(values: list[float]) -> str:
    """``82.1 ± 0.4`` in percent."""
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def table(label: str, rows: list[dict[str, Any]]) -> str:
    """One Markdown line: baseline, ingredients, soups (acc+loss, grid), ensemble."""
    columns = ["baseline", "mean ingredient", "best ingredient", "uniform/acc+loss/grid", "greedy/acc+loss/grid",
               "gis/acc/grid", "gis/loss/grid", "gis/acc+loss/grid", "gis/acc+loss/fast", "ensemble"]
    cells = [mean_std([r[c] for r in rows]) if c in rows[0] else "–" for c in columns]
    return f"| {label} | " + " | ".join(cells) + " |"


def trunk_table(label: str, rows: list[dict[str, Any]]) -> str:
    """One Markdown line of a trunk experiment: the best soup (by validation) beside what it must beat."""
    columns = ["baseline", "trunk", "mean ingredient", "best ingredient", "best soup", "uniform/acc+loss/grid",
               "gis/acc+loss/grid", "ensemble"]
    cells = [mean_std([r[c] for r in rows]) for c in columns]
    barrier = max(r["max barrier"] for r in rows)
    return f"| {label} | {len(rows)} | " + " | ".join(cells) + f" | {barrier:.1f} |"


TRUNK_HEADER = ("| experiment | seeds | baseline | trunk alone | mean ingr. | best-val ingr. | best soup (val) "
                "| uniform | GIS | ensemble | max barrier |\n|" + "---|" * 11)
HEADER = ("| experiment | baseline | mean ingr. | best ingr. | uniform | greedy | GIS (acc) | GIS (loss) | "
          "GIS (acc+loss) | GIS fast | ensemble |\n|" + "---|" * 11)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", nargs="+", default=["main"], choices=sorted(EXPERIMENTS))
    parser.add_argument("--only", nargs="*", help="labels to keep (substring match)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--ingredients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="soup with acc+loss only (the tables' metric; the shipped default is now acc)")
    parser.add_argument("--data-root")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [TRUNK_HEADER if set(args.experiments) <= set(TRUNK_EXPERIMENTS) else HEADER]
    for experiment in args.experiments:
        path = args.out / f"{experiment}.json"
        records = json.loads(path.read_text()) if experiment in TRUNK_EXPERIMENTS and path.exists() else []
        for label, recipe_name, overrides, init in EXPERIMENTS[experiment]:
            if args.only and not any(o in label for o in args.only):
                continue
            with tempfile.TemporaryDirectory() as scratch:
                rows = [run_one(recipe_name, overrides, init, seed, args.ingredients, args.workers, Path(scratch),
                                args.data_root, experiment == "bn", ("acc+loss",) if args.quick else METRICS,
                                ("grid",) if experiment in TRUNK_EXPERIMENTS else ("grid", "fast"))
                        for seed in range(args.seeds)]
            record = {"label": label, "recipe": recipe_name, "overrides": overrides, "init": init,
                      "ingredients": args.ingredients, "rows": rows}
            name = label.lower().replace(" ", "-").replace(",", "").replace("(", "").replace(")", "")
            (args.out / f"{name}.json").write_text(json.dumps(record, indent=1))
            if experiment in TRUNK_EXPERIMENTS:  # one file per experiment, a record per label (latest kept)
                records = [r for r in records if r["label"] != label] + [record]
                path.write_text(json.dumps(records, indent=1))
            lines.append(trunk_table(label, rows) if experiment in TRUNK_EXPERIMENTS else table(label, rows))
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
