"""Where ingredients run: a pool of local worker processes (spawned, reused across ingredients and, within one
Python process, across runs: :class:`LocalPool`), or Ray tasks (:mod:`ladle.train.ray_tasks`).

The launcher prepares the run's shards (once, cached: :mod:`ladle.graph.shards`), the run directory and the
shared initial weights, then hands out ingredient tasks. A worker memory-maps only what its task
sees: the part shard of a ``metis``/``random`` ingredient, else the whole-graph shard (kept for the
next task). Workers use ``cores / workers`` threads each and never talk to one another: no process
group, no messages; each writes its own checkpoint and returns its metadata.
"""
from __future__ import annotations

import concurrent.futures as futures
import datetime as dt
import logging
import multiprocessing as mp
import os
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch_geometric.data import Data

from ladle.core.errors import LadleError
from ladle.core.files import read_json, write_json
from ladle.core.recipe import Recipe
from ladle.core.resources import available_cores, resolve_device
from ladle.core.rundir import (
    BASELINE,
    CHECKPOINTS,
    CONTINUED,
    TRUNK,
    RunDir,
    check_same_run,
    given_or_new_run_dir,
    make_run_dir,
    read_run,
    resolve_run_dir,
    update_latest,
)
from ladle.core.runlock import check_free, lock_run_dir
from ladle.core.storage import save_state
from ladle.core.versions import changed_versions, library_versions
from ladle.graph.given import user_graph
from ladle.graph.pyg_views import check_sampler
from ladle.graph.shards import ShardSet, prepare_shards
from ladle.nn.custom import ModelFactory, check_model_class
from ladle.nn.models import build_model, check_fits
from ladle.nn.saved import (
    check_same_data,
    data_record,
    expected_shapes,
    verify_finished,
)
from ladle.soup.methods import chosen_methods
from ladle.soup.report import failure_reason, fallback_text
from ladle.train.curves import check_loggers, merge_metrics
from ladle.train.ray_tasks import import_ray, run_ray
from ladle.train.task import SAVE_EVERY, IngredientTask, RunSpec
from ladle.train.view_check import (
    branches_hold_the_graph,
    fallback_recipe,
    view_failure,
)
from ladle.train.worker import run_task, start_worker

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished run left: its folder and each ingredient's metadata, and the trunk's, the trunk
    continued's and the baseline's when it has them; ``view_fallback``: why its view was left for the whole graph
    (:mod:`ladle.train.view_check`), if it was."""

    run_dir: Path
    ingredients: list[dict[str, Any]]
    baseline: dict[str, Any] | None = None
    failed: list[str] = field(default_factory=list)
    trunk: dict[str, Any] | None = None
    continued: dict[str, Any] | None = None
    view_fallback: dict[str, Any] | None = None

    def summary_table(self) -> str:
        """A plain-text table of every model: val/test accuracy, epochs, time, memory."""
        rows = [meta for meta in (self.trunk, *self.ingredients, self.continued, self.baseline) if meta]
        lines = [f"{'model':<15}{'view nodes':>11}{'epochs':>8}{'best':>6}{'val':>8}{'test':>8}{'sec':>8}{'RSS MB':>9}"]
        for meta in rows:
            lines.append(
                f"{meta['name']:<15}{meta['view'].get('nodes', 0):>11}{meta['epochs_run']:>8}{meta['best_epoch']:>6}"
                f"{meta['val_acc']:>8.4f}{meta['test_acc']:>8.4f}{meta['train_seconds']:>8.1f}{meta['peak_rss_mb']:>9.0f}"
            )
        lines.extend(f"{name:<15}FAILED" for name in self.failed)
        if self.view_fallback:
            lines.append(fallback_text(self.view_fallback))
        return "\n".join(lines)


def train_ingredients(recipe: Recipe, ingredients: int = 8, workers: int | None = None,
                      run_dir: str | Path | None = None, init: str = "shared", baseline: bool = False,
                      data_root: str | Path | None = None, device: str = "cpu",
                      checkpoints_root: str | Path = CHECKPOINTS, backend: str = "local",
                      ray_options: dict[str, Any] | None = None, save_every: int = SAVE_EVERY,
                      threads: int | None = None, log: tuple[str, ...] = (), data: Data | None = None,
                      model: ModelFactory | None = None) -> RunResult:
    """Train ``ingredients`` models of ``recipe`` in worker processes and write a run directory.

    This is the library call behind ``python -m ladle.train``; it returns when all have finished.
    ``backend``: ``local`` worker processes, or ``ray`` tasks (see :mod:`ladle.train.ray_tasks`).
    ``save_every``: epochs between resumable training-state checkpoints (see :func:`resume_run`).
    ``threads``: torch threads per local worker (default: cores / workers).
    ``log``: metric loggers besides the run's ``metrics.csv`` (``tensorboard``; :mod:`ladle.train.curves`).
    ``data``: your own PyG graph (``x``, ``y``, ``edge_index``, train/val/test masks) instead of the recipe's
    dataset, prepared into shards as a named dataset is; ``recipe.dataset`` then only names it.
    ``model``: your own model, a class (or picklable factory) called as ``model(in_channels, num_classes)`` whose
    ``forward(x, edge_index)`` gives logits (:mod:`ladle.nn.custom`); the recipe's model becomes ``custom``.
    """
    if model is not None:
        recipe = recipe.replace(model="custom")
    spec = RunSpec(recipe, ingredients, init, baseline, save_every, tuple(log), model)
    check_loggers(spec.log)
    check_sampler(recipe.view)
    chosen_methods(recipe.soup.method)  # a typo in the soup section fails now, not after training
    given = None if data is None else user_graph(data, recipe.features)
    if given is not None and backend == "ray":
        raise LadleError("a graph given in memory trains on the local backend (Ray workers read a dataset by name)")
    checkpoints_root = Path(checkpoints_root)
    # a new folder is claimed now, and removed again if the run is refused before anything is written to it
    with given_or_new_run_dir(run_dir, recipe.name, checkpoints_root) as run_path:
        tasks = spec.tasks(run_path)
        workers = _check_backend(backend, workers, len(tasks))
        device = device if backend == "ray" else resolve_device(device)  # Ray's GPUs live on the cluster
        data_root = None if data_root is None else str(data_root)
        _check_creatable(run_path)  # before the (maybe long) preparation
        check_free(run_path)
        check_same_run(run_path, spec.definition())
        shards = prepare_shards(recipe, ingredients, data_root, graph=given)  # once, cached; bad view settings fail here
        check_fits(recipe, shards.meta["graph"]["num_features"], shards.meta["graph"]["num_classes"], model)
        make_run_dir(run_path)

        with lock_run_dir(run_path, "ladle.train"):  # held to the end: one owner at a time
            check_same_run(run_path, spec.definition())  # again, now that no one else can write it
            files = RunDir(run_path)
            graph = shards.meta["graph"]
            torch.manual_seed(recipe.seed)
            save_state(files.init, build_model(recipe, graph["num_features"], graph["num_classes"], model).state_dict())
            partition = shards.partition()
            if partition is not None:
                save_state(files.partition, {"parts": partition})
            shards.link(run_path)
            threads = threads or max(1, available_cores() // workers)
            run_meta = spec.to_json() | {
                "workers": workers, "threads": threads, "device": device, "backend": backend,
                "created": dt.datetime.now().isoformat(timespec="seconds"), "versions": library_versions(),
                "dataset": {"name": recipe.dataset, "nodes": graph["num_nodes"], "edges": graph["num_edges"],
                            "features": graph["num_features"], "classes": graph["num_classes"]},
                "shards": shards.meta["key"], "data": data_record(recipe.dataset, data_root, given),
                "status": "running",
            }
            write_json(files.run_json, run_meta)
            if run_dir is None or run_path.parent.resolve() == checkpoints_root.resolve():
                update_latest(checkpoints_root, run_path)
            return _execute(run_path, run_meta, spec, tasks, workers, data_root, device, backend, ray_options, threads,
                            given)


def _check_creatable(run_path: Path) -> None:
    """Refuse a run directory that cannot be created or written, without creating anything yet."""
    existing = run_path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise LadleError(f"cannot create run directory {run_path}: {existing} is not a directory "
                         "(choose another --run-dir)")
    if not os.access(existing, os.W_OK):
        raise LadleError(f"run directory {run_path} is not writable (choose another --run-dir)")


def resume_run(run_dir: str | Path | None = None, workers: int | None = None, data_root: str | Path | None = None,
               backend: str | None = None, ray_options: dict[str, Any] | None = None,
               allow_other_data: bool = False, data: Data | None = None,
               model: ModelFactory | None = None) -> RunResult:
    """Finish what an interrupted run left unfinished: ingredients without a finished checkpoint (one that
    loads with the keys and shapes of ``run.json``'s recipe) restart from their last training-state file
    (or from scratch), bitwise as if never stopped. The data must be the run's (``run.json`` records its
    identity; ``data``: the graph it was given in memory), unless ``allow_other_data``. ``model``: the class a
    run of your own model was started with."""
    run_path = resolve_run_dir(run_dir)
    with lock_run_dir(run_path, "ladle.train --resume"):
        run_meta = read_run(run_path)
        check_model_class(run_meta["recipe"]["model"], model)
        spec = RunSpec.from_json(run_meta, model)
        given = None if data is None else user_graph(data, spec.recipe.features)
        check_same_data(run_meta, run_path, data_root, allow_other_data, given)
        check_loggers(spec.log)
        backend = backend or run_meta.get("backend", "local")
        tasks = spec.tasks(run_path)
        expected = expected_shapes(run_meta, model)  # a finished checkpoint that does not load is trained again
        todo = [task for task in tasks if not verify_finished(task.files, task.name, expected)]
        trunk_todo = bool(spec.recipe.trunk.epochs) and not verify_finished(RunDir(run_path), TRUNK, expected)
        log.info("resuming %s: %d of %d still to train%s", run_path, len(todo), len(tasks),
                 ", and the trunk" if trunk_todo else "")
        changed = changed_versions(run_meta.get("versions"))
        if todo and changed:
            log.warning("resuming with other libraries than the run started with (%s): what is trained now may "
                        "differ from what an uninterrupted run would have trained", ", ".join(changed))
        workers = _check_backend(backend, run_meta.get("workers") if workers is None else workers, max(1, len(todo)))
        device = run_meta.get("device", "cpu")
        device = device if backend == "ray" else resolve_device(device)  # Ray's GPUs live on the cluster
        data_root = None if data_root is None else str(data_root)
        if todo or trunk_todo:  # the run's shards, from the cache (or prepared again if it was cleared)
            prepare_shards(spec.recipe, spec.ingredients, data_root, graph=given).link(run_path)
        # each worker's threads as recorded, whatever --workers is now: another count gives other floats
        return _execute(run_path, run_meta, spec, todo, workers, data_root, device, backend, ray_options,
                        run_meta.get("threads"), given)


def _check_backend(backend: str, workers: int | None, tasks: int) -> int:
    if backend == "ray":
        import_ray()  # fail before anything is written when Ray is missing
    elif backend != "local":
        raise LadleError(f"unknown backend {backend!r} (local or ray)")
    workers = min(tasks, available_cores()) if workers is None else workers
    if workers < 1:
        raise LadleError(f"--workers must be >= 1, got {workers}")
    return workers


def _execute(run_path: Path, run_meta: dict[str, Any], spec: RunSpec, tasks: list[IngredientTask], workers: int,
             data_root: str | None, device: str, backend: str, ray_options: dict[str, Any] | None,
             threads: int | None = None, graph: Data | None = None) -> RunResult:
    files = RunDir(run_path)
    threads = threads or max(1, available_cores() // workers)

    def train(spec: RunSpec, tasks: list[IngredientTask]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        return _train(files, run_meta, spec, tasks, workers, data_root, device, backend, ray_options, threads)

    results, failed = train(spec, tasks)
    metas = _finished(files, spec, results)
    failure = None if failed else view_failure(spec.recipe, metas)
    if failure is not None and not (spec.baseline or branches_hold_the_graph(metas)):
        log.warning("%s looks failed on this graph (%s), but its branches hold their parts alone: rerun with "
                    "--baseline to let the launcher train them again on the whole graph", failure["view"],
                    failure_reason(failure))
        failure = None
    if failure is not None:  # a worker held the whole graph: train the trunk and the branches again on it
        spec = _fall_back(files, run_meta, spec, failure, data_root, graph)
        results, failed = train(spec, [task for task in spec.tasks(run_path) if task.role != BASELINE])
        metas = _finished(files, spec, results)
    run_meta["status"] = "failed" if failed else "done"
    run_meta["failed"] = sorted(failed)
    write_json(files.run_json, run_meta)
    if failed:
        log.error("%d of the run's models failed (%s); once the cause is fixed, `python -m ladle.train --resume "
                  "--run-dir %s` trains them from their last progress file", len(failed), ", ".join(sorted(failed)),
                  run_path)
    merge_metrics(run_path)
    ordered = [metas[name] for name in sorted(metas) if name not in (BASELINE, TRUNK, CONTINUED)]
    return RunResult(run_path, ordered, metas.get(BASELINE), sorted(failed), metas.get(TRUNK), metas.get(CONTINUED),
                     run_meta.get("view_fallback"))


def _train(files: RunDir, run_meta: dict[str, Any], spec: RunSpec, tasks: list[IngredientTask], workers: int,
           data_root: str | None, device: str, backend: str, ray_options: dict[str, Any] | None,
           threads: int) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Train the trunk when the recipe has one and it is not finished (beside the baseline, which needs none), and
    ``tasks`` once the trunk has finished (the baseline may still be training); return (metadata by name, error by
    name of those that failed), a failed task's metadata written."""
    recipe = spec.recipe
    pool = LocalPool(recipe, files.shards, workers, device, threads) if backend == "local" else None

    def run(batch: list[IngredientTask], after: dict[str, list[IngredientTask]] | None = None
            ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """``batch``, and each list of ``after`` once its key finished well (see :meth:`LocalPool.run`)."""
        if pool is not None:
            return pool.run(batch, after)
        if not batch:
            return {}, {}
        return run_ray(batch, recipe, ShardSet.open(files.shards), data_root, device, ray_options or {}, after)

    scheduled = list(tasks)
    if recipe.trunk.epochs and not verify_finished(files, TRUNK, expected_shapes(run_meta, spec.model_class)):
        trunk = spec.trunk_task(files.path)  # once, before the branches; the baseline needs no trunk, so beside it
        first = [trunk, *(task for task in tasks if task.role == BASELINE)]
        # the trunk continued first among what waits: it trains on the trunk's whole view, the longest of them
        branches = sorted((task for task in tasks if task.role != BASELINE), key=lambda task: task.role != CONTINUED)
        scheduled.append(trunk)
        results, failed = run(first, after={TRUNK: branches})
        if TRUNK in failed:
            log.error("the trunk failed, so no ingredient can branch from it")
    else:
        results, failed = run(tasks)
    if recipe.trunk.epochs and TRUNK not in failed:
        run_meta["trunk"] = _trunk_summary(results.get(TRUNK) or read_json(files.meta(TRUNK)))
    for task in scheduled:
        if task.name in failed:
            write_json(files.meta(task.name),
                       {"name": task.name, "k": task.k, "status": "failed", "error": failed[task.name]})
    return results, failed


def _finished(files: RunDir, spec: RunSpec, results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The metadata of every finished model of the run by name (the trunk's too), ``results`` over what is on disk."""
    metas = {task.name: read_json(files.meta(task.name))
             for task in spec.tasks(files.path) if files.finished(task.name)}
    if files.finished(TRUNK):
        metas[TRUNK] = read_json(files.meta(TRUNK))
    return metas | results


def _fall_back(files: RunDir, run_meta: dict[str, Any], spec: RunSpec, failure: dict[str, Any],
               data_root: str | None, graph: Data | None) -> RunSpec:
    """Record that the run's view failed (``run.json``: ``view_fallback``, the recipe now trained, and the one asked
    for in ``asked_recipe``), move the models trained on it to :attr:`RunDir.failed_view`, link the run to the
    shards of the whole-graph recipe, and return the spec that trains the trunk and the branches on it."""
    log.warning("%s failed on this graph (%s); training the trunk and the branches again on the whole graph (the "
                "first ones are kept in %s)", failure["view"], failure_reason(failure), files.failed_view)
    merge_metrics(files.path)
    files.failed_view.mkdir(exist_ok=True)
    if files.metrics.is_file():
        shutil.copy2(files.metrics, files.failed_view / files.metrics.name)
    for name in (TRUNK, *(task.name for task in spec.tasks(files.path) if task.role != BASELINE)):
        for path in (files.weights(name), files.meta(name)):
            if path.exists():
                os.replace(path, files.failed_view / path.name)
    recipe = fallback_recipe(spec.recipe)
    shards = prepare_shards(recipe, spec.ingredients, data_root, graph=graph)  # the whole graph's alone, cached
    shards.link(files.path)
    run_meta.pop("trunk", None)
    run_meta.update(asked_recipe=run_meta["recipe"], recipe=recipe.to_dict(), view_fallback=failure,
                    shards=shards.meta["key"])
    write_json(files.run_json, run_meta)
    return replace(spec, recipe=recipe)


def _trunk_summary(meta: dict[str, Any]) -> dict[str, Any]:
    """What ``run.json`` and the report say of the trunk: its view, epochs, accuracy, time and peak memory."""
    return {key: meta[key] for key in ("view", "epochs_run", "best_epoch", "keep", "val_acc", "test_acc",
                                       "train_seconds", "peak_rss_mb")}


Submitted = tuple[IngredientTask, futures.ProcessPoolExecutor]  # a task and the pool it was given to
DEAD_WORKER = ("BrokenProcessPool: its worker process died, again on its retry, and once more when it ran alone "
               "(killed by the system, e.g. out of memory)")
POOL_ENVIRONMENT = ("LADLE_", "PYTHON", "TORCH", "PYTORCH_", "CUDA_", "OMP_", "MKL_", "KMP_", "OPENBLAS_",
                    "NCCL_", "GLOO_", "RAY_")  # variables a worker's behaviour may depend on


class LocalPool:
    """Spawned worker processes for a run, ``threads`` torch threads each, reading the run's ``shards``. The processes
    outlive the run: a later run of this process (a notebook's, a test's) that asks for as many on the same device,
    from the same working folder, import path and umask, with the same environment variables of ladle, torch and
    Python (:data:`POOL_ENVIRONMENT`), reuses them instead of starting new ones (3 s of imports each); anything else
    starts a new pool. Processes start as tasks need them."""

    _shared: tuple[tuple[Any, ...], futures.ProcessPoolExecutor] | None = None

    def __init__(self, recipe: Recipe, shards: Path, workers: int, device: str, threads: int) -> None:
        self.recipe, self.shards, self.threads = recipe.to_dict(), str(shards), threads
        environment = sorted((k, v) for k, v in os.environ.items() if k.startswith(POOL_ENVIRONMENT))
        umask = os.umask(0o022)  # read it: the only way is to set it
        os.umask(umask)
        self.context = (workers, device, os.getcwd(), tuple(sys.path), umask, tuple(environment))

    def _pool(self, fresh: bool = False) -> futures.ProcessPoolExecutor:
        shared = LocalPool._shared
        if shared is not None and (fresh or shared[0] != self.context):
            shared[1].shutdown()
            shared = LocalPool._shared = None
        if shared is None:
            workers, device = self.context[:2]
            context = mp.get_context("spawn")
            slots = context.Queue()
            for slot in range(workers):
                slots.put(slot)
            pool = futures.ProcessPoolExecutor(workers, mp_context=context, initializer=start_worker,
                                               initargs=(slots, device))
            shared = LocalPool._shared = (self.context, pool)
        return shared[1]

    def run(self, tasks: list[IngredientTask], after: dict[str, list[IngredientTask]] | None = None
            ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """Train ``tasks``, and each list of ``after`` once the task it is keyed by has finished well (the branches,
        once their trunk has, while a baseline goes on); return (metadata by name, error by name of those that
        failed). A failing ingredient does not stop the others. A worker that dies breaks the pool, which fails every
        task it holds: each is tried once more in a new pool, from its last progress file; one broken again waits
        until nothing else runs and is tried alone, so that only a task whose worker dies with no other beside it
        fails (and tasks that died for want of memory together finish one by one)."""
        after = after or {}
        pending = self._submit(tasks)
        results: dict[str, dict[str, Any]] = {}
        failed: dict[str, str] = {}
        breaks: Counter[str] = Counter()  # a task's broken pools: 1, tried again; 2, tried alone; 3, failed
        waiting: list[IngredientTask] = []  # broken twice: each to be tried alone, once nothing else runs
        while pending or waiting:
            if not pending:
                task = waiting.pop(0)
                log.warning("%s: trying it alone, as no other task runs", task.name)
                pending = self._submit([task])
            done, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
            for future in sorted(done, key=lambda done_future: pending[done_future][0].name):  # retried in order
                task, pool = pending.pop(future)
                try:
                    results[task.name] = future.result()
                except futures.process.BrokenProcessPool:
                    self._retire(pool)  # its other processes are gone before anything is tried again
                    breaks[task.name] += 1
                    if breaks[task.name] == 3:
                        failed[task.name] = DEAD_WORKER
                        log.error("%s failed: %s", task.name, DEAD_WORKER)
                    elif breaks[task.name] == 2:
                        log.warning("%s: its pool broke again; it is tried alone once no other task runs", task.name)
                        waiting.append(task)
                    else:
                        log.warning("%s: a worker process of its pool died; trying it once more in a new pool, from "
                                    "its last progress file", task.name)
                        pending |= self._submit([task])
                except (FloatingPointError, RuntimeError, ValueError,
                        LadleError) as error:  # e.g. a shard damaged since the run began
                    log.error("%s failed: %s", task.name, error)
                    failed[task.name] = f"{type(error).__name__}: {error}"
                if task.name in results:
                    pending |= self._submit(after.get(task.name, []))
        return results, failed

    @staticmethod
    def _retire(pool: futures.ProcessPoolExecutor) -> None:
        """Shut a broken ``pool`` down, waiting for its processes to exit, unless an earlier failure already did."""
        shared = LocalPool._shared
        if shared is not None and shared[1] is pool:
            pool.shutdown()
            LocalPool._shared = None

    def _submit(self, tasks: list[IngredientTask]) -> dict[futures.Future[dict[str, Any]], Submitted]:
        if not tasks:
            return {}

        def submit(pool: futures.ProcessPoolExecutor) -> dict[futures.Future[dict[str, Any]], Submitted]:
            return {pool.submit(run_task, task, self.recipe, self.shards, self.threads): (task, pool) for task in tasks}
        try:
            return submit(self._pool())
        except futures.process.BrokenProcessPool:
            return submit(self._pool(fresh=True))
