"""Soups: the maths of merging, the decision rules, and a real soup of Cora ingredients."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ladle.checkpoints import load_state, save_state
from ladle.config import load_recipe
from ladle.errors import LadleError
from ladle.evaluation import Evaluator, Metrics, average, metrics
from ladle.launch import train_ingredients
from ladle.soup import soup_run
from ladle.soups import greedy_interpolation_soup, greedy_soup, interpolate, search_alpha, uniform_soup


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(3, generator=generator),
            "count": torch.tensor(seed)}


def test_uniform_soup_of_identical_models_is_the_model() -> None:
    state = _state(0)
    soup = uniform_soup([state, {k: v.clone() for k, v in state.items()}, state])
    assert all(torch.allclose(soup[k].float(), state[k].float(), atol=1e-7) for k in state)
    assert torch.equal(soup["count"], state["count"])


def test_interpolation_ends_are_exact() -> None:
    soup, ingredient = _state(1), _state(2)
    assert all(torch.equal(interpolate(soup, ingredient, 1.0)[k], soup[k]) for k in soup)
    assert all(torch.equal(interpolate(soup, ingredient, 0.0)[k], ingredient[k]) for k in soup)
    middle = interpolate(soup, ingredient, 0.25)
    assert torch.allclose(middle["w"], 0.25 * soup["w"] + 0.75 * ingredient["w"])


def test_weighted_average_matches_formula() -> None:
    states = [_state(s) for s in range(3)]
    merged = average(states, [0.5, 0.3, 0.2])
    assert torch.allclose(merged["b"], 0.5 * states[0]["b"] + 0.3 * states[1]["b"] + 0.2 * states[2]["b"])


def _toy_scorer(target: torch.Tensor):
    """Accuracy falls with the distance of ``w`` to ``target``; loss is that distance."""
    def score(state: dict[str, torch.Tensor]) -> Metrics:
        distance = float((state["w"] - target).norm())
        return Metrics(round(1.0 / (1.0 + distance), 2), distance)
    return score


def test_fast_alpha_search_matches_grid_with_fewer_evaluations() -> None:
    soup, ingredient = {"w": torch.zeros(3)}, {"w": torch.ones(3)}
    score = _toy_scorer(torch.full((3,), 0.37))
    grid_alpha, grid_tried = search_alpha(soup, ingredient, score, "loss", 21, fast=False)
    fast_alpha, fast_tried = search_alpha(soup, ingredient, score, "loss", 21, fast=True)
    assert len(fast_tried) < len(grid_tried) == 21
    assert abs(grid_alpha - 0.65) < 1e-9
    assert abs(fast_alpha - 0.63) <= 0.05 / 2


def test_greedy_and_gis_never_lower_validation_score() -> None:
    states = [{"w": torch.randn(3, generator=torch.Generator().manual_seed(s))} for s in range(6)]
    score = _toy_scorer(torch.zeros(3))
    order = sorted(range(6), key=lambda i: score(states[i]).key("acc+loss"), reverse=True)
    best = score(states[order[0]])
    for result in (greedy_soup(states, order, score, "acc+loss"),
                   greedy_interpolation_soup(states, order, score, "acc+loss", grid=11)):
        assert score(result.state).key("acc+loss") >= best.key("acc+loss")
        assert result.evaluations > 0


@pytest.fixture(scope="module")
def cora_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four real Cora GCN ingredients (full graph, shared init) and a full-graph baseline."""
    recipe = load_recipe("cora-gcn", ["epochs=80"])
    run = train_ingredients(recipe, ingredients=4, workers=2, run_dir=tmp_path_factory.mktemp("soup") / "run",
                            data_root=data_root, baseline=True)
    return run.run_dir


def test_validation_neighbourhood_gives_full_graph_scores_exactly(cora_run: Path, cora_data) -> None:
    recipe = load_recipe("cora-gcn")
    evaluator = Evaluator(recipe, cora_data)
    state = load_state(cora_run / "ingredient-00.safetensors")
    cheap = evaluator.validation(state)
    full = evaluator.split(state, "val_mask")
    assert cheap.acc == full.acc and abs(cheap.loss - full.loss) < 1e-5
    assert evaluator.val[0].num_nodes < cora_data.num_nodes


def test_real_soups_keep_validation_and_beat_the_mean_ingredient(cora_run: Path, data_root: Path) -> None:
    report = soup_run(cora_run, data_root=data_root)
    best_val = max(row["val_acc"] for row in report["ingredients"])
    soups = {row["method"]: row for row in report["soups"]}
    assert set(soups) == {"uniform", "greedy", "gis", "learned"}
    for method in ("greedy", "gis"):
        assert soups[method]["val_acc"] >= best_val
    assert max(row["val_acc"] for row in soups.values()) > report["mean_ingredient"]["val_acc"]
    assert {ref["name"] for ref in report["references"]} == {"ensemble", "baseline"}
    for name in ("report.json", "report.md", "soup-gis.safetensors", "soup-gis.json", "accuracy.png", "alpha.png"):
        assert (cora_run / name).stat().st_size > 0, name
    assert json.loads((cora_run / "soup-gis.json").read_text())["evaluations"] == 3 * 21


def test_fast_search_uses_fewer_evaluations_on_real_ingredients(cora_run: Path, data_root: Path) -> None:
    grid = soup_run(cora_run, method="gis", search="grid", data_root=data_root, write=False)["soups"][0]
    fast = soup_run(cora_run, method="gis", search="fast", data_root=data_root, write=False)["soups"][0]
    assert fast["evaluations"] < grid["evaluations"]
    assert fast["val_acc"] >= grid["val_acc"] - 0.01


def _copy_run(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(run, target)
    return target


def test_corrupt_ingredient_is_named_or_skipped(cora_run: Path, data_root: Path, tmp_path: Path) -> None:
    run = _copy_run(cora_run, tmp_path)
    weights = run / "ingredient-02.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(LadleError, match="ingredient-02.safetensors is corrupt or truncated"):
        soup_run(run, method="uniform", data_root=data_root, write=False)
    report = soup_run(run, method="uniform", skip_bad=True, data_root=data_root, write=False)
    assert list(report["skipped"]) == ["ingredient-02"] and len(report["ingredients"]) == 3


def test_mismatched_ingredient_is_refused(cora_run: Path, data_root: Path, tmp_path: Path) -> None:
    run = _copy_run(cora_run, tmp_path)
    state = load_state(run / "ingredient-01.safetensors")
    state["convs.0.lin.weight"] = torch.zeros(32, state["convs.0.lin.weight"].size(1))
    save_state(run / "ingredient-01.safetensors", state)
    with pytest.raises(LadleError, match="does not match the run's recipe"):
        soup_run(run, method="uniform", data_root=data_root, write=False)


def test_missing_ingredient_is_reported_and_the_rest_souped(cora_run: Path, data_root: Path, tmp_path: Path) -> None:
    run = _copy_run(cora_run, tmp_path)
    (run / "ingredient-03.safetensors").unlink()
    (run / "ingredient-03.json").unlink()
    report = soup_run(run, method="greedy", data_root=data_root, write=False)
    assert report["missing"] == ["ingredient-03"] and len(report["ingredients"]) == 3


def test_metrics_helper() -> None:
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    result = metrics(logits, torch.tensor([0, 1, 1]))
    assert abs(result.acc - 2 / 3) < 1e-6 and result.loss > 0
