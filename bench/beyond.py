"""Beyond greedy soups: learned soups and periodic averaging against uniform / greedy / GIS soups.

For each dataset and seed it trains K ingredients with the dataset's recipe (zero communication),
soups them with :func:`ladle.soup.soup_run` (uniform, greedy, GIS) and with the learned soups of
:mod:`ladle.soup.learned` (on the validation neighbourhood, and on METIS parts), and trains K trainers on
random partitions with periodic averaging (:mod:`ladle.train.periodic`) for the same epochs per trainer.
Test accuracy is at the soup's / averaged model's own validation choice; mean ± std over seeds.
Not a test: run it by hand. The defaults (Cora and CiteSeer: 5 seeds, 200 epochs, learned soups
100 epochs; Physics: 1 seed, 20 epochs, learned soups 50 epochs) took about 30 minutes on 2 cores shared
with other jobs, 13 of them training the Physics ingredients. For instance:

    python bench/beyond.py
    python bench/beyond.py --datasets cora --seeds 2 --learned-epochs 50

A Markdown table goes to stdout, the raw figures to bench/results/beyond.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ladle.core.recipe import Recipe, ViewConfig, load_recipe
from ladle.graph.datasets import load_dataset
from ladle.nn.saved import load_ingredients
from ladle.soup.evaluator import Evaluator
from ladle.soup.learned import learned_soup
from ladle.soup.pipeline import soup_run
from ladle.train.launch import train_ingredients
from ladle.train.periodic import train_with_averaging

RECIPES = {"cora": "cora-gcn", "citeseer": "citeseer-gcn", "physics": "physics-gcn"}


def run_seed(recipe: Recipe, seed: int, learned_epochs: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """One seed: train the ingredients, soup them every way, and train with periodic averaging."""
    recipe = recipe.replace(seed=seed)
    row: dict[str, Any] = {"seed": seed}
    began = time.perf_counter()
    run = train_ingredients(recipe, ingredients=args.ingredients, workers=args.workers, run_dir=scratch / f"seed{seed}",
                            data_root=args.data_root)
    row["train_wall_s"] = time.perf_counter() - began
    report = soup_run(run.run_dir, write=False, data_root=args.data_root)
    row["mean ingredient"] = report["mean_ingredient"]["test_acc"]
    for soup in report["soups"]:
        row[soup["method"]] = soup["test_acc"]
        row[f"{soup['method']}/evals"], row[f"{soup['method']}/s"] = soup["evaluations"], soup["seconds"]

    data = load_dataset(recipe.dataset, args.data_root, recipe.split, recipe.features)
    evaluator = Evaluator(recipe, data)
    states = load_ingredients(run.run_dir).states
    for partition in (False, True):
        result = learned_soup(states, evaluator, partition=partition, epochs=learned_epochs, seed=seed)
        row[result.method] = evaluator.split(result.state, "test_mask").acc
        row[f"{result.method}/evals"], row[f"{result.method}/s"] = result.evaluations, result.seconds
        row[f"{result.method}/mixing"] = result.mixing

    averaged = recipe.replace(view=ViewConfig(kind="random"))
    for every in args.average_every:
        out = scratch / f"seed{seed}-avg{every}"
        out.mkdir()
        meta = train_with_averaging(averaged, data, args.ingredients, every, out)
        row[f"avg T={every}"] = meta["test_acc"]
        row[f"avg T={every}/MB"], row[f"avg T={every}/s"] = meta["bytes"] / 1e6, meta["seconds"]
    print(json.dumps({k: v for k, v in row.items() if not k.endswith("/mixing")}), flush=True)
    return row


def mean_std(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    """``82.1 ± 0.4`` (scaled); a single value without the spread."""
    mean = scale * statistics.mean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {scale * statistics.stdev(values):.{digits}f}"


def tables(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    """Test accuracy, then cost: evaluations (forward passes), seconds, and averaging bytes."""
    averages = [f"avg T={t}" for t in args.average_every]
    methods = ["mean ingredient", "uniform", "greedy", "gis", "learned", "learned-partition", *averages]
    lines = ["| dataset (seeds) | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for name, rows in results.items():
        lines.append(f"| {name} ({len(rows)}) | " + " | ".join(mean_std([r[m] for r in rows]) for m in methods) + " |")
    cost = ["gis", "learned", "learned-partition"]
    lines += ["", "| dataset | ingredients train s | " + " | ".join(f"{m} evals / s" for m in cost) + " | "
              + " | ".join(f"{a} MB / s" for a in averages) + " |", "|---" * (2 + len(cost) + len(averages)) + "|"]
    for name, rows in results.items():
        cells = [mean_std([r["train_wall_s"] for r in rows], 1, 0)]
        cells += [f"{mean_std([r[f'{m}/evals'] for r in rows], 1, 0)} / {mean_std([r[f'{m}/s'] for r in rows], 1)}"
                  for m in cost]
        cells += [f"{mean_std([r[f'{a}/MB'] for r in rows], 1)} / {mean_std([r[f'{a}/s'] for r in rows], 1)}"
                  for a in averages]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(RECIPES), choices=sorted(RECIPES))
    parser.add_argument("--seeds", type=int, default=5, help="seeds per dataset (default 5)")
    parser.add_argument("--physics-seeds", type=int, default=1, help="seeds on Physics (default 1)")
    parser.add_argument("--physics-epochs", type=int, default=20, help="Physics epochs per ingredient (default 20)")
    parser.add_argument("--ingredients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--learned-epochs", type=int, default=100, help="learned-soup epochs (default 100)")
    parser.add_argument("--physics-learned-epochs", type=int, default=50, help="on Physics (default 50)")
    parser.add_argument("--average-every", type=int, nargs="+", default=[1, 10], help="averaging periods T")
    parser.add_argument("--data-root")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "beyond.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the soups and the lockstep trainers run here, next to busy workers
    results: dict[str, list[dict[str, Any]]] = {}
    for name in args.datasets:
        overrides = [f"epochs={args.physics_epochs}"] if name == "physics" else []
        recipe = load_recipe(RECIPES[name], overrides)
        seeds = args.physics_seeds if name == "physics" else args.seeds
        learned_epochs = args.physics_learned_epochs if name == "physics" else args.learned_epochs
        with tempfile.TemporaryDirectory() as scratch:
            results[f"{name} ({recipe.view.kind}, {recipe.epochs} ep)"] = [
                run_seed(recipe, seed, learned_epochs, args, Path(scratch)) for seed in range(seeds)]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=1))
    print(tables(results, args))


if __name__ == "__main__":
    main()
