"""``python -m ladle.prepare``: load, partition and shard a run's graph once, before training it.

Takes the recipe arguments of ``python -m ladle.train``; a later ``ladle.train`` with the same
dataset, view, ``-k`` and seed finds the shards in the cache and links them into its run directory
instead of loading the whole graph (see :mod:`ladle.shards`).
"""
from __future__ import annotations

import argparse

from ladle.config import add_recipe_arguments, recipe_from_args
from ladle.errors import run_cli
from ladle.shards import prepare_shards, summary_table


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ladle.prepare`` command line."""
    parser = argparse.ArgumentParser(
        prog="python -m ladle.prepare",
        description="Prepare (once, cached) the per-ingredient shards of a run.",
        epilog="Any recipe key can be overridden as key=value, e.g. dataset=physics view.kind=metis",
    )
    add_recipe_arguments(parser)
    parser.add_argument("--ingredients", "-k", type=int, default=8, help="number of ingredients K (default 8)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache has these shards")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ladle.prepare``."""
    args = build_parser().parse_args(argv)
    recipe = recipe_from_args(args)
    shards = prepare_shards(recipe, args.ingredients, args.data_root, args.force)
    print(summary_table(shards))
    print(f"shards: {shards.path} (prepared in {shards.meta['seconds']:.1f} s; "
          "ladle.train with the same recipe, -k and seed links them as <run>/shards)")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
