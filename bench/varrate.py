"""Benchmark: variable-rate partition-parallel training (ladle.varrate) against the soup, in bytes.

One command trains every schedule on the same K-way partition, in one process group whose ranks
load the dataset once, then trains and soups K zero-communication ingredients on the same
partition (``view.kind`` = ``--partition``), and writes ``report.md`` and ``accuracy-bytes.png`` to ``--out`` and
the raw figures (every run's metadata with its per-epoch history, the soup's entries) to
``bench/results/varrate-<name>.json``::

    python bench/varrate.py                       # Coauthor Physics, K = 4, METIS (about 14 min on 2 busy cores)
    python bench/varrate.py --dataset cora        # a quick run
    python bench/varrate.py --dataset csbm --epochs 200 --eval-every 20 --rate-fraction 0.95
                                                  # where communication matters (about 4 min on 2 busy cores)

``--dataset`` takes a dataset name, a ``synthetic:...`` spec (``ladle/synthetic.py``) or a named benchmark
graph (:data:`GRAPHS`). ``csbm`` is a contextual SBM whose node features are weak (``signal=0.02``) and
whose neighbourhoods carry the class (``homophily=0.9``), split over ranks at random: on it ``none``
(cut edges dropped) ends 4 points below ``full``. A METIS split follows its class communities and
leaves ``none`` level with ``full`` (``--partition metis``). The graph's parameters are the benchmark's, not a
recipe's: the model is the embedded default recipe's (2-layer GCN, hidden 64). ``--name`` renames the
output files, ``--seed`` sets the recipe's seed.

Bytes are every payload byte sent, summed over ranks, collectives counted as ring algorithms send them
(``ladle.core.collectives``): training halo, gradient all-reduce, the exact evaluation halo (every ``--eval-every``
epochs), metric reductions and setup.

Run specs (``--runs``) are ``schedule[:rate][/compressor][+ef][+select=F][+tail=N][+nocache][+bf16]``: ``full``, ``none``, ``fixed:16``,
``linear`` (``--rate-max`` to 1 over ``--rate-fraction`` of the epochs, then 1), ``step``,
``linear/int8``, ``adaptive`` (halves from ``--rate-max`` when the training loss stalls for ``--rate-patience``
epochs), ``fixed:64+ef`` (error feedback), ``full+select=0.1`` (a tenth of the boundary rows a step),
``none+tail=23`` (the last 23 epochs exact), ``full+nocache`` (the first layer exchanges its projection every
step instead of fetching the halo's inputs once), ``adaptive/mask+bf16`` (bfloat16 gradient all-reduce). A spec
without a compressor truncates. The soup's bytes are the final gather of K models (K x model size); it sends
nothing while training.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ladle.core.errors import LadleError
from ladle.core.files import write_json
from ladle.core.recipe import (
    Recipe,
    ViewConfig,
    load_recipe,
    recipe_from_dict,
)
from ladle.core.recipe_files import resolve_recipe_path
from ladle.core.resources import available_cores
from ladle.soup.pipeline import soup_run
from ladle.train.launch import train_ingredients
from ladle.varrate import (
    COMPRESSORS,
    EVAL_EVERY,
    RateSchedule,
    VarrateOptions,
    free_port,
    init_group,
    load_rank_data,
    train_partition,
)
from ladle.varrate.report import report_entry, write_bytes_report

log = logging.getLogger("bench.varrate")
RESULTS = Path(__file__).resolve().parent / "results"

GRAPHS: dict[str, tuple[str, str]] = {  # name -> (dataset spec, default partition)
    "csbm": ("synthetic:nodes=20000,degree=8,features=256,classes=2,homophily=0.9,signal=0.02", "random"),
}

DEFAULT_RUNS = ("full", "fixed:4", "fixed:16", "fixed:64", "linear", "step", "none", "linear/int8", "linear/mask")


def resolve_graph(dataset: str, partition: str | None) -> tuple[str, str, str]:
    """``--dataset`` and ``--partition`` -> (dataset spec, partition, name of the output files).

    A named graph brings its spec and partition (``--partition`` still wins); any other dataset is
    taken as is, METIS by default, and named by its spec with every character outside
    ``[A-Za-z0-9._-]`` replaced by ``-``.
    """
    spec, default = GRAPHS.get(dataset.lower(), (dataset, "metis"))
    name = dataset.lower() if dataset.lower() in GRAPHS else re.sub(r"[^A-Za-z0-9._-]", "-", dataset)
    return spec, partition or default, name


@dataclass(frozen=True)
class Modifiers:
    """A run spec's ``+`` modifiers: ``+ef`` (error feedback), ``+select=F``, ``+tail=N`` (the last N epochs
    exact), ``+nocache`` (the first layer exchanges its projected halo every step) and ``+bf16`` (bfloat16
    gradient all-reduce)."""

    error_feedback: bool = False
    select: float = 1.0
    tail: int = 0
    cache_inputs: bool = True
    gradients: str = "float32"  # bench specs keep float32 unless +bf16, so earlier specs mean what they meant


FLAGS = {"ef": ("error_feedback", True), "nocache": ("cache_inputs", False), "bf16": ("gradients", "bfloat16")}


def parse_modifiers(spec: str) -> Modifiers:
    """``linear/int8+ef+select=0.5`` -> its :class:`Modifiers`."""
    found: dict[str, Any] = {}
    for modifier in spec.split("+")[1:]:
        name, _, value = modifier.partition("=")
        if name in FLAGS and not value:
            field, setting = FLAGS[name]
            found[field] = setting
        elif name in ("select", "tail") and value:
            try:
                found[name] = float(value) if name == "select" else int(value)
            except ValueError:
                raise LadleError(f"run {spec!r}: {name}= needs a number, got {value!r}") from None
        else:
            raise LadleError(f"run {spec!r}: unknown modifier +{modifier} (+ef, +select=F, +tail=N, +nocache or +bf16)")
    return Modifiers(**found)


def parse_run(spec: str, rate_max: float, fraction: float = 1.0, patience: int = 10) -> tuple[str, RateSchedule, str]:
    """``fixed:16/int8+ef`` -> (folder name, schedule, compressor); ``patience``: adaptive's ``--rate-patience``."""
    body, _, compressor = spec.split("+")[0].partition("/")
    kind, _, rate = body.partition(":")
    compressor = compressor or "truncate"
    if compressor not in COMPRESSORS:
        raise LadleError(f"run {spec!r}: unknown compressor {compressor!r}")
    schedule = RateSchedule(kind, rate_max=float(rate) if rate else rate_max, rate_min=1.0, fraction=fraction,
                            patience=patience, tail=parse_modifiers(spec).tail)
    return re.sub(r"[:/+=]", "-", spec), schedule, compressor


def _bench_rank(rank: int, world: int, port: int, recipe_dict: dict[str, Any],
                jobs: list[tuple[VarrateOptions, Path]], data_root: str | None) -> None:
    """One rank: load its shard once, then train every job (schedule) in turn."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    recipe = recipe_from_dict(recipe_dict)
    init_group(torch.device("cpu"), jobs[0][0].timeout, f"tcp://127.0.0.1:{port}", rank, world)
    torch.set_num_threads(jobs[0][0].threads)
    try:
        fetch = any(options.cache_inputs for options, _ in jobs)
        part = load_rank_data(recipe, jobs[0][0].partition, torch.device("cpu"), data_root, rank, fetch)
        for options, run_dir in jobs:
            train_partition(recipe, part, options, run_dir if rank == 0 else None)
    finally:
        dist.destroy_process_group()


def run_schedules(recipe: Recipe, specs: list[str], workers: int, partition: str, rate_max: float, out: Path,
                  data_root: str | None, eval_every: int = EVAL_EVERY, fraction: float = 1.0,
                  patience: int = 10) -> list[dict[str, Any]]:
    """Train every run spec with ``workers`` ranks on this machine; return rank 0's metadata of each."""
    threads = max(1, available_cores() // workers)
    jobs = []
    for spec in specs:
        name, schedule, compressor = parse_run(spec, rate_max, fraction, patience)
        modifiers = parse_modifiers(spec)
        run_dir = out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        jobs.append((VarrateOptions(workers, partition, schedule, compressor, "cpu", 300.0, threads, eval_every,
                                    error_feedback=modifiers.error_feedback, select=modifiers.select,
                                    cache_inputs=modifiers.cache_inputs, gradients=modifiers.gradients), run_dir))
    torch.multiprocessing.start_processes(_bench_rank, args=(workers, free_port(), recipe.to_dict(), jobs, data_root),
                                          nprocs=workers, start_method="spawn")
    return [json.loads((run_dir / "varrate.json").read_text()) for _, run_dir in jobs]


def run_soup(recipe: Recipe, workers: int, partition: str, out: Path, data_root: str | None,
             model_bytes: int) -> list[dict[str, Any]]:
    """K ingredients on the same partition, no communication, then every soup; one report entry per soup."""
    shutil.rmtree(out / "soup", ignore_errors=True)  # a rerun, maybe with other settings, starts afresh
    began = time.perf_counter()
    run = train_ingredients(recipe.replace(view=ViewConfig(kind=partition)), ingredients=workers,
                            workers=min(workers, available_cores()), run_dir=out / "soup", data_root=data_root)
    train_seconds = time.perf_counter() - began
    report = soup_run(run.run_dir, data_root=data_root)
    epochs = [meta["epochs_run"] for meta in run.ingredients]
    seconds = sum(meta["train_seconds"] for meta in run.ingredients) / max(1, sum(epochs))
    entries = []
    for soup in report["soups"]:
        entries.append({"name": f"soup-{soup['method']} (K={workers})", "test_acc": soup["test_acc"],
                        "bytes": workers * model_bytes, "halo_bytes": 0, "allreduce_bytes": 0, "eval_bytes": 0,
                        "step_seconds": seconds, "epochs": max(epochs),
                        "note": f"K x model size, gathered once; ingredients trained in {train_seconds:.0f} s wall"})
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="physics",
                        help=f"dataset, synthetic:... spec or benchmark graph ({', '.join(GRAPHS)}); default physics")
    parser.add_argument("--recipe", help="recipe (default <dataset>-gcn when it exists)")
    parser.add_argument("--workers", type=int, default=4, help="ranks / ingredients K (default 4)")
    parser.add_argument("--partition", choices=("metis", "random"),
                        help="how ranks split the graph (default: the benchmark graph's, else metis)")
    parser.add_argument("--epochs", type=int, default=100, help="epochs of every run (no early stopping)")
    parser.add_argument("--rate-max", type=float, default=64.0, help="starting ratio of linear and step")
    parser.add_argument("--rate-fraction", type=float, default=1.0,
                        help="share of the epochs linear and step take to reach ratio 1 (default 1)")
    parser.add_argument("--rate-patience", type=int, default=10,
                        help="adaptive runs: epochs of stalled training loss before the ratio halves (default 10)")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY,
                        help=f"epochs between exact evaluations (default {EVAL_EVERY})")
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="run specs (see the module docstring)")
    parser.add_argument("--no-soup", dest="soup", action="store_false", help="skip the soup point")
    parser.add_argument("--seed", type=int,
                        help="the recipe's seed (initialisation, dropout, partition); default its own")
    parser.add_argument("--name", help="name of the output files (default: the dataset's)")
    parser.add_argument("--out", type=Path, help="output folder (default bench/out/varrate-<name>)")
    parser.add_argument("--data-root", help="dataset root folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    spec, args.partition, name = resolve_graph(args.dataset, args.partition)
    name = re.sub(r"[^A-Za-z0-9._-]", "-", args.name) if args.name else name
    recipe_name = args.recipe
    if recipe_name is None:
        try:
            recipe_name = str(resolve_recipe_path(f"{args.dataset}-gcn"))
        except LadleError:
            recipe_name = None
    overrides: dict[str, Any] = {"dataset": spec, "epochs": args.epochs, "patience": args.epochs}
    if args.seed is not None:
        overrides["seed"] = args.seed
    recipe = load_recipe(recipe_name, overrides)
    out = args.out or Path("bench/out") / f"varrate-{name}"
    out.mkdir(parents=True, exist_ok=True)

    began = time.perf_counter()
    metas = run_schedules(recipe, args.runs, args.workers, args.partition, args.rate_max, out, args.data_root,
                          args.eval_every, args.rate_fraction, args.rate_patience)
    schedule_seconds = time.perf_counter() - began
    entries = [report_entry(meta) for meta in metas]
    if args.soup:
        entries += run_soup(recipe, args.workers, args.partition, out, args.data_root, metas[0]["model_bytes"])
    title = (f"{name}, K={args.workers}, {args.partition}, {args.epochs} epochs, "
             f"evaluated every {args.eval_every}" + (f", seed {args.seed}" if args.seed is not None else "")
             + (f", linear/step reach 1 at {args.rate_fraction:g} of the epochs" if args.rate_fraction != 1 else ""))
    write_bytes_report(out, title, entries)
    RESULTS.mkdir(exist_ok=True)
    raw = RESULTS / f"varrate-{name}.json"
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "data_root")}  # no machine paths
    write_json(raw, {"title": title, "dataset": spec,
                     "settings": {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
                     "cores": available_cores(), "torch": torch.__version__,
                     "runs": [{k: v for k, v in meta.items() if k != "run_dir"} for meta in metas],
                     "soup": [entry for entry in entries if entry["name"].startswith("soup")],
                     "schedules_wall_seconds": schedule_seconds, "total_wall_seconds": time.perf_counter() - began})

    print(f"\n{title}  (bytes summed over ranks, ring convention; MB/ep = per epoch, MB = whole run)")
    print(f"{'run':<46}{'test acc':>9}{'halo MB/ep':>11}{'all-red MB/ep':>14}{'eval MB/ep':>11}{'total MB':>10}"
          f"{'step s/ep':>10}{'eval s':>8}")
    for entry in entries:
        epochs = max(1, entry["epochs"])
        per_epoch = [0.0, 0.0, 0.0] if entry["name"].startswith("soup") else [
            entry[key] / epochs / 1e6 for key in ("halo_bytes", "allreduce_bytes", "eval_bytes")]
        print(f"{entry['name']:<46}{entry['test_acc']:>9.4f}{per_epoch[0]:>11.2f}{per_epoch[1]:>14.2f}"
              f"{per_epoch[2]:>11.2f}{entry['bytes'] / 1e6:>10.2f}{entry['step_seconds']:>10.3f}"
              f"{entry.get('eval_seconds') or 0:>8.3f}")
    by_name: dict[str, dict[str, Any]] = {}  # the first run of each schedule and compressor
    for meta in metas:
        if meta["schedule"]["kind"] != "fixed" and not meta["error_feedback"] and meta["select"] == 1:
            key = meta["schedule"]["kind"] + ("" if meta["compressor"] == "truncate" else "/" + meta["compressor"])
            by_name.setdefault(key, meta)
    if "full" in by_name and "linear" in by_name:
        full, linear = by_name["full"], by_name["linear"]
        halo = (full["bytes"]["forward_halo"] + full["bytes"]["backward_halo"]) / max(
            1, linear["bytes"]["forward_halo"] + linear["bytes"]["backward_halo"])
        total = full["bytes"]["total"] / max(1, linear["bytes"]["total"])
        gap = 100 * (linear["test_acc"] - full["test_acc"])
        print(f"linear {linear['schedule']['rate_max']:g}->1 vs full: test acc {linear['test_acc']:.4f} vs "
              f"{full['test_acc']:.4f} ({gap:+.2f} points), "
              f"{halo:.1f}x fewer training halo bytes, {total:.2f}x fewer bytes in all")
    print(f"raw figures: {raw}")
    print(f"report: {out / 'report.md'} ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
