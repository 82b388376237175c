"""``python -m ladle.varrate``: partition-parallel training whose workers talk, compressed at a variable rate.

The comparison to ladle's zero-communication soups, after Cervino et al. (2024), *Distributed training
of large GNNs with variable communication rates* (VARCO). Each of K ranks owns one part of a METIS or
random partition. At every layer ``H' = Â (H W) + b`` a rank projects its own rows (``Z = H W``), sends
its peers the rows of ``Z`` they aggregate from (its boundary nodes), compressed with ratio ``r_t``,
receives theirs (its halo), and aggregates with its rows of the full-graph ``Â``. Exchanging after the
projection sends ``hidden`` columns instead of the raw features (8,415 on Coauthor Physics). The
feature gradients of the halo rows travel back the same way; parameter gradients are all-reduced so
every rank holds one model, whose state dict is ladle's :class:`~ladle.nn.models.GNN`. The first layer's
input never changes, so by default each rank fetches its halo's rows of ``X`` once at setup (sparse rows as
their non-zeros) and projects them itself: that layer then exchanges nothing, forward or back, and its
weight gradient summed over ranks is the same (``cache_inputs``; off, every layer exchanges as the authors do).

``r_t`` follows a schedule, heavy compression early and light late (``linear``, ``step``), or is fixed;
``full`` (``r = 1``) is exact full-graph training and ``none`` drops the cut edges (no halo); ``adaptive``
halves it whenever the training loss stalls; an exact tail makes the last epochs of any schedule exact. Training exchanges may remember across steps
(:mod:`~ladle.varrate.memory`): error feedback carries what compression lost into the next step, and a
selective exchange sends a random fraction of the rows while receivers reuse their last copy of the rest. Every
payload byte a rank puts on the wire is counted, collectives as ring algorithms send them
(:mod:`ladle.core.collectives`; the gradient all-reduce ``2 (K - 1) / K`` model sizes a rank, a step): forward
halo, backward halo, gradient all-reduce, the exact evaluation halo (every ``eval_every`` epochs),
the per-epoch metric reduction and the setup (partition broadcast, size table, the halo's input features). Transport is ``torch.distributed`` (gloo on CPU, NCCL on GPU): uneven ``all_to_all_single``
for halos, ``all_reduce`` for gradients and metrics.

Modules: :mod:`~ladle.varrate.compression` (operators, schedules), :mod:`~ladle.varrate.halo` (plan,
exchange, byte accounting), :mod:`~ladle.varrate.memory` (error feedback, selective exchange), :mod:`~ladle.varrate.trainer` (one rank's model and loop),
:mod:`~ladle.varrate.ranks` (process group, spawned or torchrun ranks), :mod:`~ladle.varrate.cli`.
The report (accuracy against bytes) is written by :func:`ladle.varrate.report.write_bytes_report`.
"""
from __future__ import annotations

from ladle.varrate.cli import build_parser, main
from ladle.varrate.compression import (
    COMPRESSORS,
    SCHEDULES,
    Compressor,
    Int8,
    RandomMask,
    RateController,
    RateSchedule,
    Truncate,
    build_compressor,
    kept_columns,
)
from ladle.varrate.halo import (
    HaloExchange,
    HaloPlan,
    PeerFailure,
    Traffic,
    build_plan,
    collective,
    exchange_key,
    partition_nodes,
)
from ladle.varrate.memory import ErrorFeedback, Route, SelectiveExchange
from ladle.varrate.ranks import (
    check_inputs,
    free_port,
    init_group,
    load_rank_data,
    rank_device,
    run_rank,
    run_spawned,
    run_torchrun,
)
from ladle.varrate.trainer import (
    EVAL_EVERY,
    SUPPORTED_MODELS,
    RankData,
    VarrateOptions,
    allreduce_gradients,
    check_model,
    partition_forward,
    partition_loss,
    train_partition,
)

__all__ = [
    "COMPRESSORS", "EVAL_EVERY", "SCHEDULES", "SUPPORTED_MODELS", "Compressor", "ErrorFeedback", "HaloExchange",
    "HaloPlan", "Int8", "PeerFailure", "RandomMask", "RankData", "RateController", "RateSchedule", "Route",
    "SelectiveExchange", "Traffic", "Truncate", "VarrateOptions", "allreduce_gradients",
    "build_compressor", "build_parser", "build_plan", "check_inputs", "check_model", "collective", "exchange_key",
    "free_port", "init_group", "kept_columns", "load_rank_data", "main", "partition_forward", "partition_loss",
    "partition_nodes", "rank_device", "run_rank", "run_spawned", "run_torchrun", "train_partition",
]
