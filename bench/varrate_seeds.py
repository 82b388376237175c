"""Benchmark summary: bench/varrate.py's raw JSONs of several seeds -> one table of means and a Pareto plot.

Each run is named as its report row (``ladle.varrate.report.report_entry``); a name's rows are averaged over the
files that have it::

    python bench/varrate_seeds.py bench/results/varrate-csbm-grid-seed*.json --plot bench/results/varrate-csbm-pareto.png
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from ladle.varrate.report import pareto_front, report_entry

REFERENCES = ("full", "full (inputs exchanged every step)")


def mean_entries(files: list[Path]) -> list[dict[str, Any]]:
    """One entry per run name: mean and s.d. of test accuracy, mean bytes, the seeds it ran."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for path in files:
        for meta in json.loads(path.read_text())["runs"]:
            entry = report_entry(meta)
            rows.setdefault(entry["name"], []).append(entry)
    return [{"name": name, "test_acc": statistics.fmean(e["test_acc"] for e in runs),
             "sd": statistics.stdev(e["test_acc"] for e in runs) if len(runs) > 1 else 0.0,
             "bytes": statistics.fmean(e["bytes"] for e in runs), "seeds": len(runs)} for name, runs in rows.items()]


def markdown(entries: list[dict[str, Any]]) -> str:
    """The table: test accuracy (mean ± s.d.), its distance to each reference, total MB and the bytes ratios."""
    refs = {name: next(e for e in entries if e["name"] == name) for name in REFERENCES
            if any(e["name"] == name for e in entries)}
    front = pareto_front(entries)
    head = "| run | seeds | test acc | " + " | ".join(f"vs {n} (points)" for n in refs) + " | total MB | " + \
        " | ".join(f"{n} / total bytes" for n in refs) + " | Pareto front |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, e in enumerate(entries):
        gaps = " | ".join(f"{100 * (e['test_acc'] - r['test_acc']):+.2f}" for r in refs.values())
        ratios = " | ".join(f"{r['bytes'] / e['bytes']:.2f}×" for r in refs.values())
        lines.append(f"| {e['name']} | {e['seeds']} | {100 * e['test_acc']:.2f} ± {100 * e['sd']:.2f} | {gaps} | "
                     f"{e['bytes'] / 1e6:,.1f} | {ratios} | {'yes' if i in front else ''} |")
    return "\n".join(lines)


def plot(entries: list[dict[str, Any]], title: str, path: Path) -> None:
    """Mean test accuracy against mean total bytes, one point per run name, the Pareto front dashed."""
    from matplotlib.figure import Figure
    figure = Figure(figsize=(9, 5.5))
    axis = figure.subplots()
    for e in entries:
        axis.errorbar(e["bytes"], 100 * e["test_acc"], yerr=100 * e["sd"], fmt="o", ms=4, capsize=2)
        axis.annotate(e["name"], (e["bytes"], 100 * e["test_acc"]), fontsize=6, xytext=(3, 3),
                      textcoords="offset points")
    front = pareto_front(entries)
    axis.plot([entries[i]["bytes"] for i in front], [100 * entries[i]["test_acc"] for i in front], "--", color="black",
              lw=1, drawstyle="steps-post", label="Pareto front")
    axis.set_xscale("log")
    axis.set_xlabel("total bytes sent in a run (mean over seeds)")
    axis.set_ylabel("test accuracy at best validation, % (mean ± s.d.)")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=130)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="raw JSONs written by bench/varrate.py")
    parser.add_argument("--plot", type=Path, help="write the Pareto plot here (PNG)")
    parser.add_argument("--title", default="", help="the plot's title (the most seeds of a run is added)")
    args = parser.parse_args(argv)
    entries = mean_entries(args.files)
    print(markdown(entries))
    if args.plot:
        seeds = max(e["seeds"] for e in entries)
        plot(entries, f"{args.title} ({seeds} seeds)".strip(), args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
