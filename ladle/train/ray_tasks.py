"""The Ray backend: each ingredient is one Ray task on a cluster (or on a local one started for the run).

Tasks never talk to each other, exactly as on the local backend. A Ray task trains from the run's prepared
shards through the local workers' own step (:class:`~ladle.train.worker.ShardWorker`): a partition ingredient
memory-maps its part shard only, anything else the whole-graph shard, kept by the Ray worker process for the
next task; it uses ``--cpus-per-ingredient`` threads, so the same seed gives bit-identical weights on both
backends. Where the shards come from on a node: the driver's cache folder when the node sees it (shared
storage, e.g. ``LADLE_CACHE`` on NFS); else the node prepares the same inputs into its own cache (its
``--data-root`` must hold the same dataset files, same sizes and mtimes) in a fresh process, once per node (its
other worker processes wait for it, then read it from the cache), and the result is checked against the driver's:
the same cache key and the same partition digest, or the task fails naming both.

Where the weights go: by default each task writes its checkpoint into the run directory itself,
which must then be on storage every node sees. With ``gather`` the task trains in a temporary folder
of its own node and returns every file it wrote there (checkpoint, metadata, training curves); the
driver writes them into the run directory (atomically).

Your own model (``--model-class``): when ladle opens the Ray session, the top-level module or package of your
class is shipped to every node (Ray's job ``runtime_env``, ``py_modules``), unless it is installed in the
driver's environment (then every node must have it installed, as ladle itself). In a Ray session you opened
yourself, pass it in your ``ray.init(runtime_env={"py_modules": [...]})``.

Failures: a crashed worker and a raising task are retried up to ``MAX_RETRIES`` times; a NaN loss
(``FloatingPointError``) or bad input (``LadleError``) would fail the same way again, so it is
reported as that ingredient's failure at once.

Fault injection, for tests and for trying a cluster's recovery: ``LADLE_RAY_FAULT=MODE:NAME:DIR``
on the driver makes the first attempt of ingredient ``NAME`` (e.g. ``ingredient-01``) fail, where
``MODE`` is ``raise`` (a ``RuntimeError``) or ``exit`` (its worker process dies). The attempt leaves
the marker file ``DIR/NAME.MODE``; later attempts see it and train normally. ``DIR`` must be
visible to the workers.
"""
from __future__ import annotations

import concurrent.futures as futures
import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import multiprocessing as mp
import os
import socket
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ladle.core.errors import LadleError
from ladle.core.files import atomic_open, write_json
from ladle.core.recipe import Recipe, recipe_from_dict
from ladle.core.resources import available_cores
from ladle.core.rundir import CONTINUED, TRUNK, RunDir
from ladle.core.storage import save_state
from ladle.graph.cache import cache_dir
from ladle.graph.shards import ShardSet, cached_shards, prepare_shards
from ladle.train.task import INGREDIENT, IngredientTask
from ladle.train.worker import ShardWorker, kept_worker

log = logging.getLogger(__name__)

MAX_RETRIES = 3  # attempts after the first, for a crashed worker or a raising task
FAULT_ENV = "LADLE_RAY_FAULT"
FAULT_MODES = ("raise", "exit")


def import_ray() -> Any:
    """The ``ray`` module, or a one-line error naming the extra to install (a launcher may call it early)."""
    try:
        import ray
    except ImportError:
        raise LadleError("--backend ray needs Ray: pip install 'ladle[ray]'") from None
    return ray


@dataclass(frozen=True)
class ShardSource:
    """The driver's shards of the run, as a node finds or rebuilds them: their folder, cache key, partition
    digest and the number of ingredients they were prepared for."""

    path: str
    key: str
    digest: str
    ingredients: int

    @classmethod
    def of(cls, shards: ShardSet, ingredients: int) -> ShardSource:
        return cls(str(shards.path.resolve()), shards.meta["key"], partition_digest(shards), ingredients)


def partition_digest(shards: ShardSet) -> str:
    """The SHA-256 of a shard set's partition (``""`` without one): what may differ between two preparations of the
    same inputs (METIS draws from the process-wide ``rand()``)."""
    partition = shards.partition()
    return "" if partition is None else hashlib.sha256(partition.numpy().tobytes()).hexdigest()


def _prepare(recipe: dict[str, Any], ingredients: int, data_root: str | None) -> str:
    """Prepare a run's shards into this node's cache (in a process of its own); their folder."""
    return str(prepare_shards(recipe_from_dict(recipe), ingredients, data_root).path)


def node_shards(source: ShardSource, recipe: Recipe, data_root: str | None) -> ShardSet:
    """The run's shards on this node: the driver's folder when it is reachable here, else the same inputs in this
    node's cache (prepared there by the first worker process that needs them, while the others wait), checked to be
    the driver's (cache key and partition digest)."""
    shards = _complete(Path(source.path), source.key)
    if shards is not None:
        return shards
    with _held(cache_dir() / "locks" / f"shards-{source.key}.lock"):
        shards = _complete(cached_shards(source.key), source.key)
        if shards is None:
            log.info("the driver's shards %s are not reachable here; preparing them on this node", source.path)
            # a fresh process: METIS draws from the process-wide rand(), which Ray's own threads also call
            with futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
                prepared = pool.submit(_prepare, recipe.to_dict(), source.ingredients, data_root).result()
            shards = ShardSet.open(Path(prepared))
    digest = partition_digest(shards)
    if shards.meta["key"] != source.key or digest != source.digest:
        raise LadleError(f"the shards prepared on {socket.gethostname()} ({shards.meta['key']}, partition "
                         f"{digest[:12] or 'none'}) differ from the driver's ({source.key}, "
                         f"{source.digest[:12] or 'none'}): give every node the same dataset files (same sizes and "
                         "mtimes) or put LADLE_CACHE on storage every node sees")
    return shards


def _complete(folder: Path, key: str) -> ShardSet | None:
    """The complete shards in ``folder`` if they are those of cache key ``key``, else None."""
    with contextlib.suppress(LadleError, OSError):
        shards = ShardSet.open(folder)
        if shards.meta.get("key") == key and shards.complete():
            return shards
    return None


@contextlib.contextmanager
def _held(lock_file: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_file`` while the block runs (the kernel drops it if the process dies); where
    the file system has no ``flock``, the block runs unlocked (a concurrent preparation is then only wasted work)."""
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_file, "a")
    except OSError as error:
        raise LadleError(f"cannot write to the cache {lock_file.parent.parent}: {error.strerror} "
                         "(set LADLE_CACHE to a writable folder)") from None
    with handle:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _parse_fault(spec: str | None) -> tuple[str, str, Path] | None:
    """``MODE:NAME:DIR`` from ``LADLE_RAY_FAULT`` as (mode, ingredient name, marker folder)."""
    if not spec:
        return None
    mode, _, rest = spec.partition(":")
    name, _, folder = rest.partition(":")
    if mode not in FAULT_MODES or not name or not folder:
        raise LadleError(f"{FAULT_ENV}={spec!r}: expected MODE:NAME:DIR with MODE one of {', '.join(FAULT_MODES)}")
    return mode, name, Path(folder)


def _maybe_fault(fault: tuple[str, str, Path] | None, name: str) -> None:
    """Fail this attempt if it is the first one of the ingredient named by the fault spec."""
    if fault is None or fault[1] != name:
        return
    mode, _, folder = fault
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / f"{name}.{mode}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # an earlier attempt already failed
    if mode == "exit":
        os._exit(1)
    raise RuntimeError(f"{name}: injected fault on the first attempt ({FAULT_ENV})")


def _train_task(recipe: Recipe, task: IngredientTask, source: ShardSource, data_root: str | None, device: str,
                threads: int, init_bytes: bytes | None, trunk_bytes: bytes | None, gather: bool,
                fault: tuple[str, str, Path] | None) -> tuple[dict[str, Any], dict[str, bytes] | None]:
    """Body of one Ray task: train ``task`` from the run's shards (:func:`node_shards`) and return (metadata,
    when gathering the files it wrote by path relative to the run directory; the shared init and the trunk
    then come as bytes too, the partition from the shards).

    A ``FloatingPointError`` or ``LadleError`` (e.g. no dataset under ``data_root`` on this node) comes
    back as ``{"error": ...}`` instead of raising, so Ray does not retry what would fail again; any other
    exception raises and is retried.
    """
    _maybe_fault(fault, task.name)
    try:
        # Ray reuses its worker processes for the next tasks: they keep the run's worker (and its whole graph)
        worker = kept_worker((source, recipe.to_dict(), device),
                             lambda: ShardWorker(recipe, node_shards(source, recipe, data_root), 0, device))
        if not gather:
            return worker.run(task, threads), None
        with tempfile.TemporaryDirectory(prefix="ladle-ray-") as scratch:
            local = RunDir(Path(scratch))
            given = {path: payload for path, payload in ((local.init, init_bytes), (local.weights(TRUNK), trunk_bytes))
                     if payload is not None}  # what the task reads, never returns (a trunk task returns its own)
            for path, payload in given.items():
                path.write_bytes(payload)
            partition = worker.shards.partition()
            if partition is not None:
                save_state(local.partition, {"parts": partition})
            meta = worker.run(dataclasses.replace(task, run_dir=local.path), threads)
            read = {*given, local.partition}
            return meta, {str(path.relative_to(local.path)): path.read_bytes()
                          for path in sorted(local.path.rglob("*")) if path.is_file() and path not in read}
    except (FloatingPointError, LadleError) as error:
        return {"error": f"{type(error).__name__}: {error}"}, None


def _connect(ray: Any, address: str | None, code: list[str]) -> bool:
    """Join the cluster at ``address``, or start a local one, shipping ``code`` (:func:`_model_code`) to its
    nodes; True when this call initialised Ray.

    A Ray session the caller already opened is reused as it is.
    """
    if ray.is_initialized():
        log.info("using the Ray session already open in this process")
        if code:
            log.warning("your model's code (%s) must be importable on every Ray node: ladle ships it only in a "
                        "session it opens", ", ".join(code))
        return False
    runtime_env = {"py_modules": code} if code else None
    if code:
        log.info("shipping your model's code to the Ray nodes: %s", ", ".join(code))
    try:
        if address is None:
            cores = available_cores()
            log.info("starting a local Ray cluster with %d CPUs", cores)
            # "local": never join a cluster found via RAY_ADDRESS or a stale ray start; no dashboard for a throwaway one
            ray.init(address="local", num_cpus=cores, include_dashboard=False, runtime_env=runtime_env)
        else:
            ray.init(address=address, runtime_env=runtime_env)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise LadleError(
            f"cannot connect to the Ray cluster at {address}: {first} (is `ray start --head` running there? "
            "a cluster with token auth needs RAY_AUTH_MODE=token and its token in ~/.ray/auth_token or RAY_AUTH_TOKEN)"
        ) from None
    return True


def _model_code(tasks: list[IngredientTask]) -> list[str]:
    """The file (a module) or folder (a package) of the top-level module holding the tasks' own model class, for
    Ray to ship to every node; none for ladle's built-in models or a class from an installed package."""
    classes = {task.model_class for task in tasks if task.model_class is not None}
    installed = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    paths: set[str] = set()
    for model_class in classes:
        top = sys.modules.get(getattr(model_class, "__module__", "").partition(".")[0])
        source = getattr(top, "__file__", None)
        if top is None or source is None or top.__name__ in ("__main__", "ladle"):
            continue
        path = Path(source).resolve()
        if not any(folder in path.parents for folder in installed):
            paths.add(str(path.parent if path.name == "__init__.py" else path))
    return sorted(paths)


def _check_resources(ray: Any, cpus: float, gpus: float) -> None:
    """Refuse a per-ingredient request the whole cluster cannot meet (its tasks would wait forever)."""
    total = ray.cluster_resources()
    for flag, want, have in (("--cpus-per-ingredient", cpus, total.get("CPU", 0.0)),
                             ("--gpus-per-ingredient", gpus, total.get("GPU", 0.0))):
        if want > have:
            raise LadleError(f"{flag} {want:g} but the Ray cluster has {have:g} in all (lower it or add nodes)")


def _failure_message(ray: Any, error: Exception) -> str:
    """One line for a task that failed after its retries: the user's exception, or what Ray saw."""
    if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        return f"{type(error.cause).__name__}: {error.cause}"
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first} (after {MAX_RETRIES} retries)"


def run_ray(tasks: list[IngredientTask], recipe: Recipe, shards: ShardSet, data_root: str | None, device: str,
            options: dict[str, Any], after: dict[str, list[IngredientTask]] | None = None
            ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Run each ingredient as a Ray task on the run's ``shards`` (:func:`node_shards`), and each list of ``after``
    once the task it is keyed by has finished well (the branches, once their trunk has: its weights are read then);
    return (metadata by task name, error message by name of failed tasks).

    ``options``: ``address`` (None: start a local cluster), ``cpus`` and ``gpus`` per ingredient, and
    ``gather`` (return weights to the driver instead of writing to shared storage).
    """
    after = after or {}
    everything = [*tasks, *(task for waiting in after.values() for task in waiting)]
    ray = import_ray()
    cpus = float(options.get("cpus") or 1.0)
    gpus = float(options.get("gpus") or 0.0)
    gather = bool(options.get("gather"))
    if cpus <= 0 or gpus < 0:
        raise LadleError(f"--cpus-per-ingredient must be > 0 and --gpus-per-ingredient >= 0, got {cpus:g}, {gpus:g}")
    if device == "cuda" and gpus <= 0:
        raise LadleError("--device cuda with --backend ray needs --gpus-per-ingredient > 0 (e.g. 1, or 0.5 to share)")
    if device == "cpu" and gpus > 0:
        log.warning("each ingredient reserves %g GPUs but trains on the CPU (pass --device cuda to use them)", gpus)
    fault = _parse_fault(os.environ.get(FAULT_ENV))

    started = _connect(ray, options.get("address"), _model_code(everything))
    try:
        _check_resources(ray, cpus, gpus)
        remote = ray.remote(_train_task).options(num_cpus=cpus, num_gpus=gpus, max_retries=MAX_RETRIES,
                                                 retry_exceptions=True)
        threads = max(1, int(cpus))
        source = ShardSource.of(shards, everything[0].num_ingredients) if everything else None
        shared = [task for task in everything if task.init == "shared"]
        init_ref = ray.put(shared[0].files.init.read_bytes()) if gather and shared else None

        def submit(batch: list[IngredientTask]) -> dict[Any, IngredientTask]:
            """Submit ``batch``; when gathering, the trunk's bytes go to the object store with the batch of its
            branches (they are on the driver only once the trunk is done)."""
            if not batch:
                return {}
            branches = [task for task in batch if task.role in (INGREDIENT, CONTINUED)]
            trunk_ref = (ray.put(branches[0].files.weights(TRUNK).read_bytes())
                         if gather and branches and recipe.trunk.epochs else None)
            log.info("submitted %d ingredients to Ray (%g CPUs, %g GPUs each%s)",
                     len(batch), cpus, gpus, ", gathering weights" if gather else "")
            return {remote.remote(recipe, task, source, data_root, device, threads,
                                  init_ref if task.init == "shared" else None, trunk_ref, gather, fault): task
                    for task in batch}
        return _collect(ray, submit, tasks, after)
    finally:
        if started:
            ray.shutdown()


def _write_gathered(run_dir: Path, gathered: dict[str, bytes]) -> None:
    """Write the files a gathering task returned into ``run_dir`` (paths inside it only)."""
    for relative, payload in gathered.items():
        path = Path(relative)
        if path.is_absolute() or ".." in path.parts:
            raise LadleError(f"a Ray task returned the path {relative!r}, outside the run directory")
        with atomic_open(run_dir / path) as stream:
            stream.write(payload)


def _collect(ray: Any, submit: Callable[[list[IngredientTask]], dict[Any, IngredientTask]],
             tasks: list[IngredientTask], after: dict[str, list[IngredientTask]]
             ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Submit ``tasks``, wait for them as they finish, write gathered checkpoints, submit what waited for a task
    once it has finished well (``after``), and tick the driver's bar."""
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    pending = submit(tasks)
    total = len(tasks) + sum(map(len, after.values()))
    with tqdm(total=total, desc="ingredients", unit="ingredient", dynamic_ncols=True, disable=None) as bar:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            task = pending.pop(done[0])
            try:
                meta, gathered = ray.get(done[0])
            except ray.exceptions.RayError as error:
                meta, gathered = {"error": _failure_message(ray, error)}, None
            if "error" not in meta:
                checkpoint = task.files.weights(task.name)
                if gathered is not None:
                    _write_gathered(task.files.path, gathered)
                    write_json(task.files.meta(task.name), meta)
                elif not checkpoint.is_file():
                    meta = {"error": f"{checkpoint} was written on a worker's node but is not visible here: "
                                     "put the run directory on shared storage or pass --gather"}
            if "error" in meta:
                log.error("%s failed: %s", task.name, meta["error"])
                failed[task.name] = meta["error"]
            else:
                results[task.name] = meta
                pending |= submit(after.get(task.name, []))
            bar.update(1)
            bar.set_postfix(failed=len(failed))
    return results, failed
