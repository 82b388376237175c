"""What this process may use: CPU cores, the training device, its own peak memory, and how long it lives."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import signal
import sys
from pathlib import Path

import torch
from torch import Tensor

from ladle.core.errors import LadleError

PR_SET_PDEATHSIG = 1  # prctl(2)
MADV_DONTNEED = 4  # madvise(2)


def die_with_parent() -> None:
    """On Linux, ask the kernel to SIGTERM this (worker) process when its parent dies (killed, even by SIGKILL),
    so no worker trains on, orphaned, into a run its launcher has left."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died before the request: nobody is left to work for
            os._exit(1)


def available_cores() -> int:
    """CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``cuda`` without one is an error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise LadleError("--device cuda but no CUDA device is visible (use --device cpu or auto)")
    return device


def total_memory() -> int:
    """This machine's physical memory in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def return_free_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc's ``malloc_trim``), so what this
    process still holds after a large task is what it uses."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)


def release_mapped_pages(tensor: Tensor) -> None:
    """Drop the resident pages of ``tensor``, which must be a slice of a read-only memory-mapped file (a shard's array,
    never written): they stay in the kernel's page cache and are read back on the next touch, but no longer count in
    this process's memory. On anonymous memory this would zero the data: never call it there. Linux only."""
    if not sys.platform.startswith("linux") or tensor.numel() == 0:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    first, last = -(-start // page) * page, (start + tensor.numel() * tensor.element_size()) // page * page
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


def reset_peak_rss() -> None:
    """Start this process's peak resident memory (:func:`peak_rss_mb`) again from what it holds now, so a process
    that trains task after task reports each task's own peak (Linux >= 4.0; elsewhere the process's peak stays)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mb() -> float:
    """This process's own peak resident memory, in MiB (``VmHWM``: ``ru_maxrss`` inherits the parent's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
