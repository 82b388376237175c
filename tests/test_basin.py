"""Basin figures: the barrier of an interpolation path and distances between weights."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import TRUNKLESS
from torch_geometric.data import Data

from ladle.core.recipe import load_recipe
from ladle.graph.inputs import graph_inputs
from ladle.nn.models import build_model
from ladle.nn.scoring import evaluate
from ladle.soup.basin import barrier, distance, ingredient_distances, path_barriers

ALPHAS = [i / 10 for i in range(11)]


def _mix(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """The interpolated state ``a + alpha (b - a)`` (exactly ``a`` when ``b == a``)."""
    return {key: torch.lerp(a[key], b[key], alpha) for key in a}


def test_barrier_is_zero_between_identical_ingredients_on_cora(cora_data: Data, one_thread: None) -> None:
    torch.manual_seed(0)
    model = build_model(load_recipe(None, list(TRUNKLESS)), cora_data.num_features, cora_data.num_classes)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    inputs = graph_inputs(cora_data, "gcn")
    accuracies = []
    for alpha in ALPHAS:
        model.load_state_dict(_mix(state, state, alpha))
        accuracies.append(evaluate(model, inputs, cora_data.y, cora_data.val_mask).acc)
    assert barrier(ALPHAS, accuracies) == 0.0
    assert distance(state, _mix(state, state, 0.3)) == 0.0


def test_barrier_of_a_sagging_curve() -> None:
    values = [0.80, 0.78, 0.74, 0.73, 0.75, 0.78, 0.79, 0.80, 0.81, 0.81, 0.82]
    # the chord runs from 0.80 to 0.82; the deepest sag is at alpha 0.3: 0.806 - 0.73
    assert barrier(ALPHAS, values) == pytest.approx(7.6)
    shuffled = list(zip(ALPHAS, values))[::-1]
    assert barrier([a for a, _ in shuffled], [v for _, v in shuffled]) == pytest.approx(7.6)
    assert barrier([0.0, 0.5, 1.0], [0.7, 0.9, 0.8]) == 0.0  # above its chord: no barrier
    assert barrier([0.0, 1.0], [0.6, 0.9]) == 0.0


def test_path_barriers_walk_the_soup_each_step_kept() -> None:
    path = [{"w": torch.tensor([0.0])}, {"w": torch.tensor([1.0])}, {"w": torch.tensor([3.0])}]
    seen = []

    def accuracy(state: dict[str, torch.Tensor]) -> float:  # a sag of its own: (w - 0.5)^2
        seen.append(float(state["w"]))
        return (float(state["w"]) - 0.5) ** 2

    barriers = path_barriers(path, [0.5, 1.0], [[0.0, 0.5, 1.0], [0.0, 0.5, 1.0]], accuracy)
    # step 1: soup 0 toward 1, w = 1, 0.5, 0 (alpha weighs the soup): values 0.25, 0, 0.25, a sag of 25 points;
    # step 2 starts from the kept mix, w = 0.5: toward 3, w = 3, 1.75, 0.5: 6.25, 1.5625, 0 under a chord of 3.125
    assert seen == pytest.approx([1.0, 0.5, 0.0, 3.0, 1.75, 0.5])
    assert barriers == pytest.approx([25.0, 156.25])


def test_barrier_rejects_malformed_paths() -> None:
    with pytest.raises(ValueError, match="one value per alpha"):
        barrier([0.0, 1.0], [0.5])
    with pytest.raises(ValueError, match="at least 2 points"):
        barrier([0.0], [0.5])
    with pytest.raises(ValueError, match="distinct alphas"):
        barrier([0.0, 0.5, 0.5, 1.0], [0.5, 0.4, 0.4, 0.5])


def test_distance_over_float_tensors() -> None:
    a = {"weight": torch.zeros(2, 3), "bias": torch.zeros(3), "num_batches_tracked": torch.tensor(0)}
    b = {"weight": torch.ones(2, 3), "bias": torch.full((3,), 2.0), "num_batches_tracked": torch.tensor(7)}
    assert distance(a, a) == 0.0
    assert distance(a, b) == pytest.approx(math.sqrt(6 + 12))  # the integer counter is not a weight
    with pytest.raises(ValueError, match="different tensors"):
        distance(a, {"weight": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="shape"):
        distance(a, {**a, "bias": torch.zeros(4)})


def test_ingredient_distances_from_init_and_soup() -> None:
    torch.manual_seed(0)
    init = {"w": torch.randn(5, 4)}
    ingredients = [{"w": init["w"] + torch.randn(5, 4)} for _ in range(2)]
    soup = _mix(*ingredients, 0.5)
    rows = ingredient_distances([init, init], soup, ingredients)
    apart = distance(*ingredients)
    assert [row["from_init"] for row in rows] == [distance(state, init) for state in ingredients]
    for row in rows:  # the uniform soup of two lies halfway between them
        assert row["from_soup"] == pytest.approx(apart / 2)
