"""Learned soups: exact mixing, honesty (only validation labels are read), and a real soup of Cora ingredients."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ladle.core.errors import LadleError
from ladle.core.recipe import Recipe, load_recipe
from ladle.core.storage import StateDict
from ladle.nn.saved import load_ingredients
from ladle.soup.evaluator import Evaluator
from ladle.soup.learned import Mixture, layer_of, learned_soup, split_validation
from ladle.soup.methods import SOUPS
from ladle.train.launch import train_ingredients

MODES = [False, True]  # learned, learned-partition


pytestmark = pytest.mark.usefixtures("one_thread")


def _state(seed: int) -> StateDict:
    generator = torch.Generator().manual_seed(seed)
    return {"convs.0.lin.weight": torch.randn(4, 3, generator=generator),
            "convs.0.bias": torch.randn(4, generator=generator),
            "norms.0.running_mean": torch.randn(4, generator=generator),
            "norms.0.num_batches_tracked": torch.tensor(seed),
            "convs.1.lin.weight": torch.randn(2, 4, generator=generator)}


def test_layer_groups_pair_a_convolution_with_its_norm() -> None:
    assert layer_of("convs.0.lin.weight") == layer_of("norms.0.weight") == "layer0"
    assert layer_of("convs.1.att_src") == "layer1"
    assert Mixture([_state(0)]).layers == ["layer0", "layer1"]


def test_one_hot_mixing_reproduces_the_chosen_ingredient_exactly() -> None:
    states = [_state(s) for s in range(3)]
    mixture = Mixture(states)
    weights = torch.zeros(2, 3)
    weights[0, 2] = weights[1, 1] = 1.0  # layer 0 from ingredient 2, layer 1 from ingredient 1
    mixed = mixture.mix(weights)
    assert mixed.keys() == states[0].keys()
    for key in ("convs.0.lin.weight", "convs.0.bias", "norms.0.running_mean"):
        assert torch.equal(mixed[key], states[2][key])
    assert torch.equal(mixed["convs.1.lin.weight"], states[1]["convs.1.lin.weight"])
    assert torch.equal(mixed["norms.0.num_batches_tracked"], states[0]["norms.0.num_batches_tracked"])


def test_mixing_is_the_weighted_sum_and_differentiable() -> None:
    states = [_state(s) for s in range(2)]
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5]], requires_grad=True)
    mixed = Mixture(states).mix(weights)
    expected = 0.25 * states[0]["convs.0.bias"] + 0.75 * states[1]["convs.0.bias"]
    assert torch.allclose(mixed["convs.0.bias"], expected)
    mixed["convs.1.lin.weight"].sum().backward()
    assert weights.grad is not None and weights.grad[0].abs().sum() == 0 and weights.grad[1].abs().sum() > 0


def test_buffers_are_mixed_with_the_same_weights_but_no_gradient() -> None:
    states = [_state(s) for s in range(2)]
    weights = torch.tensor([[0.5, 0.5], [1.0, 0.0]], requires_grad=True)
    mixed = Mixture(states, buffers={"norms.0.running_mean"}).mix(weights)
    assert mixed["convs.0.bias"].requires_grad and not mixed["norms.0.running_mean"].requires_grad
    assert torch.allclose(mixed["norms.0.running_mean"],
                          (states[0]["norms.0.running_mean"] + states[1]["norms.0.running_mean"]) / 2)


def test_validation_split_is_disjoint_seeded_and_covers_validation() -> None:
    mask = torch.zeros(50, dtype=torch.bool)
    mask[10:31] = True
    fit, held = split_validation(mask, seed=3)
    assert fit.numel() == 11 and held.numel() == 10
    assert sorted(torch.cat([fit, held]).tolist()) == list(range(21))
    assert torch.equal(split_validation(mask, seed=3)[0], fit)
    with pytest.raises(LadleError, match="at least 2 validation nodes"):
        split_validation(torch.tensor([True, False]), seed=0)


@pytest.fixture(scope="module")
def cora_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Recipe, list[StateDict]]:
    """Four Cora GCN ingredients, 60 epochs each, shared init."""
    recipe = load_recipe("cora-gcn", ["epochs=60"])
    run = train_ingredients(recipe, ingredients=4, workers=2, run_dir=tmp_path_factory.mktemp("cora-run"),
                            data_root=data_root)
    return recipe, load_ingredients(run.run_dir).states


@pytest.mark.parametrize("partition", MODES)
def test_single_ingredient_soup_is_that_ingredient(cora_run, cora_data, partition: bool) -> None:
    recipe, states = cora_run
    result = learned_soup(states[:1], Evaluator(recipe, cora_data), partition=partition, epochs=3)
    assert all(torch.equal(result.state[k], states[0][k]) for k in states[0])
    assert result.mixing == [[1.0], [1.0]]


def test_learned_soup_reads_no_label_outside_validation(cora_run, cora_data) -> None:
    """Poison every train, test and unlabelled node's label: both learned soups stay bitwise the same."""
    recipe, states = cora_run
    poisoned = cora_data.clone()
    outside = ~cora_data.val_mask
    poisoned.y[outside] = torch.randint(cora_data.num_classes, (int(outside.sum()),),
                                        generator=torch.Generator().manual_seed(0))
    assert not torch.equal(poisoned.y[cora_data.test_mask], cora_data.y[cora_data.test_mask])
    for partition in MODES:
        clean = learned_soup(states, Evaluator(recipe, cora_data), partition=partition, epochs=10)
        dirty = learned_soup(states, Evaluator(recipe, poisoned), partition=partition, epochs=10)
        assert all(torch.equal(clean.state[k], dirty.state[k]) for k in clean.state)
        assert clean.history == dirty.history


@pytest.mark.parametrize("partition", MODES)
def test_learned_soup_of_cora_ingredients_matches_the_mean_ingredient(cora_run, cora_data, partition: bool) -> None:
    recipe, states = cora_run
    evaluator = Evaluator(recipe, cora_data)
    mean_ingredient = sum(evaluator.validation(s).acc for s in states) / len(states)
    result = learned_soup(states, evaluator, partition=partition, epochs=30)
    assert evaluator.validation(result.state).acc >= mean_ingredient
    registered = SOUPS["learned-partition" if partition else "learned"]  # fitted: never chosen on validation
    assert registered.fitted and registered.layerwise == partition and registered.in_all != partition
    assert len(result.history) == 31 and 0 <= result.best_epoch <= 30
    assert all(abs(sum(row) - 1.0) < 1e-5 for row in result.mixing) and abs(sum(result.alphas) - 1.0) < 1e-5
    if not partition:
        assert result.evaluations == 31  # one forward (and backward) an epoch, one for the final weights


def test_partition_arguments_are_checked(cora_run, cora_data) -> None:
    recipe, states = cora_run
    with pytest.raises(LadleError, match="parts_per_step"):
        learned_soup(states, Evaluator(recipe, cora_data), partition=True, parts=4, parts_per_step=8)
