"""Soups: the maths of merging, the decision rules, and a real soup of Cora ingredients."""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TRUNKLESS

from ladle.core.errors import LadleError
from ladle.core.recipe import SOUP_METRICS, load_recipe
from ladle.core.storage import StateDict, load_state, save_state
from ladle.core.weights import average, interpolate
from ladle.graph.datasets import load_dataset
from ladle.graph.inputs import adjacency, graph_inputs
from ladle.nn.models import GNN, build_model
from ladle.nn.saved import load_ingredients
from ladle.nn.scoring import Metrics, metrics
from ladle.soup import evaluator as evaluation
from ladle.soup import learned
from ladle.soup.cli import main as soup_main
from ladle.soup.evaluator import Evaluator, interpolation_of
from ladle.soup.methods import (
    SOUPS,
    TRUNK_INDEX,
    SoupInputs,
    greedy_interpolation_soup,
    greedy_soup,
    search_alpha,
    uniform_soup,
)
from ladle.soup.pipeline import soup_run
from ladle.soup.report import format_table
from ladle.train.launch import train_ingredients


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
    mixes = interpolation_of(score)(soup, ingredient)
    grid_alpha, grid_tried = search_alpha(mixes.score, "loss", 21, fast=False)
    fast_alpha, fast_tried = search_alpha(mixes.score, "loss", 21, fast=True)
    assert len(fast_tried) < len(grid_tried) == 21
    assert abs(grid_alpha - 0.65) < 1e-9
    assert abs(fast_alpha - 0.63) <= 0.05 / 2


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


NEIGHBOURHOOD_MODELS = [["model=gcn", "layers=3"], ["model=sage"], ["model=gat"], ["norm=batch"],
                        ["model=sage", "norm=batch"]]


@pytest.mark.parametrize("overrides", NEIGHBOURHOOD_MODELS, ids=" ".join)
def test_validation_neighbourhood_logits_equal_full_graph_logits(cora_data, overrides: list[str]) -> None:
    """The L-hop sub-graph around the validation nodes (full-graph normalisation, attention over every
    in-neighbour, the model's batch-norm statistics) gives those nodes their full-graph logits."""
    recipe = load_recipe(None, [*TRUNKLESS, *overrides])
    torch.manual_seed(0)
    model = build_model(recipe, cora_data.num_features, cora_data.num_classes)
    with torch.no_grad():  # biases and batch-norm statistics away from their zero / one initialisation
        for name, tensor in model.state_dict().items():
            if name.endswith(("bias", "running_mean")):
                tensor.normal_(0.0, 0.5)
            elif name.endswith("running_var"):
                tensor.uniform_(0.5, 2.0)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        full = model(graph_inputs(cora_data, recipe.model))[cora_data.val_mask]
    evaluator = Evaluator(recipe, cora_data)
    inputs, labels, where = evaluator.val
    assert inputs.num_nodes < cora_data.num_nodes and torch.equal(labels, cora_data.y[cora_data.val_mask])
    as_is = Evaluator(recipe, cora_data, recompute_bn=False)  # the statistics the model has
    cheap = as_is.logits(state, inputs)[where]
    assert full.abs().max() > 0.1 and (cheap - full).abs().max() <= 2e-6
    assert (as_is.full_logits(state)[cora_data.val_mask] - full).abs().max() <= 2e-6
    recomputed, whole = evaluator.validation(state), evaluator.split(state, "val_mask")  # statistics re-estimated
    assert recomputed.acc == whole.acc and abs(recomputed.loss - whole.loss) <= 2e-6
    # layer-wise scoring (what big graphs and learned-partition use) gives the same logits and scores
    layerwise = Evaluator(recipe, cora_data, layerwise=True, recompute_bn=False)
    every = layerwise.full_logits(state)
    with torch.no_grad():
        assert (every - model(graph_inputs(cora_data, recipe.model))).abs().max() <= 1e-5  # float rounding
    exact, scored = metrics(full, labels), layerwise.validation(state)
    assert scored.acc == exact.acc and abs(scored.loss - exact.loss) <= 2e-6
    assert "val" not in vars(layerwise) and "full_adj" not in vars(layerwise)  # nothing whole-graph was built


def test_evaluator_goes_layerwise_on_big_graphs(cora_data, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not Evaluator(load_recipe(None, list(TRUNKLESS)), cora_data).layerwise
    monkeypatch.setattr(evaluation, "LAYERWISE_NODES", cora_data.num_nodes)
    assert Evaluator(load_recipe(None, list(TRUNKLESS)), cora_data).layerwise


def test_learned_partition_never_builds_the_whole_graph(cora_run: Path, cora_data, data_root: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--method learned-partition``: no whole-graph normalised adjacency, no validation neighbourhood and
    no model forward over the whole graph, anywhere in the soup step (scores are layer-wise)."""
    whole = cora_data.num_nodes
    sizes: list[int] = []

    def spy_adjacency(edge_index, num_nodes, model):
        assert num_nodes < whole, "a whole-graph adjacency was built"
        sizes.append(num_nodes)
        return adjacency(edge_index, num_nodes, model)

    def refuse(*args, **kwargs):
        raise AssertionError("the validation neighbourhood was built")

    forward = GNN.forward

    def spy_forward(self, inputs):
        assert inputs.num_nodes < whole, "a whole-graph forward ran"
        return forward(self, inputs)

    monkeypatch.setattr(evaluation, "adjacency", spy_adjacency)
    monkeypatch.setattr(learned, "adjacency", spy_adjacency)
    monkeypatch.setattr(evaluation, "k_hop_subgraph", refuse)
    monkeypatch.setattr(GNN, "forward", spy_forward)
    report = soup_run(cora_run, method="learned-partition", data_root=data_root, write=False)
    (soup,) = report["soups"]
    assert soup["method"] == "learned-partition" and soup["test_acc"] > 0.7
    assert sizes and max(sizes) < whole  # every step ran on a few parts
    assert soup["fitted"] and report["parallel_phase"] is None  # its validation figure chooses nothing
    assert "soup-learned-partition" in format_table(report).split("fitted on validation nodes (its val is not")[0]


def _curve_key(point: list[float] | tuple[float, float, float], metric: str) -> tuple[float, ...]:
    """The score of one ``(alpha, acc, loss)`` point of a GIS curve."""
    return Metrics(point[1], point[2]).key(metric)


def _ranked(states: list[StateDict], evaluator: Evaluator, metric: str) -> tuple[list[Metrics], list[int]]:
    """Each ingredient's validation score and the best-first order the soups walk."""
    scores = [evaluator.validation(state) for state in states]
    return scores, sorted(range(len(states)), key=lambda i: scores[i].key(metric), reverse=True)


@pytest.mark.parametrize("metric", SOUP_METRICS)
def test_greedy_soup_follows_its_rule_on_real_ingredients(cora_run: Path, cora_data, metric: str) -> None:
    """Replay Wortsman's rule over what the real validation scorer saw: each candidate is the mean of the
    kept ingredients and the next one, and joins exactly when its score does not drop (a tie joins)."""
    states = load_ingredients(cora_run).states
    evaluator = Evaluator(load_recipe("cora-gcn"), cora_data)
    scores, order = _ranked(states, evaluator, metric)
    states.append({key: value.clone() for key, value in states[order[0]].items()})  # its mean with the best ties
    scores, order = _ranked(states, evaluator, metric)
    assert order[1] == len(states) - 1
    seen: list[tuple[StateDict, Metrics]] = []

    def score(state: StateDict) -> Metrics:
        result = evaluator.validation(state)
        seen.append((state, result))
        return result

    soup = greedy_soup(states, order, score, metric)
    assert soup.evaluations == len(seen) == len(states) and seen[0][1] == scores[order[0]]
    kept, best = [order[0]], scores[order[0]].key(metric)
    for i, (candidate, result) in zip(order[1:], seen[1:]):
        expected = average([states[j] for j in kept + [i]])
        assert all(torch.equal(candidate[key], expected[key]) for key in expected)
        if result.key(metric) >= best:
            kept, best = kept + [i], result.key(metric)
    assert soup.kept == kept and len(states) - 1 in kept
    assert evaluator.validation(soup.state).key(metric) == best >= max(s.key(metric) for s in scores)


@pytest.mark.parametrize("metric", SOUP_METRICS)
def test_gis_soup_follows_its_rule_on_real_ingredients(cora_run: Path, cora_data, metric: str) -> None:
    """Each GIS step scores the whole grid, keeps the best alpha (ties to the larger), and alpha = 1 re-scores
    the soup so far exactly: the validation score never drops, step by step."""
    states = load_ingredients(cora_run).states
    evaluator = Evaluator(load_recipe("cora-gcn"), cora_data)
    scores, order = _ranked(states, evaluator, metric)
    soup = greedy_interpolation_soup(states, order, interpolation_of(evaluator.validation), metric, grid=6)
    assert soup.evaluations == sum(len(curve) for curve in soup.curves) == (len(states) - 1) * 6
    current = scores[order[0]].key(metric)
    for alpha, curve in zip(soup.alphas, soup.curves, strict=True):
        assert [point[0] for point in curve] == pytest.approx([i / 5 for i in range(6)])
        assert _curve_key(curve[-1], metric) == current  # alpha = 1: the soup so far
        chosen = max(curve, key=lambda point: (_curve_key(point, metric), point[0]))
        assert alpha == chosen[0] and _curve_key(chosen, metric) >= current
        current = _curve_key(chosen, metric)
    assert evaluator.validation(soup.state).key(metric) == current >= max(s.key(metric) for s in scores)
    # the soup is exactly the mean of ``kept`` weighted by the products of the alphas, and nothing else
    weights = {order[0]: 1.0}
    for i, alpha in zip(order[1:], soup.alphas):
        weights = {j: alpha * w for j, w in weights.items()} | {i: 1.0 - alpha}
    assert soup.kept == [j for j, w in weights.items() if w > 0]
    mixed = average([states[j] for j in soup.kept], [weights[j] for j in soup.kept])
    assert all(torch.allclose(soup.state[k], mixed[k], atol=1e-6) for k in mixed)


def test_soups_given_known_scores_make_the_same_soup_without_scoring_them_again(cora_run: Path, cora_data) -> None:
    """An alpha search's ends are the soup so far (alpha = 1) and the ingredient (0), exactly, and greedy starts from
    the best ingredient: with the ingredients' scores given, none of those is scored again and nothing else changes."""
    states = load_ingredients(cora_run).states
    evaluator = Evaluator(load_recipe("cora-gcn"), cora_data)
    scores, order = _ranked(states, evaluator, "acc")
    scored: list[StateDict] = []

    def score(state: StateDict) -> Metrics:
        scored.append(state)
        return evaluator.validation(state)

    again = greedy_interpolation_soup(states, order, interpolation_of(evaluator.validation), "acc", grid=6)
    soup = greedy_interpolation_soup(states, order, interpolation_of(score), "acc", grid=6, scores=scores)
    assert soup.alphas == again.alphas and soup.kept == again.kept and soup.curves == again.curves
    assert all(torch.equal(soup.state[k], again.state[k]) for k in soup.state)
    assert soup.evaluations == len(scored) == (len(states) - 1) * (6 - 2)
    scored.clear()
    greedy = greedy_soup(states, order, score, "acc", scores=scores)
    assert greedy.kept == greedy_soup(states, order, evaluator.validation, "acc").kept
    assert greedy.evaluations == len(scored) == len(states) - 1


def test_an_alpha_search_on_sampled_targets_mixes_the_two_first_layers(cora_run: Path, cora_data,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where candidates are scored layer-wise on a validation sample, a mix's first layer is the mix of its ends'
    (linear in the weights): its scores equal those of the interpolated weights, with one first-layer product an end;
    the mix a search keeps is the next search's soup, whose first layer it carries: that search computes one."""
    monkeypatch.setattr(evaluation, "VALIDATION_SAMPLE", 300)
    states = load_ingredients(cora_run).states
    evaluator = Evaluator(load_recipe("cora-gcn"), cora_data, layerwise=True)
    first_layers = []
    original = evaluator.val_targets._first
    monkeypatch.setattr(evaluator.val_targets, "_first", lambda conv: first_layers.append(conv) or original(conv))
    mixes = evaluator.interpolation(states[0], states[1])
    got = [mixes.score(alpha) for alpha in (0.0, 0.3, 0.75, 1.0)]
    assert len(first_layers) == 2
    for alpha, scored in zip((0.0, 0.3, 0.75, 1.0), got):
        expected = evaluator.validation(interpolate(states[0], states[1], alpha))
        assert scored.acc == expected.acc and abs(scored.loss - expected.loss) <= 1e-5
    assert got[0].loss != got[1].loss != got[2].loss  # the mixes differ
    kept = mixes.weights(0.3)
    assert all(torch.equal(kept[k], interpolate(states[0], states[1], 0.3)[k]) for k in kept)
    first_layers.clear()
    following = evaluator.interpolation(kept, states[2])
    scored = following.score(0.6)
    assert len(first_layers) == 1  # the ingredient's: the soup's came with it
    expected = evaluator.validation(interpolate(kept, states[2], 0.6))
    assert scored.acc == expected.acc and abs(scored.loss - expected.loss) <= 1e-5


def _scalar_states(*values: float) -> list[StateDict]:
    return [{"w": torch.tensor([value])} for value in values]


def test_greedy_default_is_wortsmans_rule_ties_accepted() -> None:
    """The default metric (``acc``) accepts an ingredient that ties on accuracy with a higher loss, as
    Wortsman et al.'s greedy soup does; ``acc+loss`` rejects it; a drop in accuracy is rejected by both."""
    assert load_recipe(None, list(TRUNKLESS)).soup.metric == "acc" == load_recipe("cora-gcn").soup.metric
    states = _scalar_states(0.0, 1.0, 3.0)

    def score(state: StateDict) -> Metrics:  # accuracy 0.8 while w <= 1 (then 0.7), loss grows with w
        w = float(state["w"])
        return Metrics(0.8 if w <= 1.0 else 0.7, 1.0 + w)

    assert greedy_soup(states, [0, 1, 2], score, "acc").kept == [0, 1]  # 0.5 ties 0.8, mean 4/3 drops
    assert greedy_soup(states, [0, 1, 2], score, "acc+loss").kept == [0]


def test_gis_kept_lists_only_what_the_soup_contains() -> None:
    """An alpha = 0 step replaces the soup by the ingredient: the ingredients before it are no longer in it."""
    states = _scalar_states(0.0, 1.0, 1.0)

    def score(state: StateDict) -> Metrics:  # the closer to w = 1, the better
        return Metrics(1.0 - abs(float(state["w"]) - 1.0), 0.0)

    soup = greedy_interpolation_soup(states, [0, 1, 2], interpolation_of(score), "acc", grid=3)
    assert soup.alphas == [0.0, 1.0]  # take ingredient 1 whole; then every alpha ties, the larger wins
    assert soup.kept == [1] and torch.equal(soup.state["w"], states[1]["w"])


def _with_a_trunk(trunk: float, *ingredients: float) -> SoupInputs:
    """Scalar ingredients and trunk scored by how close w is to 1 (accuracy 1 - |w - 1| / 4, no loss)."""
    def score(state: StateDict) -> Metrics:
        return Metrics(1.0 - abs(float(state["w"]) - 1.0) / 4, 0.0)

    states = _scalar_states(*ingredients)
    scores = [score(state) for state in states]
    order = sorted(range(len(states)), key=lambda i: scores[i].key("acc"), reverse=True)
    trunk_state = _scalar_states(trunk)[0]
    return SoupInputs(states, scores, order, score, interpolation_of(score), "acc", grid=5, fast=False,
                      evaluator=None, seed=0, trunk=trunk_state, trunk_score=score(trunk_state))


def test_greedy_and_gis_start_from_the_trunk_even_below_the_ingredients() -> None:
    """The measured rule (bench/RESULTS.md, *Greedy soups that start from the trunk*): the trunk first, then the
    ingredients best-first, however the trunk validates. From a weak trunk greedy keeps it and averages it in
    (w = 4/3: accuracy 0.92, where the best ingredient alone is 1.0); GIS leaves it with alpha = 0."""
    weak = _with_a_trunk(0.0, 1.0, 3.0)  # accuracies: trunk 0.75, ingredients 1.0 and 0.5
    greedy, gis = SOUPS["greedy"](weak), SOUPS["gis"](weak)
    assert greedy.order == gis.order == [TRUNK_INDEX, 0, 1]
    assert greedy.kept == [TRUNK_INDEX, 0, 1] and torch.allclose(greedy.state["w"], torch.tensor([4 / 3]))
    assert gis.alphas == [0.0, 1.0] and gis.kept == [0] and torch.equal(gis.state["w"], weak.states[0]["w"])


@pytest.fixture(scope="module")
def poisoned_root(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dataset root whose Cora has a random label on every node outside the validation split (140-639)."""
    root = tmp_path_factory.mktemp("poisoned")
    raw = root / "Cora" / "raw"
    shutil.copytree(data_root / "Cora" / "raw", raw)
    generator = np.random.default_rng(0)
    for name, keep in (("y", slice(0, 0)), ("ally", slice(140, 640)), ("ty", slice(0, 0))):
        path = raw / f"ind.cora.{name}"
        with path.open("rb") as stream:
            labels = pickle.load(stream, encoding="latin1")  # Planetoid's own format: one-hot numpy arrays
        poisoned = np.eye(labels.shape[1], dtype=labels.dtype)[generator.integers(labels.shape[1], size=len(labels))]
        poisoned[keep] = labels[keep]
        path.unlink()  # the copy keeps the read-only mode of the shared files
        with path.open("wb") as stream:
            pickle.dump(poisoned, stream)
    return root


def test_greedy_and_gis_read_no_label_outside_validation(cora_run: Path, cora_data, data_root: Path,
                                                         poisoned_root: Path, tmp_path: Path) -> None:
    """Souping against the poisoned dataset gives bitwise the same greedy and GIS soups; only test accuracy moves."""
    poisoned = load_dataset("cora", poisoned_root)
    val, test = cora_data.val_mask, cora_data.test_mask
    assert torch.equal(poisoned.val_mask, val) and torch.equal(poisoned.y[val], cora_data.y[val])
    assert (poisoned.y[test] != cora_data.y[test]).float().mean() > 0.5
    assert (poisoned.y[cora_data.train_mask] != cora_data.y[cora_data.train_mask]).float().mean() > 0.5
    for method in ("greedy", "gis"):
        clean_dir, dirty_dir = tmp_path / f"{method}-clean", tmp_path / f"{method}-poisoned"
        shutil.copytree(cora_run, clean_dir)
        shutil.copytree(cora_run, dirty_dir)
        clean = soup_run(clean_dir, method=method, data_root=data_root)
        dirty = soup_run(dirty_dir, method=method, data_root=poisoned_root, allow_other_data=True)
        ours, theirs = (load_state(d / f"soup-{method}.safetensors") for d in (clean_dir, dirty_dir))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), method
        for key in ("kept", "alphas", "curves", "evaluations", "val_acc", "val_loss"):
            assert clean["soups"][0][key] == dirty["soups"][0][key], (method, key)
        assert [r["val_loss"] for r in clean["ingredients"]] == [r["val_loss"] for r in dirty["ingredients"]]
        assert clean["soups"][0]["test_acc"] > dirty["soups"][0]["test_acc"] + 0.3  # the poison is there


def test_soup_cli_options_reach_the_soup(cora_run: Path, data_root: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``--method``, ``--grid``, ``--search``, ``--metric`` and ``--test-barrier`` decide the GIS soup the command
    writes and what its report measures."""
    run = tmp_path / "run"
    shutil.copytree(cora_run, run)

    def soup(*flags: str) -> dict:
        assert soup_main(["--run-dir", str(run), "--data-root", str(data_root), "--method", "gis", *flags]) == 0
        report = json.loads((run / "report.json").read_text())
        written = json.loads((run / "soup-gis.json").read_text())
        assert len(report["soups"]) == 1 and written["metric"] == report["metric"] == report["soups"][0]["metric"]
        assert {key: written[key] for key in ("grid", "search", "evaluations", "alphas")} == {
            key: report["soups"][0][key] for key in ("grid", "search", "evaluations", "alphas")}
        return report

    report = soup("--grid", "5", "--metric", "loss", "--test-barrier")
    on_test = [step["test_barrier"] for step in report["basin"]["steps"]]
    assert len(on_test) == 3 and min(on_test) >= 0 and report["basin"]["max_test_barrier"] == max(on_test)
    row = report["soups"][0]
    # each step scores the grid but its two ends (known)
    assert (row["metric"], row["grid"], row["search"], row["evaluations"]) == ("loss", 5, "grid", 3 * (5 - 2))
    assert row["kept"][0] == min(report["ingredients"], key=lambda r: r["val_loss"])["name"]  # best-first by loss
    for alpha, curve in zip(row["alphas"], row["curves"], strict=True):
        assert [point[0] for point in curve] == [0.0, 0.25, 0.5, 0.75, 1.0]
        assert alpha == max(curve, key=lambda point: (-point[2], point[0]))[0]

    report = soup("--search", "fast", "--metric", "acc")
    assert report["basin"]["max_test_barrier"] is None  # only when asked
    row = report["soups"][0]
    assert (row["metric"], row["grid"], row["search"]) == ("acc", 21, "fast")
    assert row["evaluations"] == sum(len(curve) - 2 for curve in row["curves"]) < 3 * 21  # the ends known
    for alpha, curve in zip(row["alphas"], row["curves"], strict=True):
        alphas = [point[0] for point in curve]
        assert {0.0, 0.25, 0.5, 0.75, 1.0} <= set(alphas)  # the coarse grid, then halving to 1/32 < 1/20
        assert all((a * 32).is_integer() for a in alphas) and any(not (a * 16).is_integer() for a in alphas)
        assert alpha == max(curve, key=lambda point: (point[1], point[0]))[0]
    assert "soup-gis" in capsys.readouterr().out
    with pytest.raises(LadleError, match="--grid must be >= 2"):
        soup_main(["--run-dir", str(run), "--data-root", str(data_root), "--grid", "1"])
    for options, message in (({"grid": 0}, "--grid must be >= 2; got 0"), ({"search": "fsat"}, "got 'fsat'")):
        with pytest.raises(LadleError, match=message):  # the library call checks what the command line does
            soup_run(run, method="gis", data_root=data_root, write=False, **options)


def test_real_soups_keep_validation_and_beat_the_mean_ingredient(cora_run: Path, cora_data, data_root: Path) -> None:
    report = soup_run(cora_run, data_root=data_root)
    evaluator, states = Evaluator(load_recipe("cora-gcn", ["epochs=80"]), cora_data), load_ingredients(cora_run).states
    mean = sum(evaluator.full_logits(state) for state in states) / len(states)  # the ensemble, summed in the same order
    ensemble = next(ref for ref in report["references"] if ref["name"] == "ensemble")
    expected = metrics(mean[cora_data.test_mask], cora_data.y[cora_data.test_mask])
    assert ensemble["test_acc"] == expected.acc and ensemble["val_acc"] == metrics(mean[cora_data.val_mask],
                                                                                   cora_data.y[cora_data.val_mask]).acc
    best_val = max(row["val_acc"] for row in report["ingredients"])
    soups = {row["method"]: row for row in report["soups"]}
    assert set(soups) == {"uniform", "greedy", "gis", "learned"}
    for method in ("greedy", "gis"):
        assert soups[method]["val_acc"] >= best_val
    assert max(row["val_acc"] for row in soups.values()) > report["mean_ingredient"]["val_acc"]
    assert {ref["name"] for ref in report["references"]} == {"ensemble", "baseline"}
    for name in ("report.json", "report.md", "soup-gis.safetensors", "soup-gis.json", "accuracy.png", "alpha.png"):
        assert (cora_run / name).stat().st_size > 0, name
    assert json.loads((cora_run / "soup-gis.json").read_text())["evaluations"] == 3 * (21 - 2)  # the ends known


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
    meta = run / "ingredient-01.json"
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {"recipe": 5}))  # valid JSON, not a recipe
    with pytest.raises(LadleError, match="ingredient-01.safetensors does not match the run's recipe .a recipe that "
                                         "is not a mapping: int"):
        soup_run(run, method="uniform", data_root=data_root, write=False)
    report = soup_run(run, method="uniform", skip_bad=True, data_root=data_root, write=False)
    assert list(report["skipped"]) == ["ingredient-01", "ingredient-02"]


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


def test_ingredient_rows_are_whole_splits_where_candidates_are_scored_on_a_sample(
        cora_run: Path, cora_data, data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At scale candidates are compared on a validation sample; the report's ingredient rows, and its best and mean
    ingredient, are whole splits all the same, as its soups' and references' rows are."""
    for module in ("pipeline", "evaluator"):
        monkeypatch.setattr(f"ladle.soup.{module}.LAYERWISE_NODES", 2708)
    monkeypatch.setattr(evaluation, "VALIDATION_SAMPLE", 100)
    report = soup_run(cora_run, method="uniform", data_root=data_root, write=False)
    assert report["validation"]["nodes"] == 100
    evaluator = Evaluator(load_recipe("cora-gcn"), cora_data)
    sampled = []
    for row in report["ingredients"]:
        state = load_state(cora_run / f"{row['name']}.safetensors")
        whole = evaluator.split(state, "val_mask")
        assert row["val_acc"] == pytest.approx(whole.acc) and row["val_loss"] == pytest.approx(whole.loss, abs=1e-5)
        sampled.append(Evaluator(load_recipe("cora-gcn"), cora_data, layerwise=True).validation(state).acc)
    assert [row["val_acc"] for row in report["ingredients"]] != pytest.approx(sampled)  # the sample's would differ
    assert report["mean_ingredient"]["val_acc"] == pytest.approx(sum(r["val_acc"] for r in report["ingredients"]) / 4)


def test_the_default_soup_takes_bounded_forms_on_a_large_graph(cora_run: Path, data_root: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """From ``LAYERWISE_NODES`` nodes on (lowered here to Cora's size), ``--method all`` leaves out the learned
    soup (154 s against 21 s of training at 200k nodes, even in its partition form) and takes the fast alpha
    search unless ``--search`` is named, and the report says so; the time line gives core-seconds."""
    run = tmp_path / "run"
    shutil.copytree(cora_run, run)
    for module in ("pipeline", "evaluator"):  # one threshold: where scoring goes layer-wise, the default is bounded
        monkeypatch.setattr(f"ladle.soup.{module}.LAYERWISE_NODES", 2708)
    report = soup_run(run, data_root=data_root, write=False)
    assert report["scaled"] == {"from_nodes": 2708, "left_out": ["learned"], "search": "fast"}
    assert [row["method"] for row in report["soups"]] == ["uniform", "greedy", "gis"]
    assert next(row for row in report["soups"] if row["method"] == "gis")["search"] == "fast"
    assert "from 2708 nodes --method all leaves out learned (too slow at this size; name it with --method) and " \
           "searches alpha fast" in format_table(report)
    metas = [json.loads((run / f"ingredient-{k:02d}.json").read_text()) for k in range(4)]
    assert report["ingredient_core_seconds"] == pytest.approx(sum(m["threads"] * m["train_seconds"] for m in metas))
    assert "in core-seconds" in format_table(report)
    assert soup_run(run, search="grid", data_root=data_root, write=False)["scaled"]["search"] == "grid"
    assert soup_run(run, method="uniform", data_root=data_root, write=False)["scaled"] is None  # named: as asked
