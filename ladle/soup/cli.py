"""``python -m ladle.soup``: the soup command's arguments, one-line errors and printing."""
from __future__ import annotations

import argparse

from ladle.core.recipe import SOUP_METRICS
from ladle.core.rundir import RunDir
from ladle.nn.custom import import_model_class
from ladle.soup.methods import SOUPS, method_names
from ladle.soup.pipeline import soup_run
from ladle.soup.report import format_table


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ladle.soup`` command line."""
    parser = argparse.ArgumentParser(prog="python -m ladle.soup", description="Soup the ingredients of a run.")
    parser.add_argument("--run-dir", help="run directory (default checkpoints/latest)")
    parser.add_argument("--method", choices=method_names(),
                        help=f"soup method (default all: {', '.join(m.name for m in SOUPS.values() if m.in_all)})")
    parser.add_argument("--grid", type=int, help="alpha grid points for gis (default 21)")
    parser.add_argument("--search", choices=("grid", "fast"), help="alpha search for gis (default grid)")
    parser.add_argument("--metric", choices=SOUP_METRICS, help="validation score to maximise (default acc: ties accepted, as Wortsman et al.)")
    parser.add_argument("--no-recompute-bn", dest="recompute_bn", action="store_false", default=None,
                        help="keep averaged batch-norm statistics instead of recomputing them")
    parser.add_argument("--test-barrier", action="store_true",
                        help="also measure each interpolation step's barrier on the test nodes, whose number resolves a "
                             "sag that a few hundred validation nodes do not (a diagnostic: one whole-graph pass per "
                             "alpha tried, ~170 on 8 ingredients)")
    parser.add_argument("--skip-bad", action="store_true", help="skip corrupt or mismatched ingredients")
    parser.add_argument("--data-root", help="dataset root folder")
    parser.add_argument("--allow-other-data", action="store_true",
                        help="soup on dataset files other than those the run was trained on (refused otherwise)")
    parser.add_argument("--model-class", metavar="MODULE:CLASS",
                        help="the class of your own model, as given to ladle.train (a run trained with one needs it)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ladle.soup``."""
    args = build_parser().parse_args(argv)
    report = soup_run(args.run_dir, args.method, args.grid, args.search, args.metric, args.recompute_bn,
                      args.skip_bad, args.data_root, allow_other_data=args.allow_other_data,
                      model=import_model_class(args.model_class) if args.model_class else None,
                      test_barrier=args.test_barrier)
    print(format_table(report))
    print(f"report: {RunDir(report['run_dir']).report_md}")
    return 0
