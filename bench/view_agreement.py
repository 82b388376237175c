"""Do a view's models classify their training nodes the same in their batches as in the whole graph?

For each recipe and dataset it trains, as a user would, with the launcher's fallback off so the view's own models
are kept,

    python -m ladle.train --recipe R -k 2 --workers 1 --baseline dataset=D view.fallback=none --run-dir <scratch>

and reads each model's ``view_agreement`` (``ladle.train.loop.view_agreement``), validation and test accuracy:
the figure the launcher's fallback reads without a baseline (``ladle.train.view_check``), beside what the
baseline says. Not a test: run it by hand, e.g.

    python bench/view_agreement.py --runs default:cora default:amherst41 cora-metis:amherst41

Raw JSON: the list of records (``--out``); one line a model on stdout.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROJECT = Path(__file__).resolve().parents[1]
MODELS = ("baseline", "trunk", "trunk-continued", "ingredient-00", "ingredient-01")


def run_one(recipe: str, dataset: str, scratch: Path) -> dict[str, Any]:
    """Train one run through the command; return each model's view, agreement and accuracies (%)."""
    run_dir = scratch / f"{recipe}-{dataset}".replace(":", "_").replace(",", "_")
    subprocess.run([sys.executable, "-m", "ladle.train", "--recipe", recipe, "-k", "2", "--workers", "1", "--baseline",
                    "--run-dir", str(run_dir), f"dataset={dataset}", "view.fallback=none"], cwd=PROJECT, check=True)
    models = {}
    for name in MODELS:
        meta = json.loads((run_dir / f"{name}.json").read_text())
        models[name] = {"view": meta["view"]["kind"], "agreement": meta.get("view_agreement"),
                        "val": 100 * meta["val_acc"], "test": 100 * meta["test_acc"]}
    return {"recipe": recipe, "dataset": dataset, "models": models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="RECIPE:DATASET pairs")
    parser.add_argument("--out", type=Path, default=PROJECT / "bench" / "results" / "view-agreement.json")
    args = parser.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as scratch:
        for pair in args.runs:
            recipe, _, dataset = pair.partition(":")
            record = run_one(recipe, dataset, Path(scratch))
            records.append(record)
            for name, model in record["models"].items():
                agreement = "-" if model["agreement"] is None else f"{model['agreement']:.3f}"
                print(f"{recipe} {dataset} {name} {model['view']} agreement {agreement} val {model['val']:.1f} "
                      f"test {model['test']:.1f}", flush=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
