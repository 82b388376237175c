"""A run's models as modules: ``ladle.load_model`` gives a soup, an ingredient or the trunk in eval mode whose
logits (``ladle.predict``) score exactly what the run's report and JSON say; a wrong name or graph is one line."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ladle
from ladle.core.errors import LadleError
from ladle.core.files import read_json, write_json
from ladle.core.recipe import load_recipe


@pytest.fixture(scope="module")
def souped(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Two Cora ingredients of a trunk (full graph, 3 epochs each), souped uniformly."""
    run = ladle.train_ingredients(load_recipe(None, ["view.kind=full", "trunk.epochs=3", "epochs=3"]), ingredients=2,
                                  workers=1, data_root=data_root, run_dir=tmp_path_factory.mktemp("load") / "run")
    return run.run_dir, ladle.soup_run(run.run_dir, method="uniform", data_root=data_root)


def _accuracy(logits: torch.Tensor, data, mask: str) -> float:
    return float((logits.argmax(1)[data[mask]] == data.y[data[mask]]).float().mean())


def test_a_loaded_soup_predicts_what_the_report_says(souped: tuple[Path, dict], data_root: Path, cora_data) -> None:
    run, report = souped
    model = ladle.load_model(run, "soup-uniform")
    assert not model.training and model.recipe.epochs == 3 and isinstance(model, torch.nn.Module)
    logits = ladle.predict(run, cora_data, "soup-uniform")
    assert logits.shape == (cora_data.num_nodes, cora_data.num_classes)
    (row,) = report["soups"]
    assert _accuracy(logits, cora_data, "test_mask") == pytest.approx(row["test_acc"], abs=1e-12)
    assert _accuracy(logits, cora_data, "val_mask") == pytest.approx(row["val_acc"], abs=1e-12)
    own = ladle.predict(run, data_root=data_root)  # the report's chosen soup, on the run's dataset
    assert report["parallel_phase"]["best_soup"] == "soup-uniform" and torch.equal(own, logits)
    for name in ("ingredient-01", "trunk"):
        meta = read_json(run / f"{name}.json")
        assert _accuracy(ladle.predict(run, cora_data, name), cora_data, "test_mask") == pytest.approx(
            meta["test_acc"], abs=1e-12)


def test_a_wrong_name_or_graph_is_one_line(souped: tuple[Path, dict], cora_data) -> None:
    run, _ = souped
    with pytest.raises(LadleError, match=r"has no model 'soup-gis' \(it has: ingredient-00, ingredient-01, "
                                         r"soup-uniform, trunk, trunk-continued\)$"):
        ladle.load_model(run, "soup-gis")
    narrow = cora_data.clone()
    narrow.x = narrow.x[:, :10]
    with pytest.raises(LadleError, match="the graph has 10 features per node, the model takes 1433"):
        ladle.predict(run, narrow, "trunk")


def test_a_run_without_a_chosen_soup_says_why(souped: tuple[Path, dict], tmp_path: Path) -> None:
    """No report: soup it; a report whose soups were all fitted on validation (learned: never chosen): name one."""
    run = tmp_path / "run"
    shutil.copytree(souped[0], run)
    report = read_json(run / "report.json")
    write_json(run / "report.json", report | {"parallel_phase": None})
    with pytest.raises(LadleError, match=r"soup report chose no soup \(its soups were all fitted on validation nodes, "
                                         r"never chosen\): name a model \(it has: ingredient-00"):
        ladle.load_model(run)
    (run / "report.json").unlink()
    with pytest.raises(LadleError, match=r"has no soup report yet: soup it \(python -m ladle.soup --run-dir "):
        ladle.load_model(run)
