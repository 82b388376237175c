"""``python -m ladle.varrate``: the command line of variable-rate partition-parallel training."""
from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

from ladle.core.errors import LadleError
from ladle.core.recipe import PARTITION_KINDS, add_recipe_arguments, recipe_from_args
from ladle.train.curves import LOGGERS, check_loggers
from ladle.varrate.compression import (
    COMPRESSORS,
    SCHEDULES,
    RateSchedule,
    build_compressor,
)
from ladle.varrate.ranks import run_spawned, run_torchrun
from ladle.varrate.trainer import EVAL_EVERY, GRADIENT_DTYPES, VarrateOptions


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ladle.varrate`` command line."""
    parser = argparse.ArgumentParser(
        prog="python -m ladle.varrate",
        description="Partition-parallel GNN training with compressed, variable-rate halo exchange (VARCO).",
        epilog="Recipe keys can be overridden as key=value (e.g. dataset=physics epochs=100). Under torchrun "
               "(RANK/WORLD_SIZE set) the ranks come from torchrun and --ranks is not needed.",
    )
    add_recipe_arguments(parser)
    parser.add_argument("--ranks", "-r", type=int, default=None, help="ranks K on this machine (default 4)")
    parser.add_argument("--workers", "-w", type=int, default=None,
                        help="deprecated alias of --ranks (in ladle.train --workers means concurrency)")
    parser.add_argument("--partition", default="metis", choices=PARTITION_KINDS, help="node partition (default metis)")
    parser.add_argument("--schedule", default="adaptive", choices=SCHEDULES,
                        help="compression ratio over training (default adaptive: halved whenever the training loss "
                             "stalls; chosen by measurement, see bench/RESULTS.md)")
    parser.add_argument("--compress", default="mask", choices=tuple(COMPRESSORS),
                        help="compression operator (default mask: d/r random columns, scaled to be unbiased; "
                             "truncate: the authors' first d/r columns)")
    parser.add_argument("--rate-max", type=float, default=64.0,
                        help="ratio at the start (linear, step, adaptive) or throughout (fixed); default 64")
    parser.add_argument("--rate-min", type=float, default=1.0,
                        help="ratio at the end (linear, step, adaptive); default 1")
    parser.add_argument("--rate-fraction", type=float, default=1.0,
                        help="fraction of the epochs over which linear/step reach --rate-min (default 1)")
    parser.add_argument("--rate-steps", help="step schedule ratios, comma-separated (default: 4 geometric steps "
                        "from --rate-max to --rate-min, e.g. 64,16,4,1)")
    parser.add_argument("--rate-patience", type=int, default=10,
                        help="adaptive: halve the ratio after this many epochs without the training loss improving "
                             "(default 10)")
    parser.add_argument("--rate-tolerance", type=float, default=0.01,
                        help="adaptive: the fall of the training loss that counts as improving, as a share of the "
                             "first epoch's loss (default 0.01)")
    parser.add_argument("--error-feedback", action="store_true",
                        help="senders add what compression lost in the last step to the rows they compress next "
                             "(--compress mask, then unscaled, or int8)")
    parser.add_argument("--select", type=float, default=1.0, metavar="FRACTION",
                        help="training exchanges send this random fraction of each peer's boundary rows (all rows at "
                             "a layer's first exchange); the receiver reuses its last copy of the others (default 1)")
    parser.add_argument("--exact-tail", type=int, default=0, metavar="EPOCHS",
                        help="the last EPOCHS epochs exchange exactly (ratio 1) whatever the schedule (default 0)")
    parser.add_argument("--no-input-cache", dest="cache_inputs", action="store_false",
                        help="exchange the first layer's projected halo rows every step, forward and back, instead "
                             "of fetching the halo's input features once at setup (the authors' scheme)")
    parser.add_argument("--gradients", default="bfloat16", choices=tuple(GRADIENT_DTYPES),
                        help="dtype of the gradient all-reduce (default bfloat16: half float32's bytes, as DDP's "
                             "bf16 compress hook; float32 sums exactly)")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY,
                        help=f"epochs between exact (uncompressed) evaluations, and the last epoch (default {EVAL_EVERY})")
    parser.add_argument("--run-dir", type=Path, help="output folder (default checkpoints/varrate-<schedule>-<time>)")
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"),
                        help="cpu (gloo) or cuda (NCCL, one GPU per rank); default cpu")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective may wait before the run fails (default 300)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (default cores / local ranks)")
    parser.add_argument("--log", action="append", default=[], choices=LOGGERS,
                        help="also log the training curve to TensorBoard event files in the run directory "
                             "(pip install 'ladle[tensorboard]'); the run's CSV of curves is always written")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _parse_steps(text: str | None) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        return tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise LadleError(f"--rate-steps must be comma-separated numbers, e.g. 64,16,4,1; got {text!r}") from None


def _ranks(args: argparse.Namespace) -> int | None:
    """``--ranks``, or the deprecated ``--workers`` with a warning; None when neither is given."""
    if args.workers is None:
        return args.ranks
    if args.ranks is not None:
        raise LadleError("pass --ranks only (--workers is its deprecated alias)")
    warnings.warn("ladle.varrate --workers is deprecated, use --ranks (the number of ranks)", FutureWarning,
                  stacklevel=2)
    return args.workers


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ladle.varrate``."""
    args = build_parser().parse_intermixed_args(argv)  # key=value may come before or after flags
    ranks = _ranks(args)
    recipe = recipe_from_args(args)
    if args.timeout <= 0 or args.threads < 0:
        raise LadleError("--timeout must be > 0 and --threads >= 0")
    schedule = RateSchedule(args.schedule, args.rate_max, args.rate_min, args.rate_fraction,
                            _parse_steps(args.rate_steps), args.rate_patience, args.rate_tolerance, args.exact_tail)
    build_compressor(args.compress)
    check_loggers(args.log)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if ranks is None:
        ranks = 0 if under_torchrun else 4
    options = VarrateOptions(ranks, args.partition, schedule, args.compress, args.device, args.timeout,
                             args.threads, args.eval_every, tuple(args.log), args.error_feedback, args.select,
                             args.cache_inputs, args.gradients)
    if under_torchrun:
        meta = run_torchrun(recipe, options, args.run_dir, args.data_root)
    else:
        meta = run_spawned(recipe, options, args.run_dir, args.data_root)
    if meta is not None:
        sent = meta["bytes"]
        print(f"test acc {meta['test_acc']:.4f} (best epoch {meta['best_epoch']}, val {meta['val_acc']:.4f}); "
              f"sent {sent['total'] / 1e6:.2f} MB in all: {sent['forward_halo'] / 1e6:.2f} forward halo, "
              f"{sent['backward_halo'] / 1e6:.2f} backward halo, {sent['allreduce'] / 1e6:.2f} gradient all-reduce, "
              f"{sent['eval_halo'] / 1e6:.2f} evaluation halo ({meta['evaluations']} evaluations), "
              f"{(sent['metrics'] + sent['setup']) / 1e6:.3f} metrics and setup")
        print(f"run directory: {meta['run_dir']}")
    return 0
