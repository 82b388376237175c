"""What the parallel phase is measured against: branches that select among the trunk's own weights too, the
trunk continued for a branch's epochs (the same worker without the K - 1 others), and a best-soup choice
that leaves soups fitted on validation nodes out."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import train_until_crash

from ladle.core.recipe import Recipe, load_recipe, recipe_from_dict
from ladle.core.rundir import CONTINUED, TRUNK, RunDir
from ladle.core.storage import load_state, save_state
from ladle.graph.inputs import graph_inputs
from ladle.nn.models import build_model
from ladle.soup.crossfit import cross_fitted, pooled
from ladle.soup.evaluator import Evaluator, SoupResult
from ladle.soup.methods import SOUPS, SoupInputs, SoupMethod
from ladle.soup.pipeline import baseline_in_trunk_epochs, parallel_phase, soup_run
from ladle.soup.report import format_table, trunk_line
from ladle.train.launch import train_ingredients
from ladle.train.loop import build_task_view, train_task
from ladle.train.task import IngredientTask


@pytest.fixture(scope="module")
def continued_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ClusterGCN branches from a 4-epoch trunk (the second with a vanishing learning rate and no
    dropout), with the trunk continued, souped with gis."""
    run_dir = tmp_path_factory.mktemp("continued") / "run"
    recipe = load_recipe(None, ["trunk.epochs=4", "epochs=3", "view.kind=cluster", "branch.keep=last",
                                "soup.method=gis", "branch.lr_scale=[1, 1e-28]", "branch.dropout=[0.5, 0.0]"])
    run = train_ingredients(recipe, ingredients=2, workers=1, run_dir=run_dir, data_root=data_root, threads=1)
    assert not run.failed and run.continued is not None
    soup_run(run_dir, data_root=data_root)
    return run_dir


def test_the_trunk_continued_takes_a_branchs_steps_from_the_trunk(continued_run: Path) -> None:
    continued = json.loads((continued_run / "trunk-continued.json").read_text())
    branch = json.loads((continued_run / "ingredient-00.json").read_text())
    trunk = json.loads((continued_run / "trunk.json").read_text())
    assert continued["role"] == "trunk-continued" and continued["start"] == "trunk" and continued["keep"] == "best"
    assert continued["view"]["kind"] == trunk["view"]["kind"] == branch["view"]["kind"] == "cluster"
    assert continued["epochs_run"] == branch["epochs_run"] == 3
    assert continued["steps"] == branch["steps"] == 3 * 8  # 32 METIS parts, 4 a batch: 8 steps an epoch
    assert trunk["steps"] == 4 * 8 and continued["plan"]["lr"] == branch["plan"]["lr"]
    assert continued["seed"] not in (branch["seed"], trunk["seed"])


def test_no_ingredient_replays_the_trunks_batches_and_the_continued_goes_on_with_them(cora_data, tmp_path) -> None:
    recipe = Recipe()  # the default: the trunk and the branches both on random-walk views
    tasks = [IngredientTask(None, 1, tmp_path, "shared", role=role) for role in (TRUNK, CONTINUED)]
    views = {task.name: build_task_view(recipe, cora_data, task)
             for task in tasks + [IngredientTask(k, 8, tmp_path, "shared") for k in range(8)]}
    after_trunk = recipe.trunk.epochs  # where the continued takes the trunk's stream up
    assert all(torch.equal(a.n_id, b.n_id) for a, b in zip(views[CONTINUED].batches(after_trunk),
                                                           views[TRUNK].batches(after_trunk), strict=True))
    trunk_batches = [batch.n_id for epoch in range(recipe.trunk.epochs) for batch in views[TRUNK].batches(epoch)]
    for name, view in views.items():
        if name not in (TRUNK, CONTINUED):  # 8 branches, 10 epochs each: none draws a subgraph the trunk drew
            drawn = [batch.n_id for epoch in range(recipe.trunk.epochs) for batch in view.batches(epoch)]
            assert not any(torch.equal(a, b) for a in drawn for b in trunk_batches if a.numel() == b.numel()), name


def test_ingredients_differ_in_their_settings_as_the_recipe_says(continued_run: Path) -> None:
    trunk = load_state(continued_run / "trunk.safetensors")
    metas = [json.loads((continued_run / f"ingredient-0{k}.json").read_text()) for k in (0, 1)]
    assert [meta["settings"]["dropout"] for meta in metas] == [0.5, 0.0]
    assert metas[1]["settings"]["lr"] == pytest.approx(0.01 * 1e-28) == metas[1]["plan"]["lr"]
    moved, frozen = (load_state(continued_run / f"ingredient-0{k}.safetensors") for k in (0, 1))
    assert all(torch.equal(frozen[key], trunk[key]) for key in trunk)  # Adam steps of 1e-30 vanish in float32
    assert any(not torch.equal(moved[key], trunk[key]) for key in trunk)
    assert json.loads((continued_run / "run.json").read_text())["recipe"]["branch"]["lr_scale"] == [1.0, 1e-28]


def test_distillation_holds_a_branch_and_the_trunk_continued_near_the_trunks_predictions(
        data_root: Path, cora_data, tmp_path: Path) -> None:
    """The same seeds with and without ``branch.distill``: with it, the branch and the trunk continued end nearer
    the trunk's predictions on the whole graph (KL divergence from the trunk's softmax); the trunk is the same."""
    inputs = graph_inputs(cora_data, "gcn")

    @torch.no_grad()
    def log_probs(run_dir: Path, name: str) -> torch.Tensor:
        model = build_model(Recipe(), cora_data.num_features, 7)
        model.load_state_dict(load_state(run_dir / f"{name}.safetensors"))
        return F.log_softmax(model.eval()(inputs), dim=-1)

    divergence = {}
    for weight in (0.0, 5.0):
        run_dir = tmp_path / f"distill-{weight}"
        recipe = load_recipe(None, ["trunk.epochs=4", "epochs=6", "view.kind=cluster", "branch.keep=last",
                                    f"branch.distill={weight}"])
        assert not train_ingredients(recipe, ingredients=1, workers=1, run_dir=run_dir, data_root=data_root,
                                     threads=1).failed
        trunk = log_probs(run_dir, TRUNK)
        divergence[weight] = {name: float(F.kl_div(log_probs(run_dir, name), trunk, reduction="batchmean",
                                                   log_target=True)) for name in ("ingredient-00", CONTINUED)}
        assert json.loads((run_dir / "run.json").read_text())["recipe"]["branch"]["distill"] == weight
    trunks = [load_state(tmp_path / f"distill-{weight}" / "trunk.safetensors") for weight in (0.0, 5.0)]
    assert all(torch.equal(trunks[0][key], trunks[1][key]) for key in trunks[0])
    for name in ("ingredient-00", CONTINUED):
        assert divergence[5.0][name] < 0.5 * divergence[0.0][name], (name, divergence)


@pytest.mark.parametrize("branch", ["branch.distill=1", "branch.drop_edge=0.3"])
def test_a_distilled_or_edge_dropping_branch_resumed_after_a_crash_is_bitwise_identical(
        cora_data, tmp_path: Path, monkeypatch, one_thread, branch: str) -> None:
    """The trunk a distilled branch is held near is the trunk's file, not the weights a resumed branch starts from;
    the edges DropEdge drops after the resume are those it would have dropped (the saved generator state)."""
    recipe = load_recipe(None, ["trunk.epochs=5", "epochs=8", branch])
    torch.manual_seed(1)
    trunk = build_model(recipe, cora_data.num_features, 7).state_dict()
    tasks = {}
    for name in ("whole", "resumed"):
        (tmp_path / name).mkdir()
        save_state(tmp_path / name / "trunk.safetensors", trunk)
        tasks[name] = IngredientTask(0, 2, tmp_path / name, "shared", 3)
    whole = train_task(recipe, cora_data, tasks["whole"])
    train_until_crash(recipe, cora_data, tasks["resumed"], 6, monkeypatch)  # its progress saved after epoch 2
    again = train_task(recipe, cora_data, tasks["resumed"])
    assert again["val_acc"] == whole["val_acc"] and again["epochs_run"] == whole["epochs_run"] == 8
    expected, found = (load_state(tasks[name].files.weights(tasks[name].name)) for name in ("whole", "resumed"))
    assert all(torch.equal(expected[key], found[key]) for key in expected)


def test_the_report_opens_with_what_the_branches_added(continued_run: Path) -> None:
    report = json.loads((continued_run / "report.json").read_text())
    references = {ref["name"]: ref for ref in report["references"]}
    assert references["trunk-continued"]["steps"] == 24 and references["trunk"]["epochs"] == 4
    phase = report["parallel_phase"]
    gis = next(soup for soup in report["soups"] if soup["method"] == "gis")
    assert phase["best_soup"] == "soup-gis" and phase["left_out"] == []
    assert phase["chosen_by"] == "cross-fitted validation" and 0 < gis["held_out_val_acc"] <= 1
    assert phase["gain_points"]["trunk"] == pytest.approx(100 * (gis["test_acc"] - references["trunk"]["test_acc"]))
    assert phase["gain_points"]["trunk-continued"] == pytest.approx(
        100 * (gis["test_acc"] - references["trunk-continued"]["test_acc"]))
    first = format_table(report).splitlines()[0]
    assert first.startswith(f"the branches added {phase['gain_points']['trunk']:+.1f} points over the trunk, "
                            f"{phase['gain_points']['trunk-continued']:+.1f} over the trunk continued")
    mean_branch = 100 * (gis["test_acc"] - report["mean_ingredient"]["test_acc"])
    assert phase["gain_points"]["mean ingredient"] == pytest.approx(mean_branch)
    assert f", {mean_branch:+.1f} over the mean branch, " in first
    assert (continued_run / "report.md").read_text().splitlines()[2].startswith("The branches added")


def test_a_branch_whose_every_epoch_is_worse_keeps_the_trunks_weights(data_root: Path, tmp_path: Path) -> None:
    # lr 10 wrecks a trained GCN at its first step: no branch epoch can match the trunk on validation
    recipe = load_recipe(None, ["trunk.epochs=20", "epochs=2", "view.kind=full", "branch.lr=10",
                                "branch.keep=best"])
    run = train_ingredients(recipe, ingredients=2, workers=1, run_dir=tmp_path / "run", data_root=data_root,
                            threads=1)
    trunk = load_state(tmp_path / "run" / "trunk.safetensors")
    for meta in [*run.ingredients, run.continued]:
        assert meta["best_epoch"] == -1 and meta["epochs_run"] == 2, meta["name"]
        kept = load_state(tmp_path / "run" / f"{meta['name']}.safetensors")
        assert all(torch.equal(kept[key], trunk[key]) for key in trunk), meta["name"]
        assert meta["val_acc"] == pytest.approx(run.trunk["val_acc"])


def test_a_soup_fitted_on_validation_nodes_is_left_out_of_the_best_soup_choice() -> None:
    soups = [{"name": "soup-gis", "method": "gis", "val_acc": 0.80, "val_loss": 0.7, "test_acc": 0.81},
             {"name": "soup-learned", "method": "learned", "val_acc": 0.90, "val_loss": 0.5, "test_acc": 0.79}]
    references = [{"name": "trunk", "test_acc": 0.80}, {"name": "trunk-continued", "test_acc": 0.82}]
    branches = {"mean ingredient": {"test_acc": 0.75}, "best ingredient": {"test_acc": 0.74}}
    phase = parallel_phase(soups, references, branches)
    assert phase is not None and phase["best_soup"] == "soup-gis" and phase["left_out"] == ["soup-learned"]
    assert phase["gain_points"] == pytest.approx({"trunk": 1.0, "trunk-continued": -1.0, "mean ingredient": 6.0,
                                                  "best ingredient": 7.0})
    assert parallel_phase(soups, references)["gain_points"] == pytest.approx({"trunk": 1.0, "trunk-continued": -1.0})
    assert parallel_phase(soups[1:], references) is None  # nothing fair to choose from


def test_the_best_soup_is_chosen_by_its_cross_fitted_figure() -> None:
    soups = [{"name": "soup-uniform", "method": "uniform", "val_acc": 0.80, "val_loss": 0.7, "test_acc": 0.82,
              "held_out_val_acc": 0.80, "held_out_val_loss": 0.7},
             {"name": "soup-gis", "method": "gis", "val_acc": 0.83, "val_loss": 0.6, "test_acc": 0.81,
              "held_out_val_acc": 0.79, "held_out_val_loss": 0.8}]
    phase = parallel_phase(soups, [{"name": "trunk", "test_acc": 0.80}])
    assert phase is not None and phase["best_soup"] == "soup-uniform"
    assert phase["chosen_by"] == "cross-fitted validation"
    assert phase["by_validation"] == {"name": "soup-gis", "test_acc": 0.81}
    assert phase["gain_points"]["trunk"] == pytest.approx(2.0)
    plain = parallel_phase([{k: v for k, v in soup.items() if not k.startswith("held_out")} for soup in soups], [])
    assert plain["best_soup"] == "soup-gis" and plain["chosen_by"] == "validation"


def test_a_cross_fitted_figure_judges_each_half_by_what_the_other_chose(continued_run: Path, cora_data) -> None:
    recipe = recipe_from_dict(json.loads((continued_run / "run.json").read_text())["recipe"])
    evaluator = Evaluator(recipe, cora_data)
    states = [load_state(continued_run / f"{name}.safetensors") for name in ("trunk", "ingredient-00", "ingredient-01")]
    first, second = evaluator.folds(recipe.seed)
    assert (first.numel(), second.numel()) == (250, 250)
    assert torch.equal(torch.cat([first, second]).sort().values, torch.arange(500))
    halves = {}
    for name, fold in (("first", first), ("second", second)):
        with evaluator.scoring_on(fold):
            halves[name] = [evaluator.validation(state) for state in states]
    whole = [evaluator.validation(state) for state in states]
    for k, state in enumerate(states):  # two halves pooled are the whole split
        both = pooled([(halves["first"][k], 250), (halves["second"][k], 250)])
        assert both.acc == pytest.approx(whole[k].acc) and both.loss == pytest.approx(whole[k].loss)

    # a method that keeps the best-scored state: made on one half, it is judged on the other
    pick = SoupMethod("pick", lambda inputs: SoupResult(inputs.states[inputs.order[0]], 0, [inputs.order[0]]))
    inputs = SoupInputs(states=states, scores=whole, order=[0, 1, 2], score=evaluator.validation,
                        interpolation=evaluator.interpolation, metric="acc", grid=5, fast=False, evaluator=evaluator,
                        seed=recipe.seed)
    figures = cross_fitted([pick, SOUPS["uniform"]], inputs, evaluator)
    chosen = {name: max(range(3), key=lambda k: halves[name][k].acc) for name in halves}  # first best on ties
    expected = pooled([(halves["second"][chosen["first"]], 250), (halves["first"][chosen["second"]], 250)])
    assert figures["pick"].acc == pytest.approx(expected.acc) and figures["pick"].loss == pytest.approx(expected.loss)
    uniform = evaluator.validation(SOUPS["uniform"](inputs).state)
    assert figures["uniform"].acc == pytest.approx(uniform.acc)
    assert figures["uniform"].loss == pytest.approx(uniform.loss)


def test_the_embedded_default_is_the_default_recipe_file() -> None:
    assert load_recipe(None) == Recipe() == load_recipe("default")
    assert Recipe().trunk.epochs > 0


def test_a_trunk_far_below_the_baseline_in_its_epochs_is_reported() -> None:
    """The trunk's gap is reported; the view is said to fail only when the trunk continued and the best soup fail
    too (a 10-epoch trunk kept last is far below on CiteSeer, where the view then does well)."""
    report = {"references": [{"name": "trunk", "val_acc": 0.573}, {"name": "baseline", "val_acc": 0.950}],
              "trunk": {"view": {"kind": "cluster"}, "epochs_run": 100}, "baseline_in_trunk_epochs": 0.890}
    assert trunk_line(report) == ("warning: the trunk validates 31.7 points below the full-graph baseline in the same "
                                  "100 epochs; no trunk continued tells whether cluster failed on this graph")
    report["references"].append({"name": "trunk-continued", "val_acc": 0.940})
    report["parallel_phase"] = {"val_acc": 0.954}
    assert trunk_line(report) == ("warning: the trunk validates 31.7 points below the full-graph baseline in the same "
                                  "100 epochs; continued on cluster it validates 1.0 points below the baseline, the "
                                  "best soup 0.4 points above it: the trunk lags, its view did not fail")
    report["references"][-1]["val_acc"], report["parallel_phase"]["val_acc"] = 0.900, 0.910
    assert trunk_line(report) == ("warning: the trunk validates 31.7 points below the full-graph baseline in the same "
                                  "100 epochs; cluster failed on this graph: the trunk continued on it validates 5.0 "
                                  "points below the baseline, the best soup 4.0; where one worker holds the whole "
                                  "graph, view.kind=full avoids it")
    report["references"][0]["val_acc"] = 0.875  # the trunk near the baseline in its epochs: the view's failure alone
    assert trunk_line(report) == ("warning: cluster failed on this graph: the trunk continued on it validates 5.0 "
                                  "points below the baseline, the best soup 4.0; where one worker holds the whole "
                                  "graph, view.kind=full avoids it")
    report["parallel_phase"]["val_acc"] = 0.940  # the soup recovers what the view lost: nothing to warn of
    assert trunk_line(report) == ""
    report["references"][0]["val_acc"], report["baseline_in_trunk_epochs"] = 0.573, None  # no curve: no trunk gap
    assert trunk_line(report) == ""


def test_the_baseline_is_read_in_the_trunks_epochs(tmp_path: Path) -> None:
    """A 10-epoch trunk kept last is held to the baseline's 10th epoch; one kept best to the best of its first 10."""
    files = RunDir(tmp_path)
    rows = [f"run,baseline,baseline,,{epoch},0.5,{0.5 + 0.01 * epoch:.2f},1.0,0.01,1.0" for epoch in range(30)]
    rows.insert(5, "run,trunk,trunk,,4,0.5,0.99,1.0,0.01,1.0")  # another model's row is not the baseline's
    files.metrics.write_text("run,name,role,k,epoch,train_loss,val_acc,val_loss,lr,seconds\n" + "\n".join(rows) + "\n")
    assert baseline_in_trunk_epochs(files, {"epochs_run": 10, "keep": "last"}) == pytest.approx(0.59)
    files.metrics.write_text(files.metrics.read_text().replace(",9,0.5,0.59,", ",9,0.5,0.40,"))
    assert baseline_in_trunk_epochs(files, {"epochs_run": 10, "keep": "best"}) == pytest.approx(0.58)
    assert baseline_in_trunk_epochs(files, None) is None
    files.metrics.write_text("not,a\ncurve")
    assert baseline_in_trunk_epochs(files, {"epochs_run": 10, "keep": "last"}) is None
