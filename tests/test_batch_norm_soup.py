"""Batch-norm soups: statistics re-estimated on the graph by default, kept averaged with ``--no-recompute-bn``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS
from torch_geometric.data import Data

from ladle import load_recipe, train_ingredients
from ladle.core.storage import StateDict, load_state, save_state
from ladle.graph.inputs import graph_inputs
from ladle.nn.models import build_model
from ladle.soup.cli import main as soup_main

OVERRIDES = [*TRUNKLESS, "norm=batch", "epochs=30"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bn_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three Cora GCN ingredients with batch norm (full graph, shared init, 30 epochs)."""
    recipe = load_recipe("cora-gcn", OVERRIDES)
    return train_ingredients(recipe, ingredients=3, workers=1, run_dir=tmp_path_factory.mktemp("bn") / "run",
                             data_root=data_root).run_dir


def _soup(run: Path, data_root: Path, *flags: str) -> dict:
    assert soup_main(["--run-dir", str(run), "--data-root", str(data_root), *flags]) == 0
    return json.loads((run / "report.json").read_text())


def _statistics(state: StateDict) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items() if ".running_" in key}


def _accuracy(state: StateDict, data: Data, mask: torch.Tensor) -> float:
    """Accuracy of ``state`` as saved (eval mode, its own statistics), by a plain full-graph forward."""
    model = build_model(load_recipe("cora-gcn", OVERRIDES), data.num_features, data.num_classes)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        logits = model(graph_inputs(data, "gcn"))
    return (logits[mask].argmax(-1) == data.y[mask]).float().mean().item()


def test_batch_norm_soups_keep_validation_and_save_what_they_scored(bn_run: Path, data_root: Path, cora_data: Data,
                                                                    tmp_path: Path) -> None:
    """Greedy and GIS keep the best ingredient's validation accuracy; each written soup carries the statistics
    it was scored with (re-estimated: not any ingredient's, not their mean)."""
    run = tmp_path / "run"
    shutil.copytree(bn_run, run)
    ingredients = [load_state(run / f"ingredient-{k:02d}.safetensors") for k in range(3)]
    for method in ("greedy", "gis"):
        report = _soup(run, data_root, "--method", method)
        row = report["soups"][0]
        assert report["recompute_bn"] and row["val_acc"] >= report["best_ingredient"]["val_acc"], method
        state = load_state(run / f"soup-{method}.safetensors")
        assert _accuracy(state, cora_data, cora_data.val_mask) == pytest.approx(row["val_acc"], abs=1e-6)
        assert _accuracy(state, cora_data, cora_data.test_mask) == pytest.approx(row["test_acc"], abs=1e-6)
        kept = [ingredients[int(name.split("-")[1])] for name in row["kept"]]
        for key, value in _statistics(state).items():
            mean = torch.stack([s[key] for s in kept]).mean(0)
            assert (value - mean).abs().max() > 1e-3, (method, key)


def test_statistics_are_re_estimated_unless_no_recompute_bn(bn_run: Path, data_root: Path, tmp_path: Path) -> None:
    """Corrupt every ingredient's batch-norm statistics: by default the soup is bitwise the clean run's; with
    ``--no-recompute-bn`` it keeps their mean, and validation accuracy collapses."""
    clean, corrupt = tmp_path / "clean", tmp_path / "corrupt"
    shutil.copytree(bn_run, clean)
    shutil.copytree(bn_run, corrupt)
    for k in range(3):
        path = corrupt / f"ingredient-{k:02d}.safetensors"
        state = load_state(path)
        for key in _statistics(state):
            state[key] = state[key] + 3.0 if key.endswith("running_mean") else state[key] * 25.0
        save_state(path, state)
    reference = _soup(clean, data_root, "--method", "uniform")
    recomputed = _soup(corrupt, data_root, "--method", "uniform")
    ours, theirs = (load_state(d / "soup-uniform.safetensors") for d in (clean, corrupt))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert [r["val_acc"] for r in recomputed["ingredients"]] == [r["val_acc"] for r in reference["ingredients"]]

    kept = _soup(corrupt, data_root, "--method", "uniform", "--no-recompute-bn")
    assert kept["recompute_bn"] is False
    assert json.loads((corrupt / "soup-uniform.json").read_text())["recompute_bn"] is False
    state = load_state(corrupt / "soup-uniform.safetensors")
    corrupted = [load_state(corrupt / f"ingredient-{k:02d}.safetensors") for k in range(3)]
    for key, value in _statistics(state).items():
        assert torch.allclose(value, torch.stack([s[key] for s in corrupted]).mean(0), atol=1e-6), key
    assert kept["soups"][0]["val_acc"] < reference["soups"][0]["val_acc"] - 0.2
