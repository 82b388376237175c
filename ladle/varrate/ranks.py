"""Varrate's ranks: joining the process group, loading a rank's data, and starting the ranks, either
spawned on this machine (:func:`run_spawned`) or as one of a torchrun group (:func:`run_torchrun`)."""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ladle.core.collectives import ring_broadcast_bytes
from ladle.core.errors import LadleError
from ladle.core.files import read_json
from ladle.core.recipe import Recipe, recipe_from_dict
from ladle.core.resources import available_cores, die_with_parent, resolve_device
from ladle.core.rundir import (
    RunDir,
    check_varrate_dir,
    given_or_new_run_dir,
    make_run_dir,
)
from ladle.core.runlock import check_free, hold_as_worker, lock_run_dir
from ladle.graph.datasets import load_dataset
from ladle.varrate.halo import partition_nodes
from ladle.varrate.trainer import RankData, VarrateOptions, check_model, train_partition

log = logging.getLogger(__name__)


def init_group(device: torch.device, timeout: float, init_method: str = "env://", rank: int | None = None,
               world: int | None = None) -> None:
    """Join the process group: gloo on CPU, NCCL on GPU, with ``timeout`` seconds before a stall is an error.

    ``rank``/``world`` None: read from the environment (torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``).
    """
    kwargs: dict[str, Any] = {} if rank is None else {"rank": rank, "world_size": world}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            timeout=dt.timedelta(seconds=timeout), **kwargs)


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of a rank: the CPU, or GPU ``local_rank`` (mod the GPUs visible) made current."""
    if device != "cuda":
        return torch.device("cpu")
    chosen = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    torch.cuda.set_device(chosen)
    return chosen


def load_rank_data(recipe: Recipe, partition: str, device: torch.device, data_root: str | None,
                   local_rank: int, fetch_inputs: bool = True, parts: Tensor | None = None) -> RankData:
    """Load the dataset, partition it (rank 0, broadcast to all; the bytes counted as ``setup_bytes``) and
    keep this rank's part; ``fetch_inputs``: with its halo's rows of the features (:meth:`RankData.fetch_inputs`);
    ``parts``: the partition when the launcher has computed it already (rank 0 broadcasts it as it is).

    The first rank of each machine loads (stages) the dataset before the others, so they never race
    on the cache.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if local_rank != 0:
        dist.barrier()
    data = load_dataset(recipe.dataset, data_root, recipe.split, recipe.features)
    if local_rank == 0:
        dist.barrier()
    if rank != 0:
        parts = torch.empty(data.num_nodes, dtype=torch.long)
    elif parts is None:
        parts = partition_nodes(data, partition, world, recipe.seed)
    parts = parts.to(device)
    dist.broadcast(parts, src=0)
    sent = ring_broadcast_bytes(parts.numel() * parts.element_size(), world, rank, src=0)
    part = RankData.build(data, parts.cpu(), rank, world, recipe.model, device, setup_bytes=sent)
    if fetch_inputs:
        part.fetch_inputs(data.x[part.plan.owned.cpu()])
    return part


def run_rank(recipe: Recipe, options: VarrateOptions, run_dir: Path | None, data_root: str | None, local_rank: int,
             init_method: str = "env://", rank: int | None = None, world: int | None = None,
             parts: Tensor | None = None) -> dict[str, Any] | None:
    """Everything one rank does: join the group, load its part (``parts``: the partition, when already computed),
    train, leave the group."""
    torch.set_num_threads(options.threads)
    device = rank_device(options.device, local_rank)
    init_group(device, options.timeout, init_method, rank, world)
    try:
        part = load_rank_data(recipe, options.partition, device, data_root, local_rank, options.cache_inputs, parts)
        return train_partition(recipe, part, options, run_dir)
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, world: int, port: int, recipe_dict: dict[str, Any], options: VarrateOptions,
                  run_dir: Path, data_root: str | None, parts: Tensor) -> None:
    """Entry point of a rank started by :func:`run_spawned` (forked from the fork server, or spawned): it dies with
    its parent (the server, which dies with the launcher) and keeps the run directory owned while it lives."""
    die_with_parent()
    hold_as_worker(run_dir)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_rank(recipe_from_dict(recipe_dict), options, run_dir, data_root, rank, f"tcp://127.0.0.1:{port}", rank, world,
             parts)


def _rank_start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``. The server imports torch, PyG and the rank code
    once for this process (:mod:`ladle.varrate.rank_server`), and every rank of every later run forks from it ready,
    where a spawned rank imports them itself (~3 s each). The server only imports (no tensor op, no thread, no CUDA),
    so a fork of it is safe; it dies with this process, and its ranks with it."""
    if "forkserver" not in torch.multiprocessing.get_all_start_methods():
        return "spawn"
    torch.multiprocessing.get_context("forkserver").set_forkserver_preload(["ladle.varrate.rank_server"])
    return "forkserver"


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def check_inputs(recipe: Recipe, options: VarrateOptions, data_root: str | None) -> Tensor:
    """Reject bad input before any rank starts: model, rank count, dataset, partition (stages the data); return the
    partition, which rank 0 then broadcasts instead of computing it again."""
    check_model(recipe)
    if options.ranks < 1:
        raise LadleError(f"--ranks must be >= 1, got {options.ranks}")
    data = load_dataset(recipe.dataset, data_root, recipe.split, recipe.features)
    if options.ranks > data.num_nodes:
        raise LadleError(f"cannot split {data.num_nodes} nodes into {options.ranks} workers")
    return partition_nodes(data, options.partition, options.ranks, recipe.seed)  # a rank without nodes: refused


def run_spawned(recipe: Recipe, options: VarrateOptions, run_dir: Path | None = None,
                data_root: str | Path | None = None) -> dict[str, Any]:
    """Train with ``options.ranks`` ranks spawned on this machine; return rank 0's metadata.

    This is the library call behind ``python -m ladle.varrate`` without torchrun. A rank that fails
    stops the others; the error names it.
    """
    data_root = None if data_root is None else str(data_root)
    options = _resolve(options, options.ranks)
    with given_or_new_run_dir(run_dir, f"varrate-{options.schedule.kind}") as run_path:
        _check_run_dir(run_path)
        parts = check_inputs(recipe, options, data_root)
        make_run_dir(run_path)
        args = (options.ranks, free_port(), recipe.to_dict(), options, run_path, data_root, parts)
        with lock_run_dir(run_path, "ladle.varrate"):
            check_varrate_dir(run_path)  # again, now that no one else can write it
            try:
                torch.multiprocessing.start_processes(_spawned_rank, args=args, nprocs=options.ranks,
                                                      start_method=_rank_start_method())
            except torch.multiprocessing.ProcessRaisedException as error:
                lines = [line for line in str(error).strip().splitlines() if line.strip()]
                log.debug("%s", error)
                raise RuntimeError(f"rank {error.error_index} failed: {lines[-1] if lines else error}") from None
            except torch.multiprocessing.ProcessExitedException as error:
                raise RuntimeError(f"rank {error.error_index} exited with code {error.exit_code}; the other ranks "
                                   "were stopped") from None
            return read_json(RunDir(run_path).varrate_json)


def _check_run_dir(run_path: Path) -> None:
    """Refuse, before any work, a run directory varrate may not write: see :func:`check_varrate_dir`, and one
    another command owns."""
    check_varrate_dir(run_path)
    if run_path.is_dir():
        check_free(run_path)


def _resolve(options: VarrateOptions, world: int) -> VarrateOptions:
    """Options with the world size and the device resolved, and threads split between local ranks."""
    device = resolve_device(options.device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device == "cuda" and local_world > torch.cuda.device_count():
        raise LadleError(f"--device cuda needs one GPU per rank (NCCL cannot share one): {local_world} ranks on "
                         f"this machine, {torch.cuda.device_count()} GPUs visible; use fewer --ranks or --device cpu")
    threads = options.threads or max(1, available_cores() // max(1, local_world))
    return dataclasses.replace(options, ranks=world, device=device, threads=threads)


def run_torchrun(recipe: Recipe, options: VarrateOptions, run_dir: Path | None,
                 data_root: str | None) -> dict[str, Any] | None:
    """Train as one rank of a group launched by torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set)."""
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise LadleError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not: launch with torchrun")
    world = int(os.environ["WORLD_SIZE"])
    if options.ranks not in (0, world):
        raise LadleError(f"--ranks {options.ranks} but torchrun started {world} ranks (drop --ranks)")
    options = _resolve(options, world)
    check_model(recipe)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if rank != 0:  # rank 0 alone writes the run directory
        return run_rank(recipe, options, None, data_root, local_rank)
    with given_or_new_run_dir(run_dir, f"varrate-{options.schedule.kind}") as run_path:
        _check_run_dir(run_path)
        make_run_dir(run_path)
        with lock_run_dir(run_path, "ladle.varrate"):
            return run_rank(recipe, options, run_path, data_root, local_rank)
