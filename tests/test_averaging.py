"""Periodic averaging: K = 1 is plain training, averages are exact means, bytes are counted as documented."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS

from ladle.core.errors import LadleError
from ladle.core.recipe import load_recipe
from ladle.core.storage import load_state, save_state
from ladle.nn.models import build_model
from ladle.train.loop import train_task
from ladle.train.periodic import average_models, train_with_averaging
from ladle.train.task import IngredientTask

pytestmark = pytest.mark.usefixtures("one_thread")


def test_averaging_every_epoch_with_one_trainer_is_plain_training(cora_data, tmp_path: Path) -> None:
    """Same seed, view, init and epochs: bitwise the weights of ``train_task`` (its ingredient 0 of 1).

    With K = 1 the average is the model itself, and validating every epoch picks the same best epoch.
    """
    recipe = load_recipe("cora-gcn", ["view.kind=random", "epochs=20"])
    torch.manual_seed(recipe.seed)  # the shared init, as ladle.train.launch writes it
    save_state(tmp_path / "init.safetensors", build_model(recipe, cora_data.num_features,
                                                          cora_data.num_classes).state_dict())
    plain = train_task(recipe, cora_data, IngredientTask(0, 1, tmp_path, "shared"))
    averaged = train_with_averaging(recipe, cora_data, ingredients=1, average_every=1, run_dir=tmp_path)
    expected, got = load_state(tmp_path / "ingredient-00.safetensors"), load_state(tmp_path / "averaged.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert averaged["best_epoch"] == plain["best_epoch"] and averaged["test_acc"] == plain["test_acc"]
    assert averaged["bytes"] == 0 and averaged["averages"] == 20


def test_average_models_sets_every_model_to_the_mean() -> None:
    torch.manual_seed(0)
    models = [build_model(load_recipe(None, [*TRUNKLESS, "norm=batch"]), 5, 3) for _ in range(3)]
    for model in models:
        torch.nn.init.normal_(model.convs[0].lin.weight)
        model.norms[0].running_mean.normal_()
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    parameters = [list(m.parameters()) for m in models]
    sent = average_models(models)
    for key in before[0]:
        if before[0][key].is_floating_point():
            mean = sum(b[key] for b in before) / 3
            assert all(torch.allclose(m.state_dict()[key], mean) for m in models), key
    assert all(list(m.parameters()) == p for m, p in zip(models, parameters))  # optimisers keep their tensors
    assert sent == sum(v.numel() * 4 for v in before[0].values() if v.is_floating_point())


def test_averaging_counts_bytes_and_writes_its_files(cora_data, tmp_path: Path) -> None:
    recipe = load_recipe("cora-gcn", ["view.kind=random", "epochs=30"])
    meta = train_with_averaging(recipe, cora_data, ingredients=3, average_every=7, run_dir=tmp_path)
    assert [row["epoch"] for row in meta["history"]] == [6, 13, 20, 27, 29]  # every 7 epochs and after the last
    model_bytes = sum(p.numel() * 4 for p in build_model(recipe, cora_data.num_features, 7).parameters())
    assert meta["model_bytes"] == model_bytes and meta["bytes"] == 5 * 2 * (3 - 1) * model_bytes
    assert meta["epochs_run"] == 30 and len(meta["views"]) == 3 and meta["test_acc"] > 0.6
    assert json.loads((tmp_path / "averaged.json").read_text())["bytes"] == meta["bytes"]
    assert (tmp_path / "averaged.safetensors").is_file()


@pytest.mark.parametrize("ingredients, every", [(0, 1), (2, 0)])
def test_bad_arguments_are_refused(cora_data, tmp_path: Path, ingredients: int, every: int) -> None:
    with pytest.raises(LadleError):
        train_with_averaging(load_recipe("cora-gcn"), cora_data, ingredients, every, tmp_path)
