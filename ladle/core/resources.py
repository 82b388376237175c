"""What this process may use: CPU cores, the training device, and its own peak memory."""
from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

from ladle.core.errors import LadleError


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


def peak_rss_mb() -> float:
    """This process's own peak resident memory, in MiB (``VmHWM``: ``ru_maxrss`` inherits the parent's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
