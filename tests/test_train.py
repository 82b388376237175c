"""Training ingredients: every view and architecture learns Cora; runs are deterministic and isolated."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS

from ladle.core.recipe import load_recipe
from ladle.core.storage import load_state
from ladle.train.launch import train_ingredients
from ladle.train.loop import train_task
from ladle.train.task import IngredientTask

# (view kind, K, floor on full-graph test accuracy after 100 epochs; the majority class is 0.32). Partition views use K = 2 so
# each part keeps ~70 training labels; with K = 8 a METIS part sees 1-3 classes (see the soup report).
VIEW_FLOORS = [
    ("full", 8, 0.78), ("cluster", 8, 0.75), ("saint-node", 8, 0.74), ("saint-edge", 8, 0.74),
    ("saint-rw", 8, 0.74), ("neighbor", 8, 0.75), ("metis", 2, 0.45), ("random", 2, 0.55),
]


@pytest.mark.parametrize("kind, ingredients, floor", VIEW_FLOORS)
def test_every_view_trains_a_gcn_above_its_floor(cora_data, tmp_path: Path, kind: str, ingredients: int,
                                                 floor: float) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, f"view.kind={kind}", "epochs=100"])
    meta = train_task(recipe, cora_data, IngredientTask(1, ingredients, tmp_path, "independent"))
    assert meta["test_acc"] >= floor, meta
    assert meta["status"] == "done" and (tmp_path / "ingredient-01.safetensors").is_file()
    assert json.loads((tmp_path / "ingredient-01.json").read_text())["view"]["kind"] == kind


@pytest.mark.parametrize("model, extra", [("sage", []), ("gat", ["lr=0.005", "dropout=0.6"]), ("gin", []), ("appnp", [])])
def test_every_architecture_trains(cora_data, tmp_path: Path, model: str, extra: list[str]) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, f"model={model}", "view.kind=full", "epochs=60", *extra])
    meta = train_task(recipe, cora_data, IngredientTask(0, 1, tmp_path, "independent"))
    assert meta["test_acc"] >= 0.75, meta


def _weights(cora_data, run_dir: Path, k: int) -> dict[str, torch.Tensor]:
    recipe = load_recipe(None, [*TRUNKLESS, "view.kind=saint-rw", "epochs=15"])
    train_task(recipe, cora_data, IngredientTask(k, 4, run_dir, "independent"))
    return load_state(run_dir / f"ingredient-{k:02d}.safetensors")


def test_same_seed_gives_bitwise_identical_weights(cora_data, tmp_path: Path) -> None:
    first = _weights(cora_data, tmp_path / "a", 2)
    second = _weights(cora_data, tmp_path / "b", 2)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    other = _weights(cora_data, tmp_path / "c", 3)
    assert any(not torch.equal(first[key], other[key]) for key in first)


def test_ingredients_run_in_separate_processes_without_process_group(data_root: Path, tmp_path: Path) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, "view.kind=metis", "epochs=5", "lr=1e-6"])  # too small to move a weight by 1e-4
    run = train_ingredients(recipe, ingredients=3, workers=2, run_dir=tmp_path / "run", data_root=data_root,
                            baseline=True)
    assert [m["name"] for m in run.ingredients] == ["ingredient-00", "ingredient-01", "ingredient-02"]
    assert run.baseline is not None and not run.failed
    pids = {m["pid"] for m in run.ingredients + [run.baseline]}
    assert os.getpid() not in pids and len(pids) <= 2
    assert not any(m["process_group"] for m in run.ingredients)
    assert all(m["threads"] == 1 for m in run.ingredients)
    # shared init: every ingredient and the baseline start from init.safetensors (independent draws differ
    # by more than 0.01: test_train_cli.py), and the parts are disjoint
    init = load_state(tmp_path / "run" / "init.safetensors")
    for meta in run.ingredients + [run.baseline]:
        assert meta["init"] == "shared"
        state = load_state(tmp_path / "run" / f"{meta['name']}.safetensors")
        assert state.keys() == init.keys()
        assert max(float((state[k] - init[k]).abs().max()) for k in init if init[k].is_floating_point()) < 1e-4
    nodes = [m["view"]["nodes"] for m in run.ingredients]
    assert sum(nodes) == 2708
    run_json = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run_json["status"] == "done" and run_json["ingredients"] == 3
    assert "ingredient-02" in run.summary_table()
