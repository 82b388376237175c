"""Safe, atomic checkpoints: safetensors weights (their names: :mod:`ladle.core.rundir`; their JSON metadata:
:mod:`ladle.core.files`), the ``.npy`` arrays of cached datasets and shards, and figures.

Every write goes through :func:`~ladle.core.files.atomic_open`: a crash leaves the old file or the new, never
half. Nothing here unpickles: weights load with safetensors, arrays are saved without pickle.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes
from torch import Tensor

from ladle.core.errors import LadleError
from ladle.core.files import atomic_open, check_regular

StateDict = dict[str, Tensor]


def save_npy(path: Path, array: np.ndarray) -> None:
    """Atomically write ``array`` as a ``.npy`` file, without pickle."""
    with atomic_open(path) as stream:
        np.save(stream, array, allow_pickle=False)


def save_state(path: Path, state: StateDict, metadata: dict[str, str] | None = None) -> None:
    """Atomically save tensors (contiguous CPU copies) and optional string metadata as safetensors."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    with atomic_open(path) as stream:
        stream.write(save_safetensors_bytes(tensors, metadata=metadata))


def load_state_and_metadata(path: Path) -> tuple[StateDict, dict[str, str]]:
    """Load a safetensors file with its header metadata (one file: both change together, atomically)."""
    state = load_state(path)
    try:
        with safe_open(str(path), "pt") as handle:
            return state, dict(handle.metadata() or {})
    except (SafetensorError, OSError) as error:
        raise LadleError(f"checkpoint {path} is corrupt or truncated ({error}); retrain it or remove it") from None


def load_state(path: Path) -> StateDict:
    """Load safetensors weights; any ``.pt`` goes through ``torch.load(weights_only=True)``."""
    path = Path(path)
    check_regular(path, f"checkpoint {path}")
    if not path.is_file():
        raise LadleError(f"checkpoint {path} is missing")
    if path.suffix in (".pt", ".pth"):
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - the unpickler refuses with many types
            raise LadleError(
                f"refused to load {path}: not a plain tensor checkpoint ({type(error).__name__}); "
                "only safetensors or weights-only .pt files are accepted"
            ) from None
        if not isinstance(loaded, dict) or not all(isinstance(v, Tensor) for v in loaded.values()):
            raise LadleError(f"{path} does not hold a state dict of tensors")
        return loaded
    try:
        return load_safetensors_bytes(path.read_bytes())
    except (SafetensorError, ValueError, OSError) as error:
        raise LadleError(f"checkpoint {path} is corrupt or truncated ({error}); retrain it or remove it") from None


def save_figure(figure: Any, path: Path) -> Path:
    """Write a matplotlib ``Figure`` to ``path`` as PNG, atomically."""
    with atomic_open(path) as stream:
        figure.savefig(stream, format="png", dpi=110)
    return path
