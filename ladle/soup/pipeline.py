"""``python -m ladle.soup``: merge the ingredients of a run into one model with each chosen method.

The methods are :data:`ladle.soup.methods.SOUPS` (uniform, greedy, gis, and the learned soups of
:mod:`ladle.soup.learned`). Candidates are scored on the validation split only; test accuracy is reported,
never used.
"""
from __future__ import annotations

import csv
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch_geometric.data import Data
from tqdm import tqdm

from ladle.core.errors import LadleError
from ladle.core.files import read_json, write_json
from ladle.core.recipe import SOUP_METRICS, SOUP_SEARCHES, Recipe, recipe_from_dict
from ladle.core.rundir import (
    AVERAGED,
    BASELINE,
    CONTINUED,
    TRUNK,
    RunDir,
    read_run,
    resolve_run_dir,
    soup_name,
)
from ladle.core.runlock import check_free, lock_run_dir
from ladle.core.storage import StateDict, save_state
from ladle.core.versions import library_versions
from ladle.graph.datasets import load_dataset
from ladle.graph.given import user_graph
from ladle.graph.shards import ShardSet, load_shard, shard_inputs
from ladle.nn.custom import ModelFactory, check_model_class
from ladle.nn.layerwise import LAYERWISE_MODELS, LayerwiseInference
from ladle.nn.models import build_model
from ladle.nn.saved import (
    Ingredients,
    check_same_data,
    check_weights,
    expected_shapes,
    load_ingredients,
)
from ladle.nn.scoring import Metrics
from ladle.nn.target_nodes import accuracy_stderr
from ladle.soup.basin import barrier, ingredient_distances, path_barriers
from ladle.soup.crossfit import cross_fitted
from ladle.soup.evaluator import LAYERWISE_NODES, Evaluator, Mixes, SoupResult
from ladle.soup.methods import (
    ALL_METHODS,
    SOUPS,
    TRUNK_INDEX,
    SoupInputs,
    SoupMethod,
    chosen_methods,
    scaled_methods,
)
from ladle.soup.report import write_report

log = logging.getLogger(__name__)

def soup_run(run_dir: str | Path | None = None, method: str | None = None, grid: int | None = None,
             search: str | None = None, metric: str | None = None, recompute_bn: bool | None = None,
             skip_bad: bool = False, data_root: str | Path | None = None, write: bool = True,
             allow_other_data: bool = False, data: Data | None = None,
             model: ModelFactory | None = None, test_barrier: bool = False) -> dict[str, Any]:
    """Soup a run's ingredients with the chosen methods and write the soups and the report.

    Unset options come from the run's recipe (section ``soup``). Returns the report as a dict. The data must be
    the run's (``run.json`` records its identity; ``data``: the graph it was given in memory), unless
    ``allow_other_data``. ``model``: the class a run of your own model (``model: custom``) was trained with.
    ``test_barrier``: also measure the interpolation path's barriers on the test nodes (a diagnostic, never a choice).
    This is the library call behind ``python -m ladle.soup``.
    """
    files = RunDir(resolve_run_dir(run_dir))
    if write:
        check_free(files.path)  # before the work; the write phase takes the lock
    run = read_run(files.path)
    recipe = recipe_from_dict(run["recipe"])
    check_model_class(recipe.model, model)
    graph = None if data is None else user_graph(data, recipe.features)
    check_same_data(run, files.path, data_root, allow_other_data, graph)
    bundle = load_ingredients(files.path, skip_bad, model)  # each checked against run.json's recipe
    options = recipe.soup
    method = method or options.method
    grid = options.grid if grid is None else grid
    searched = options.search if search is None else search
    metric = metric or options.metric
    if grid < 2:
        raise LadleError(f"--grid must be >= 2; got {grid}")
    if searched not in SOUP_SEARCHES:
        raise LadleError(f"--search must be one of {', '.join(SOUP_SEARCHES)}; got {searched!r}")
    if metric not in SOUP_METRICS:
        raise LadleError(f"--metric must be one of {', '.join(SOUP_METRICS)}")
    fast = searched == "fast"
    recompute = options.recompute_bn if recompute_bn is None else recompute_bn
    methods, scaled = chosen_methods(method), None
    if method == ALL_METHODS and int(run["dataset"].get("nodes", 0)) >= LAYERWISE_NODES:
        # the default stays cheap at scale: no method that does not scale, the fast alpha search unless asked
        methods, left_out = scaled_methods(methods)
        fast = fast or search is None
        scaled = {"from_nodes": LAYERWISE_NODES, "left_out": left_out, "search": "fast" if fast else "grid"}
    data, inference = _graph(files, recipe, data_root, methods, graph)
    if data.num_features != run["dataset"]["features"] or data.num_classes != run["dataset"]["classes"]:
        raise LadleError(f"dataset '{recipe.dataset}' does not match the run's (features/classes changed)")
    # learned-partition is for graphs whose validation neighbourhood does not fit: never build it then
    evaluator = Evaluator(recipe, data, layerwise=True if any(m.layerwise for m in methods) else None,
                          inference=inference, recompute_bn=recompute, model_class=model)
    expected = expected_shapes(run, model)
    trunk = _reference_weights(files, TRUNK, expected)
    # the best soup's choice reads a cross-fitted figure where validation is a few nodes (below the layer-wise size)
    choosable = [] if evaluator.layerwise else [m for m in methods if not m.fitted]
    bar = tqdm(total=planned_scorings(methods, len(bundle.states), grid, fast, trunk is not None, choosable),
               desc="soup scoring", unit="candidate", dynamic_ncols=True, disable=None)

    def score(state: StateDict) -> Metrics:
        bar.update(1)
        return evaluator.validation(state)

    def interpolation(soup: StateDict, ingredient: StateDict) -> Mixes:
        mixes = evaluator.interpolation(soup, ingredient)

        def score_mix(alpha: float) -> Metrics:
            bar.update(1)
            return mixes.score(alpha)
        return replace(mixes, score=score_mix)

    start = time.perf_counter()
    trunk_val = None if trunk is None else score(trunk)
    # one whole-graph pass per ingredient: its test accuracy, the ensemble's sum and, at scale, its validation score
    rows, logit_sum, ingredient_val = [], None, []
    for name, state in zip(bundle.names, bundle.states):
        logits = evaluator.full_logits(state)
        logit_sum = logits.clone() if logit_sum is None else logit_sum.add_(logits)
        val = evaluator.validation_from(logits)
        if val is None:
            val = score(state)
        else:
            bar.update(1)
        ingredient_val.append(val)  # what the soups order and compare candidates by (at scale, a sample's figure)
        rows.append({"name": name, "kind": "ingredient", **evaluator.split_metrics(logits)})  # whole splits
    order = sorted(range(len(bundle.states)), key=lambda i: ingredient_val[i].key(metric), reverse=True)
    setup_seconds = time.perf_counter() - start

    inputs = SoupInputs(states=bundle.states, scores=ingredient_val, order=order, score=score,
                        interpolation=interpolation, metric=metric, grid=grid, fast=fast, evaluator=evaluator,
                        seed=recipe.seed, trunk=trunk, trunk_score=trunk_val)
    soups: list[SoupResult] = []
    for soup_method in methods:
        began = time.perf_counter()
        result = soup_method(inputs)
        result.seconds = time.perf_counter() - began
        soups.append(result)
    began = time.perf_counter()
    held_out = cross_fitted(choosable, inputs, evaluator) if choosable else {}
    cross_fit_seconds = time.perf_counter() - began
    bar.total = bar.n  # the fast alpha search may skip points it already scored
    bar.close()

    references = _references(files, logit_sum / len(bundle.states), trunk, evaluator, expected)
    settings = {"search": "fast" if fast else "grid", "grid": grid, "metric": metric}
    soup_rows = [_soup_row(result, evaluator, bundle.names, settings, held_out.get(result.method))
                 for result in soups]
    if trunk is None and run.get("init") == "independent":  # none of them started from init.safetensors
        starts = _own_inits(recipe, evaluator.data, bundle.metas, model)
    else:
        starts = [trunk if trunk is not None else check_weights(files.init, expected)] * len(bundle.states)
    basin = _basin(soups, bundle, trunk, starts, "trunk" if trunk is not None else "init",
                   evaluator.test_accuracy if test_barrier else None)
    best_ingredient = max(rows, key=lambda r: (r["val_acc"], -r["val_loss"]))
    mean_ingredient = {"val_acc": sum(r["val_acc"] for r in rows) / len(rows),
                       "test_acc": sum(r["test_acc"] for r in rows) / len(rows)}
    report = {
        "run_dir": str(files.path), "dataset": recipe.dataset, "model": recipe.model, "forward": evaluator.forward,
        "view": recipe.view.kind,
        "init": run.get("init"), "ingredients": rows, "soups": soup_rows,
        "references": references, "best_ingredient": best_ingredient, "mean_ingredient": mean_ingredient,
        "parallel_phase": parallel_phase(soup_rows, references, {"mean ingredient": mean_ingredient,
                                                                 "best ingredient": best_ingredient}),
        "validation": _validation(evaluator, rows), "test_nodes": int(data.test_mask.sum()),
        "missing": bundle.missing, "skipped": bundle.skipped, "recompute_bn": recompute, "metric": metric,
        "soup_seconds": setup_seconds + sum(s.seconds for s in soups) + cross_fit_seconds,
        "cross_fit_seconds": cross_fit_seconds, "soup_threads": torch.get_num_threads(),
        "ingredient_train_seconds": sum(m.get("train_seconds", 0.0) for m in bundle.metas),
        "ingredient_core_seconds": sum(m.get("train_seconds", 0.0) * m.get("threads", 1) for m in bundle.metas),
        "scaled": scaled,
        "views": [m.get("view", {}) for m in bundle.metas], "partition": partition_summary(run, bundle.metas),
        "trunk": run.get("trunk"), "basin": basin,
        "view_fallback": run.get("view_fallback"),
        "versions": {"run": run.get("versions"), "soup": library_versions()},
        "baseline_in_trunk_epochs": baseline_in_trunk_epochs(files, run.get("trunk")),
        "keeps": [{"name": m["name"], "keep": m.get("keep", "best"), "reason": m.get("keep_reason", "")}
                  for m in bundle.metas],
    }
    if write:
        with lock_run_dir(files.path, "ladle.soup"):  # the write phase: soups, then the report
            files.report_json.unlink(missing_ok=True)  # a crash among the soups leaves no report naming other weights
            for result, row in zip(soups, soup_rows):
                save_state(files.weights(row["name"]), result.state)
                write_json(files.meta(row["name"]), {k: v for k, v in row.items() if k != "curves"}
                           | {"recipe": recipe.to_dict(), "recompute_bn": recompute})
            write_report(files.path, report)
    return report


def partition_summary(run: dict[str, Any], metas: list[dict[str, Any]]) -> dict[str, int] | None:
    """The partition the branches trained on: its parts, the graph's edges, those the parts cut, the halo's hops;
    None for other views (or a run whose record lacks the graph's edge count)."""
    view = next((meta["view"] for meta in metas if "total_cut_edges" in meta.get("view", {})), None)
    edges = run["dataset"].get("edges")
    if view is None or not edges:
        return None
    return {"parts": view["num_ingredients"], "edges": edges, "cut_edges": view["total_cut_edges"],
            "halo": view.get("halo", 0)}


def baseline_in_trunk_epochs(files: RunDir, trunk: dict[str, Any] | None) -> float | None:
    """The full-graph baseline's validation accuracy in as many epochs as the trunk trained (its best over them for
    a best-kept trunk, else at the trunk's last epoch), from the run's training curves: what the trunk's view is
    held to. None without a trunk, a baseline or readable curves."""
    if not trunk or not files.metrics.is_file():
        return None
    try:
        with open(files.metrics, newline="") as stream:
            curve = {int(row["epoch"]): float(row["val_acc"]) for row in csv.DictReader(stream)
                     if row.get("name") == BASELINE and row.get("val_acc")}
    except (OSError, csv.Error, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
    within = [acc for epoch, acc in sorted(curve.items()) if epoch < trunk.get("epochs_run", 0)]
    if not within:
        return None
    return max(within) if trunk.get("keep") == "best" else within[-1]


def _graph(files: RunDir, recipe: Recipe, data_root: str | Path | None, methods: list[SoupMethod],
           graph: Data | None) -> tuple[Data, LayerwiseInference | None]:
    """The run's graph: its whole-graph shard, memory-mapped with its CSR (no second load of the dataset),
    when the run's shards are still there and match the dataset's files (or the ``graph`` given); else the
    dataset, loaded (or that graph). On a graph scored layer-wise, by soups that need no neighbourhood, no
    ``edge_index`` is built."""
    try:
        shards = ShardSet.open(files.shards)
        usable = shards.complete() and shards.meta["inputs"] == shard_inputs(
            recipe, shards.meta["inputs"]["ingredients"], data_root, graph)
    except (LadleError, OSError, KeyError, TypeError):
        usable = False
    if not usable:
        log.info("the run's shards are gone or stale; reading %s", recipe.dataset if graph is None else "the graph")
        return (load_dataset(recipe.dataset, data_root, recipe.split, recipe.features) if graph is None
                else graph), None
    csr_only = (shards.meta["graph"]["num_nodes"] >= LAYERWISE_NODES and all(m.inference_only for m in methods)
                and recipe.model in LAYERWISE_MODELS)
    shard = load_shard(shards.graph(), edge_index=not csr_only)
    return shard.data, LayerwiseInference.from_shard(shard)


def _validation(evaluator: Evaluator, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How candidates were scored: on how many validation nodes of how many, and, when sampled, the standard
    error of an accuracy there (at the best ingredient's whole-split accuracy)."""
    used, total = evaluator.validation_nodes()
    best = max(row["val_acc"] for row in rows)
    return {"nodes": used, "of": total, "stderr": accuracy_stderr(best, used) if used < total else 0.0}


def planned_scorings(methods: list[SoupMethod], ingredients: int, grid: int, fast: bool, trunk: bool = False,
                     cross_fitted_methods: list[SoupMethod] | None = None) -> int:
    """Validation scorings of the K ingredients and the trunk when the run has one, then of each method's candidates
    (at most, for the fast alpha search) over them, the trunk first; then, for ``cross_fitted_methods``, the same on
    each half of the validation nodes (the soups' scorings on the other half are not counted)."""
    candidates = ingredients + int(trunk)
    planned = candidates + sum(m.scorings(candidates, grid, fast) for m in methods)
    again = cross_fitted_methods or []
    if again:
        planned += 2 * (candidates + sum(m.scorings(candidates, grid, fast) for m in again))
    return planned


def _soup_row(result: SoupResult, evaluator: Evaluator, names: list[str], settings: dict[str, Any],
              held_out: Metrics | None = None) -> dict[str, Any]:
    """A soup's report row, scored on whole splits, with its cross-fitted validation figure when ``held_out`` is
    given (:mod:`ladle.soup.crossfit`); its batch-norm statistics recomputed first (in place)."""
    logits = evaluator.full_logits(result.state)  # one pass; batch-norm statistics recomputed first
    if evaluator.recompute_bn and evaluator.model.has_batch_norm():
        result.state = {k: v.clone() for k, v in evaluator.model.state_dict().items()}
    return {"name": soup_name(result.method), "kind": "soup", "method": result.method,
            "fitted": SOUPS[result.method].fitted, **evaluator.split_metrics(logits), "evaluations": result.evaluations,
            "kept": [TRUNK if i == TRUNK_INDEX else names[i] for i in result.kept], "alphas": result.alphas,
            "curves": result.curves,
            "seconds": result.seconds, **settings, **result.report_fields(),
            **({} if held_out is None else {"held_out_val_acc": held_out.acc, "held_out_val_loss": held_out.loss})}


def _own_inits(recipe: Recipe, data: Data, metas: list[dict[str, Any]], model: ModelFactory | None
               ) -> list[StateDict]:
    """Each independently drawn ingredient's initial weights, drawn again from its seed as its training drew them."""
    with torch.random.fork_rng(devices=[]):
        inits = []
        for meta in metas:
            torch.manual_seed(meta["seed"])
            inits.append(build_model(recipe, data.num_features, data.num_classes, model).state_dict())
    return inits


def _basin(soups: list[SoupResult], bundle: Ingredients, trunk: StateDict | None, starts: list[StateDict],
           start_name: str, test_accuracy: Callable[[StateDict], float] | None) -> dict[str, Any]:
    """Whether the ingredients sit in one basin: the barrier (:func:`ladle.soup.basin.barrier`, validation points)
    of every greedy-interpolation step (along its path: its start, then each step's ingredient or the ``trunk``)
    and, where ``test_accuracy`` is given, the same path's barrier on the test nodes; and each ingredient's
    distance from the weights it started from (``starts``, one per ingredient; ``start_name``: the trunk or the init,
    the shared one or, in a run of independent inits, each one's own) and from the soup (the
    first with interpolation curves, else the first soup made)."""
    interpolated = next((result for result in soups if result.curves), None)
    alphas, curves = ([], []) if interpolated is None else (interpolated.alphas, interpolated.curves)
    path = [(TRUNK, trunk) if i == TRUNK_INDEX else (bundle.names[i], bundle.states[i])
            for i in ([] if interpolated is None else interpolated.order)]
    steps = [{"ingredient": name, "alpha": alpha,
              "barrier": barrier([a for a, _, _ in curve], [acc for _, acc, _ in curve])}
             for (name, _), alpha, curve in zip(path[1:], alphas, curves)]
    if test_accuracy is not None and steps:
        tried = [[a for a, _, _ in curve] for curve in curves]
        for step, test_barrier in zip(steps, path_barriers([state for _, state in path], alphas, tried, test_accuracy)):
            step["test_barrier"] = test_barrier
    soup = interpolated or soups[0]
    distances = ingredient_distances(starts, soup.state, bundle.states)
    return {"start": start_name, "soup": soup_name(soup.method), "steps": steps,
            "max_barrier": max((step["barrier"] for step in steps), default=0.0),
            "max_test_barrier": max((step["test_barrier"] for step in steps), default=0.0) if test_accuracy else None,
            "distances": [{"name": name, f"from_{start_name}": d["from_init"], "from_soup": d["from_soup"]}
                          for name, d in zip(bundle.names, distances)]}


def _reference_weights(files: RunDir, name: str, expected: dict[str, tuple[int, ...]]) -> StateDict | None:
    """The weights of the run's trunk (or another reference model), checked like an ingredient's; None when absent."""
    if not files.weights(name).exists():
        return None
    try:
        return check_weights(files.weights(name), expected)
    except LadleError as error:
        fix = "remove it" if name == AVERAGED else f"python -m ladle.train --resume --run-dir {files.path} trains it again"
        raise LadleError(f"{error}: {fix}") from None


def _references(files: RunDir, ensemble: Tensor, trunk: StateDict | None, evaluator: Evaluator,
                expected: dict[str, tuple[int, ...]]) -> list[dict[str, Any]]:
    """What the soups are compared with, not soups themselves: the logit ensemble (``ensemble``: the
    ingredients' mean logits), and the run's trunk, trunk continued, periodically averaged model and
    full-graph baseline when it has them, each with the epochs and optimizer steps it trained."""
    references = [{"name": "ensemble", "kind": "reference", **evaluator.split_metrics(ensemble)}]
    models = {TRUNK: trunk} | {name: _reference_weights(files, name, expected) for name in (CONTINUED, AVERAGED, BASELINE)}
    for name, state in models.items():
        if state is not None:
            logits = evaluator.full_logits(state)
            meta = read_json(files.meta(name)) if files.meta(name).is_file() else {}
            references.append({"name": name, "kind": "reference", **evaluator.split_metrics(logits),
                               "epochs": meta.get("epochs_run"), "steps": meta.get("steps")})
    return references


def parallel_phase(soup_rows: list[dict[str, Any]], references: list[dict[str, Any]],
                   ingredients: Mapping[str, dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """What the K branches added: the best soup (by validation accuracy, then loss) against the trunk, the
    trunk continued, the baseline and ``ingredients``' summaries (the mean ingredient, what one worker gives in
    expectation, and the best-validation one, which a user could simply keep), in test points. Soups fitted on
    validation nodes (the learned ones) are left out of the choice: their validation figure is not a fair one.
    Where the rows have their cross-fitted figure (``held_out_val_acc``), the choice reads it: the others' choices
    were made on the nodes that judge them. ``by_validation``: the soup the plain validation figure would choose."""
    fitted = sorted(row["name"] for row in soup_rows if SOUPS[row["method"]].fitted)
    candidates = [row for row in soup_rows if row["name"] not in fitted]
    if not candidates:
        return None
    held_out = all("held_out_val_acc" in row for row in candidates)
    by_validation = max(candidates, key=lambda row: (row["val_acc"], -row["val_loss"]))
    best = max(candidates, key=lambda row: (row["held_out_val_acc"], -row["held_out_val_loss"])) if held_out \
        else by_validation
    against = {ref["name"]: ref for ref in references if ref["name"] in (TRUNK, CONTINUED, BASELINE)}
    against |= ingredients or {}
    gains = {name: 100 * (best["test_acc"] - reference["test_acc"]) for name, reference in against.items()}
    return {"best_soup": best["name"], "val_acc": best["val_acc"], "test_acc": best["test_acc"],
            "gain_points": gains, "left_out": fitted, "chosen_by": "cross-fitted validation" if held_out
            else "validation", "by_validation": {"name": by_validation["name"], "test_acc": by_validation["test_acc"]}}
