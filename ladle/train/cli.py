"""``python -m ladle.train``: train K ingredients, each alone on its own view of the graph.

The command line over :func:`ladle.train.launch.train_ingredients` (one ingredient's loop:
:mod:`ladle.train.loop`; where ingredients run: :mod:`ladle.train.launch`, :mod:`ladle.train.ray_tasks`) and, with
``--average-every``, :func:`ladle.train.periodic.train_with_averaging`. It imports torch and PyG only once the
command line is read and checked, so ``--help``, ``--list-recipes`` and a bad recipe key answer at once.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from ladle.core.errors import LadleError
from ladle.core.recipe import (
    BranchConfig,
    Recipe,
    add_recipe_arguments,
    override_recipe,
    recipe_from_args,
)
from ladle.core.recipe_files import recipe_names
from ladle.core.rundir import (
    AVERAGED,
    RunDir,
    asked_recipe,
    averaging_run_dir,
    check_averaging_dir,
    make_run_dir,
    read_run,
    resolve_run_dir,
    run_difference,
)
from ladle.core.runlock import check_free, lock_run_dir
from ladle.train.curves import LOGGERS, check_loggers
from ladle.train.task import SAVE_EVERY

log = logging.getLogger(__name__)

def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ladle.train`` command line."""
    parser = argparse.ArgumentParser(
        prog="python -m ladle.train",
        description="Train K GNN ingredients, each in its own process with no communication.",
        epilog="Any recipe key can be overridden as key=value, e.g. dataset=citeseer view.kind=metis epochs=50",
    )
    add_recipe_arguments(parser)
    parser.add_argument("--ingredients", "-k", type=int, help="number of ingredients K (default 8)")
    parser.add_argument("--workers", "-w", type=int, default=None,
                        help="processes training at once (default: min(K, cores))")
    parser.add_argument("--run-dir", type=Path, help="output folder (default checkpoints/<recipe>-<time>)")
    init = parser.add_mutually_exclusive_group()
    init.add_argument("--shared-init", dest="init", action="store_const", const="shared",
                      help="all ingredients start from the same weights (default; with trunk.epochs > 0: the trunk)")
    init.add_argument("--independent-init", dest="init", action="store_const", const="independent",
                      help="each ingredient draws its own initial weights")
    parser.add_argument("--resume", action="store_true",
                        help="finish an interrupted run (--run-dir, default checkpoints/latest) as it was recorded; "
                             "a flag that contradicts the record is refused")
    parser.add_argument("--allow-other-data", action="store_true",
                        help="with --resume: train on dataset files other than the run's (refused otherwise)")
    parser.add_argument("--save-every", type=int, metavar="N",
                        help="save the resumable training state every N epochs (default 10, 0: never)")
    parser.add_argument("--average-every", type=int, metavar="T",
                        help="instead of independent ingredients: K trainers whose weights are averaged every T "
                             "epochs (periodic averaging, the one mode that communicates); writes averaged.*")
    parser.add_argument("--baseline", action="store_true", default=None,
                        help="also train one full-graph model for trunk.epochs + epochs (the soup's reference)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where to train (default cpu)")
    parser.add_argument("--backend", choices=("local", "ray"),
                        help="local worker processes (default) or a Ray cluster (pip install 'ladle[ray]')")
    parser.add_argument("--address", help="Ray cluster address (auto, HOST:PORT); default: start a local one")
    parser.add_argument("--cpus-per-ingredient", type=float, default=1.0, help="Ray: CPUs per ingredient task")
    parser.add_argument("--gpus-per-ingredient", type=float, default=0.0, help="Ray: GPUs per ingredient task")
    parser.add_argument("--gather", action="store_true",
                        help="Ray: return weights to the driver and write them there (no shared storage needed)")
    parser.add_argument("--log", action="append", choices=LOGGERS,
                        help="also log the training curves to TensorBoard event files in the run directory "
                             "(pip install 'ladle[tensorboard]'); the run's CSV of curves is always written")
    parser.add_argument("--model-class", metavar="MODULE:CLASS",
                        help="train your own model: a torch.nn.Module class called as Class(in_channels, num_classes) "
                             "whose forward(x, edge_index) gives logits (importable, e.g. from the working folder); "
                             "the recipe's model becomes custom, and ladle.soup needs the same flag")
    parser.add_argument("--list-recipes", action="store_true", help="list the recipes --recipe NAME finds, and exit")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ladle.train``."""
    args = build_parser().parse_intermixed_args(argv)  # key=value overrides anywhere among the flags
    if args.list_recipes:
        for name, path in sorted(recipe_names().items()):
            print(f"{name:<16} {path}")
        return 0
    ray_options = {"address": args.address, "cpus": args.cpus_per_ingredient, "gpus": args.gpus_per_ingredient,
                   "gather": args.gather}
    if args.save_every is not None and args.save_every < 0:
        raise LadleError(f"--save-every must be >= 0, got {args.save_every}")
    check_loggers(args.log or [])
    if args.resume:
        run_dir = resolve_run_dir(args.run_dir)
        _check_resume_flags(args, read_run(run_dir))
        from ladle.train.launch import resume_run  # torch and PyG from here on
        run = resume_run(run_dir, args.workers, args.data_root, args.backend, ray_options, args.allow_other_data,
                         model=_model_class(args))
        print(run.summary_table())
        print(f"run directory: {run.run_dir}")
        return 0 if not run.failed else 1
    if args.allow_other_data:
        raise LadleError("--allow-other-data goes with --resume (a new run records the data it trains on)")
    recipe = recipe_from_args(args)
    args.ingredients = 8 if args.ingredients is None else args.ingredients
    args.log = args.log or []
    if args.average_every is not None:
        if args.model_class or recipe.model == "custom":
            raise LadleError("--average-every trains ladle's built-in models only (drop --model-class)")
        unused = [flag for flag, given in (("--device", args.device not in (None, "cpu")),
                                           ("--backend", args.backend not in (None, "local")),
                                           ("--baseline", args.baseline), ("--shared/--independent-init", args.init),
                                           ("--save-every", args.save_every is not None)) if given]
        if unused:
            raise LadleError(f"--average-every steps K trainers from one init in this process, on the CPU, and saves "
                             f"at the end: drop {', '.join(unused)}")
        if recipe.trunk.epochs or recipe.branch != BranchConfig():
            log.warning("--average-every trains no trunk and reads no branch.* key: every trainer starts from the "
                        "shared init at lr %g (the recipe's trunk and branch sections are not used)", recipe.lr)
        return _train_averaged(recipe, args)
    from ladle.train.launch import train_ingredients  # torch and PyG from here on
    run = train_ingredients(recipe, ingredients=args.ingredients, workers=args.workers, run_dir=args.run_dir,
                            init=args.init or "shared", baseline=bool(args.baseline), data_root=args.data_root,
                            device=args.device or "cpu", backend=args.backend or "local", ray_options=ray_options,
                            save_every=SAVE_EVERY if args.save_every is None else args.save_every,
                            log=tuple(args.log), model=_model_class(args))
    print(run.summary_table())
    print(f"run directory: {run.run_dir}")
    return 0 if not run.failed else 1


def _model_class(args: argparse.Namespace) -> Any:
    """The class ``--model-class`` names, imported (torch with it), or None."""
    if not args.model_class:
        return None
    from ladle.nn.custom import import_model_class
    return import_model_class(args.model_class)


def _check_resume_flags(args: argparse.Namespace, run: dict[str, Any]) -> None:
    """Refuse ``--resume`` flags that contradict the run's ``run.json`` (a resumed run is the run it was);
    ``--workers``, ``--backend``, ``--data-root`` and the Ray options may change."""
    if args.average_every is not None:
        raise LadleError("--average-every starts a periodic-averaging run; it cannot --resume one")
    recipe = None
    if args.recipe is not None:
        recipe = recipe_from_args(args)
    elif args.overrides or args.seed is not None:
        recipe = override_recipe(asked_recipe(run), [*args.overrides, *([f"seed={args.seed}"] if args.seed is not None else [])])
    contradictions = run_difference(run, recipe, {
        "--ingredients": (args.ingredients, run["ingredients"]), "init": (args.init, run["init"]),
        "--baseline": (args.baseline, bool(run.get("baseline"))),
        "--save-every": (args.save_every, run.get("save_every", SAVE_EVERY)),
        "--device": (_auto_device() if args.device == "auto" else args.device, run.get("device", "cpu")),
        "--log": (args.log and sorted(args.log), sorted(run.get("log", ())))})
    if contradictions:
        raise LadleError(f"--resume finishes the run as it was recorded, and these flags contradict it: "
                         f"{contradictions}. Drop them, or start a new run (another --run-dir)")


def _auto_device() -> str:
    """What ``--device auto`` resolves to here (imports torch)."""
    from ladle.core.resources import resolve_device
    return resolve_device("auto")


def _train_averaged(recipe: Recipe, args: argparse.Namespace) -> int:
    """``--average-every T``: periodic averaging into ``--run-dir`` (an ingredient run's, to compare)."""
    import torch

    from ladle.graph.datasets import load_dataset
    from ladle.nn.models import check_fits
    from ladle.train.periodic import check_averaging, train_with_averaging

    torch.set_num_threads(args.workers or torch.get_num_threads())
    check_averaging(args.ingredients, args.average_every)  # before any folder is made
    run_dir = args.run_dir or averaging_run_dir(recipe.name, args.average_every)
    check_averaging_dir(run_dir)
    check_free(run_dir)
    data = load_dataset(recipe.dataset, args.data_root, recipe.split, recipe.features)
    check_fits(recipe, data.num_features, data.num_classes)
    make_run_dir(run_dir)
    with lock_run_dir(run_dir, "ladle.train --average-every"):
        meta = train_with_averaging(recipe, data, args.ingredients, args.average_every, run_dir, tuple(args.log))
    print(f"averaged every {args.average_every} epochs, K={args.ingredients}: val {meta['val_acc']:.4f} "
          f"test {meta['test_acc']:.4f}, {meta.get('bytes', 0) / 1e6:.1f} MB sent, {meta['seconds']:.1f} s")
    print(f"written: {RunDir(run_dir).weights(AVERAGED)}")
    return 0
