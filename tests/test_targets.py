"""Target-node inference (the soups' validation scoring at scale): exact logits of a node set, the
first aggregation computed once, and the fixed validation sample."""
from __future__ import annotations

import pytest
import torch
from conftest import TRUNKLESS

from ladle.core.recipe import load_recipe
from ladle.nn import layerwise
from ladle.nn.layerwise import LayerwiseInference
from ladle.nn.models import build_model
from ladle.nn.scoring import metrics
from ladle.nn.target_nodes import (
    TargetInference,
    accuracy_stderr,
    sample_targets,
    supports,
)
from ladle.soup import evaluator as evaluation
from ladle.soup.evaluator import Evaluator


def _random_model(recipe, data, seed: int):
    torch.manual_seed(seed)
    model = build_model(recipe, data.num_features, data.num_classes)
    with torch.no_grad():  # biases and norm parameters away from zero / one
        for name, tensor in model.state_dict().items():
            if name.endswith(("bias", "running_mean")) or "norms" in name and name.endswith("weight"):
                tensor.normal_(0.0, 0.5)
            elif name.endswith("running_var"):
                tensor.uniform_(0.5, 2.0)
    return model.eval()


@pytest.mark.parametrize("overrides", [["model=gcn"], ["model=sage"], ["model=gcn", "layers=3", "norm=layer"],
                                       ["model=sage", "layers=3", "norm=batch"], ["model=gcn", "layers=1"]])
@pytest.mark.parametrize("cached", [True, False])
def test_target_logits_equal_the_whole_graph_logits(cora_data, overrides: list[str], cached: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if not cached:  # features too large to aggregate whole: the targets' first level is aggregated alone
        monkeypatch.setattr(layerwise, "FIRST_AGGREGATION_BYTES", 0)
    recipe = load_recipe(None, [*TRUNKLESS, *overrides])
    model = _random_model(recipe, cora_data, seed=len(overrides))
    whole = LayerwiseInference.from_data(cora_data)
    targets = sample_targets(cora_data.test_mask, 300, seed=1)
    inference = TargetInference(whole, targets, recipe.layers)
    expected = whole.logits(model)[targets]
    got = inference.logits(model)
    assert expected.abs().max() > 0.1
    assert (got - expected).abs().max() <= 1e-5
    assert bool(whole._first) == cached  # the graph's whole aggregation, made and reused, only where it is kept
    if recipe.layers > 1:  # only the targets' neighbourhood is computed below the last layer
        assert inference.levels[0].numel() < cora_data.num_nodes


def test_gat_is_not_supported(cora_data) -> None:
    recipe = load_recipe(None, [*TRUNKLESS, "model=gat"])
    assert not supports(build_model(recipe, cora_data.num_features, cora_data.num_classes))


def test_sample_is_fixed_sorted_and_inside_the_mask(cora_data) -> None:
    mask = cora_data.test_mask
    first, again, other = (sample_targets(mask, 100, seed) for seed in (0, 0, 1))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.numel() == 100 and bool(mask[first].all()) and bool((first.diff() > 0).all())
    assert torch.equal(sample_targets(mask, 10**6, 0), mask.nonzero().view(-1))  # small splits whole


def test_stderr_of_an_accuracy() -> None:
    assert accuracy_stderr(0.9, 20_000) == pytest.approx((0.9 * 0.1 / 20_000) ** 0.5)
    assert accuracy_stderr(1.0, 10) == 0.0


def test_layerwise_evaluator_scores_candidates_on_the_validation_sample(cora_data, monkeypatch) -> None:
    monkeypatch.setattr(evaluation, "VALIDATION_SAMPLE", 200)
    recipe = load_recipe(None, list(TRUNKLESS))
    model = _random_model(recipe, cora_data, seed=3)
    state = model.state_dict()
    evaluator = Evaluator(recipe, cora_data, layerwise=True)
    assert evaluator.validation_nodes() == (200, int(cora_data.val_mask.sum()))
    sample = sample_targets(cora_data.val_mask, 200, recipe.seed)
    expected = metrics(evaluator.full_logits(state)[sample], cora_data.y[sample])
    scored = evaluator.validation(state)
    assert scored.acc == expected.acc and abs(scored.loss - expected.loss) <= 1e-5
    assert Evaluator(recipe, cora_data).validation_nodes() == (500, 500)  # small graphs: every node, exactly


def test_a_whole_graph_pass_gives_the_validation_score_of_its_weights(cora_data, monkeypatch) -> None:
    """An ingredient's whole-graph pass (its test figure) also gives its validation score, with no scoring of its own:
    the sample's rows where candidates are scored on a sample, the whole split layer-wise; a small graph's validation
    neighbourhood is scored apart."""
    monkeypatch.setattr(evaluation, "VALIDATION_SAMPLE", 200)
    for model, nodes in (("gcn", 200), ("gat", int(cora_data.val_mask.sum()))):  # GAT: the whole split
        recipe = load_recipe(None, [*TRUNKLESS, f"model={model}"])
        state = _random_model(recipe, cora_data, seed=4).state_dict()
        evaluator = Evaluator(recipe, cora_data, layerwise=True)
        assert evaluator.validation_nodes()[0] == nodes
        logits = evaluator.full_logits(state)
        read, scored = evaluator.validation_from(logits), evaluator.validation(state)
        assert read is not None and read.acc == scored.acc and abs(read.loss - scored.loss) <= 1e-5
        assert Evaluator(recipe, cora_data).validation_from(logits) is None


@pytest.mark.parametrize("model", ["gcn", "sage"])
def test_whole_graph_passes_reuse_the_first_aggregation_exactly(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ladle.graph.inputs import graph_inputs
    from ladle.graph.synthetic import synthetic_graph

    monkeypatch.setattr(layerwise, "ROW_CHUNK", 700)  # hidden rows finished in several chunks, the last one short

    data = synthetic_graph(nodes=3000, degree=8, features=32, classes=5)  # dense features: the cached path
    data.num_classes = 5
    recipe = load_recipe(None, [*TRUNKLESS, f"model={model}"])
    inference = LayerwiseInference.from_data(data)
    for seed in (0, 1):  # the second model reuses what the first cached
        net = _random_model(recipe, data, seed)
        with torch.no_grad():
            expected = net(graph_inputs(data, model))
        assert (inference.logits(net) - expected).abs().max() <= 1e-5
    assert list(inference._first) == ["mean" if model == "sage" else "gcn"]
