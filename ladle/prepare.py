"""``python -m ladle.prepare``: load, partition and shard a run's graph once, before training it; list and
prune the cache.

Takes the recipe arguments of ``python -m ladle.train``; a later ``ladle.train`` with the same
dataset files, view, ``-k`` and seed finds the shards in the cache and links them into its run directory
instead of loading the whole graph (see :mod:`ladle.graph.shards`). ``--list`` shows what the cache holds
(datasets' arrays, shard sets) with sizes; ``--prune`` removes entries unused for ``--older-than``, then
the least recently used until the cache fits ``--max-size``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ladle.core.errors import LadleError, run_cli
from ladle.core.files import read_json
from ladle.core.recipe import add_recipe_arguments, recipe_from_args
from ladle.graph.cache import CACHE_MARKER, cache_dir, discard, is_cache_entry

if TYPE_CHECKING:
    from ladle.graph.shards import ShardSet

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ladle.prepare`` command line."""
    parser = argparse.ArgumentParser(
        prog="python -m ladle.prepare",
        description="Prepare (once, cached) the per-ingredient shards of a run; list or prune the cache.",
        epilog="Any recipe key can be overridden as key=value, e.g. dataset=physics view.kind=metis",
    )
    add_recipe_arguments(parser)
    parser.add_argument("--ingredients", "-k", type=int, default=8, help="number of ingredients K (default 8)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild the shards and the dataset's cached arrays even if the cache has them")
    cache = parser.add_argument_group("the cache ($LADLE_CACHE, default ~/.cache/ladle)")
    cache.add_argument("--list", action="store_true", help="list the cached datasets and shard sets with sizes")
    cache.add_argument("--prune", action="store_true",
                       help="remove entries unused for --older-than, then the least recently used until the "
                            "cache fits --max-size")
    cache.add_argument("--older-than", metavar="AGE", help="with --prune: unused for longer than AGE (30d, 12h, 90m)")
    cache.add_argument("--max-size", metavar="SIZE", help="with --prune: keep at most SIZE in the cache (2G, 500M)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ladle.prepare``."""
    args = build_parser().parse_intermixed_args(argv)  # key=value overrides anywhere among the flags
    if args.list or args.prune:
        return _manage_cache(args)
    if args.older_than or args.max_size:
        raise LadleError("--older-than and --max-size go with --prune")
    recipe = recipe_from_args(args)
    from ladle.graph.shards import prepare_shards  # torch and PyG from here on
    shards = prepare_shards(recipe, args.ingredients, args.data_root, args.force)
    print(shard_table(shards))
    print(f"shards: {shards.path} (prepared in {shards.meta['seconds']:.1f} s; "
          "ladle.train with the same recipe, -k and seed links them as <run>/shards)")
    return 0


def shard_table(shards: ShardSet) -> str:
    """One line per shard: nodes, edges, train/val/test nodes and size on disk."""
    lines = [f"{'shard':<10}{'nodes':>10}{'edges':>12}{'train':>8}{'val':>8}{'test':>9}{'MB':>9}"]
    for name in ["graph", *shards.meta["parts"]]:
        meta = read_json(shards.path / name / "meta.json")
        size = sum(p.stat().st_size for p in (shards.path / name).iterdir()) / 2**20
        lines.append(f"{name:<10}{meta['num_nodes']:>10}{meta['num_edges']:>12}{meta['train_nodes']:>8}"
                     f"{meta['val_nodes']:>8}{meta['test_nodes']:>9}{size:>9.1f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class CacheEntry:
    """One folder of the cache: a dataset's arrays, a shard set, or what an interrupted build left."""

    path: Path
    what: str
    size: int  # bytes
    used: float  # last use (the folder's mtime, set on each use), seconds since the epoch


def cache_entries(cache: Path) -> list[CacheEntry]:
    """Every entry ladle wrote (and marked: :func:`~ladle.graph.cache.is_cache_entry`) in the cache's
    ``datasets/`` and ``shards/`` folders, least recently used first; anything else there is not ladle's."""
    entries = [CacheEntry(path, _describe(path), _size(path), path.stat().st_mtime)
               for path in _folders(cache) if is_cache_entry(path)]
    return sorted(entries, key=lambda entry: entry.used)


def foreign_folders(cache: Path) -> list[Path]:
    """What the cache's ``datasets/`` and ``shards/`` hold that ladle did not write: listed, never pruned."""
    return [path for path in _folders(cache) if not is_cache_entry(path)]


def _folders(cache: Path) -> list[Path]:
    return [path for section in ("datasets", "shards") if (cache / section).is_dir()
            for path in sorted((cache / section).iterdir())]


def _describe(path: Path) -> str:
    if path.name.startswith("."):
        return "left by an interrupted or running build"
    try:
        if (path / "meta.json").is_file():
            meta = read_json(path / "meta.json")
            return f"dataset {meta['dataset']}: {meta['num_nodes']} nodes"
        if (path / "shards.json").is_file():
            inputs = read_json(path / "shards.json")["inputs"]
            return (f"shards of {inputs['dataset']}: view {inputs['view']['kind']}, K={inputs['ingredients']}, "
                    f"seed {inputs['seed']}")
    except (LadleError, KeyError, TypeError):
        return "unreadable"
    return "incomplete"


def _size(path: Path) -> int:
    return sum(os.lstat(os.path.join(folder, name)).st_size
               for folder, _dirs, files in os.walk(path) for name in files)


def select_for_pruning(entries: list[CacheEntry], older_than: float | None, max_size: int | None,
                       now: float) -> list[CacheEntry]:
    """The entries to remove: unused for more than ``older_than`` seconds, then the least recently used
    until the rest fit ``max_size`` bytes."""
    doomed = [e for e in entries if older_than is not None and now - e.used > older_than]
    kept = sorted((e for e in entries if e not in doomed), key=lambda e: e.used)
    total = sum(e.size for e in kept)
    while max_size is not None and kept and total > max_size:
        oldest = kept.pop(0)
        doomed.append(oldest)
        total -= oldest.size
    return doomed


def _manage_cache(args: argparse.Namespace) -> int:
    """``--list`` and ``--prune``."""
    if args.list and args.prune:
        raise LadleError("give --list or --prune, not both")
    if args.list and (args.older_than or args.max_size):
        raise LadleError("--older-than and --max-size go with --prune")
    cache = cache_dir()
    entries = cache_entries(cache)
    foreign = foreign_folders(cache)
    if foreign:
        print(f"left alone: {len(foreign)} entries under {cache} that ladle did not write "
              f"(no {CACHE_MARKER}), e.g. {foreign[0].parent.name}/{foreign[0].name}")
    if args.list:
        if not entries:
            print(f"the cache {cache} has no entry of ladle's")
            return 0
        print(f"{'MB':>10}  {'last used':<16}  entry")
        for entry in entries:
            used = dt.datetime.fromtimestamp(entry.used).strftime("%Y-%m-%d %H:%M")
            print(f"{entry.size / 2**20:>10.1f}  {used:<16}  {entry.path.parent.name}/{entry.path.name}  ({entry.what})")
        print(f"{sum(e.size for e in entries) / 2**20:.1f} MB in {len(entries)} entries under {cache}")
        return 0
    if args.older_than is None and args.max_size is None:
        raise LadleError("--prune needs --older-than AGE and/or --max-size SIZE (e.g. --older-than 30d --max-size 5G)")
    older_than = None if args.older_than is None else parse_age(args.older_than)
    max_size = None if args.max_size is None else parse_size(args.max_size)
    doomed = select_for_pruning(entries, older_than, max_size, time.time())
    for entry in doomed:
        discard(entry.path)
        print(f"removed {entry.path.parent.name}/{entry.path.name} ({entry.size / 2**20:.1f} MB, {entry.what})")
    left = sum(e.size for e in entries if e not in doomed)
    print(f"removed {len(doomed)} entries ({sum(e.size for e in doomed) / 2**20:.1f} MB); "
          f"{left / 2**20:.1f} MB left under {cache}")
    return 0


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``1.5GiB``, ``1024`` (bytes) -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise LadleError(f"--max-size must be a size such as 500M or 2G, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_age(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w``; a bare number is days -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smhdw]?)\s*", text.lower())
    if not match:
        raise LadleError(f"--older-than must be an age such as 30d, 12h or 90m, got {text!r}")
    return float(match.group(1)) * _SECONDS[match.group(2) or "d"]


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
