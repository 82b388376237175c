"""Resumable training state: the RNG streams a resumed ingredient continues from (CPU always, every GPU's
when the model is on CUDA, since dropout there draws from the GPU's generator)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS

from ladle.core.recipe import load_recipe
from ladle.core.storage import load_state
from ladle.nn.models import build_model
from ladle.train.loop import Progress, load_progress, save_progress
from ladle.train.task import IngredientTask


def _round_trip(tmp_path: Path, device: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Save the state on ``device``, draw dropout-like noise, restore, draw again: (file, first draw, second)."""
    torch.manual_seed(0)
    model = build_model(load_recipe(None, [*TRUNKLESS, "hidden=8"]), 5, 3).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    task = IngredientTask(0, 1, tmp_path, "shared")
    best = {key: value.clone() for key, value in model.state_dict().items()}
    save_progress(task, model, optimizer, best, Progress(next_epoch=3))
    first = torch.rand(4, device=device)
    progress, _ = load_progress(task, model, optimizer)
    assert progress.next_epoch == 3
    return load_state(task.progress_path), first, torch.rand(4, device=device)


def test_cpu_state_holds_the_cpu_stream_only(tmp_path: Path) -> None:
    tensors, first, again = _round_trip(tmp_path, "cpu")
    assert torch.equal(first, again)
    assert "rng" in tensors and not [key for key in tensors if key.startswith("rng.cuda.")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the GPU generator's state is "
                    "saved only when the model is on CUDA")
def test_cuda_state_holds_every_gpu_stream(tmp_path: Path) -> None:
    tensors, first, again = _round_trip(tmp_path, "cuda")
    assert torch.equal(first, again)  # the GPU stream continues where the saved state left it
    assert sorted(key for key in tensors if key.startswith("rng.cuda.")) == [
        f"rng.cuda.{i}" for i in range(torch.cuda.device_count())]
