"""``python -m ladle.soup``: merge the ingredients of a run into one model.

Soups are a few lines over state dicts, each with its decision rule in its docstring:
uniform (mean of all), greedy (Wortsman et al. 2022) and greedy interpolation (Graph Ladling).
Candidates are scored on the validation split only; test accuracy is reported, never used.
"""
from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.utils import k_hop_subgraph

from ladle.checkpoints import (StateDict, ingredient_name, load_state, read_json, resolve_run_dir, save_state,
                               write_json)
from ladle.config import SOUP_METHODS, SOUP_METRICS, Recipe, recipe_from_dict
from ladle.data import load_dataset
from ladle.errors import LadleError, run_cli
from ladle.inference import LayerwiseInference
from ladle.models import GNN, GraphInputs, adjacency, build_model, use_sparse_features
from ladle.sparse import SparseMatrix, select

log = logging.getLogger(__name__)

Score = tuple[float, ...]
Scorer = Callable[[StateDict], "Metrics"]


@dataclass(frozen=True)
class Metrics:
    """Accuracy and mean cross-entropy of one model on one node set."""

    acc: float
    loss: float

    def key(self, metric: str) -> Score:
        """What soups maximise: ``acc``, ``-loss``, or accuracy with loss as the tie-break."""
        if metric == "acc":
            return (self.acc,)
        if metric == "loss":
            return (-self.loss,)
        return (self.acc, -self.loss)


# ---------------------------------------------------------------- the algorithms, over state dicts


def average(states: Sequence[StateDict], weights: Sequence[float] | None = None) -> StateDict:
    """Weighted mean of state dicts (uniform when ``weights`` is None); integer buffers from the first."""
    weights = [1.0 / len(states)] * len(states) if weights is None else list(weights)
    merged: StateDict = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            merged[key] = sum(w * s[key] for w, s in zip(weights, states))  # type: ignore[assignment]
        else:
            merged[key] = first.clone()
    return merged


def interpolate(soup: StateDict, ingredient: StateDict, alpha: float) -> StateDict:
    """``alpha * soup + (1 - alpha) * ingredient``; alpha = 1 returns the soup, 0 the ingredient, exactly."""
    if alpha == 1.0:
        return {k: v.clone() for k, v in soup.items()}
    if alpha == 0.0:
        return {k: v.clone() for k, v in ingredient.items()}
    return average([soup, ingredient], [alpha, 1.0 - alpha])


def uniform_soup(states: Sequence[StateDict]) -> StateDict:
    """The mean of all ingredients: no decision, no evaluation."""
    return average(states)


@dataclass
class SoupResult:
    """A merged model and how it was chosen."""

    method: str
    state: StateDict
    evaluations: int
    kept: list[int] = field(default_factory=list)
    alphas: list[float] = field(default_factory=list)
    curves: list[list[tuple[float, float, float]]] = field(default_factory=list)  # (alpha, acc, loss) per step
    seconds: float = 0.0


def greedy_soup(states: Sequence[StateDict], order: Sequence[int], score: Scorer, metric: str) -> SoupResult:
    """Wortsman et al.: walk ingredients best-first; add one to the running mean only if the
    validation score (``metric``) does not drop. Starts from the best ingredient."""
    kept = [order[0]]
    best = score(states[order[0]]).key(metric)
    evaluations = 1
    for i in order[1:]:
        candidate = score(average([states[j] for j in kept + [i]]))
        evaluations += 1
        if candidate.key(metric) >= best:
            kept.append(i)
            best = candidate.key(metric)
    return SoupResult("greedy", average([states[j] for j in kept]), evaluations, kept)


def alpha_grid(points: int) -> list[float]:
    """``points`` evenly spaced values of alpha in [0, 1], both ends included."""
    return [i / (points - 1) for i in range(points)]


def search_alpha(soup: StateDict, ingredient: StateDict, score: Scorer, metric: str, grid: int,
                 fast: bool) -> tuple[float, list[tuple[float, Metrics]]]:
    """Best alpha for ``alpha * soup + (1 - alpha) * ingredient``; ties go to the larger alpha.

    ``grid``: every point of an even grid. ``fast``: a 5-point coarse grid, then halving steps around
    the best point until the step is finer than the grid's, 2 evaluations a step.
    """
    tried: dict[float, Metrics] = {}

    def measure(alpha: float) -> None:
        alpha = round(min(1.0, max(0.0, alpha)), 6)
        if alpha not in tried:
            tried[alpha] = score(interpolate(soup, ingredient, alpha))

    def best() -> float:
        return max(tried, key=lambda a: (tried[a].key(metric), a))

    if not fast:
        for alpha in alpha_grid(grid):
            measure(alpha)
        return best(), sorted(tried.items())
    for alpha in alpha_grid(5):
        measure(alpha)
    step, target = 0.25, 1.0 / (grid - 1)
    while step > target:
        step /= 2
        centre = best()
        measure(centre - step)
        measure(centre + step)
    return best(), sorted(tried.items())


def greedy_interpolation_soup(states: Sequence[StateDict], order: Sequence[int], score: Scorer, metric: str,
                              grid: int = 21, fast: bool = False) -> SoupResult:
    """Graph Ladling's GIS: start from the best ingredient; for each next one (best-first) keep
    ``alpha * soup + (1 - alpha) * ingredient`` with the alpha of best validation score. alpha = 1
    (keep the soup) is always a candidate, so the validation score never drops."""
    soup = states[order[0]]
    evaluations, alphas, curves = 0, [], []
    for i in order[1:]:
        alpha, tried = search_alpha(soup, states[i], score, metric, grid, fast)
        evaluations += len(tried)
        alphas.append(alpha)
        curves.append([(a, m.acc, m.loss) for a, m in tried])
        soup = interpolate(soup, states[i], alpha)
    kept = [order[0]] + [i for i, a in zip(order[1:], alphas) if a < 1.0]
    return SoupResult("gis", soup, evaluations, kept, alphas, curves)


# ---------------------------------------------------------------- evaluation


class Evaluator:
    """Scores weights of one architecture on a graph's splits, cheaply.

    Validation needs only the L-hop neighbourhood of the validation nodes: that sub-graph (with the
    full graph's normalisation) is built once and every candidate is scored on it, exactly. Whole
    splits are scored by layer-wise inference (:mod:`ladle.inference`), which bounds memory at scale.
    """

    def __init__(self, recipe: Recipe, data: Data) -> None:
        self.recipe, self.data = recipe, data
        self.model: GNN = build_model(recipe, data.num_features, data.num_classes)
        self.sparse_features = use_sparse_features(data.x, recipe.model)
        self.full_adj = adjacency(data.edge_index, data.num_nodes, recipe.model)
        self.inference = LayerwiseInference.from_data(data)
        self.val = self._neighbourhood(data.val_mask)
        self.train_hood = self._neighbourhood(data.train_mask) if self.model.has_batch_norm() else None

    def _neighbourhood(self, mask: Tensor) -> tuple[GraphInputs, Tensor, Tensor]:
        """Inputs of the L-hop sub-graph around ``mask``'s nodes, their labels, and where they are."""
        seeds = mask.nonzero().view(-1)
        nodes, edge_index, mapping, _ = k_hop_subgraph(seeds, self.recipe.layers, self.data.edge_index,
                                                       relabel_nodes=True, num_nodes=self.data.num_nodes)
        x = self.data.x[nodes]
        features = SparseMatrix.from_dense(x) if self.sparse_features else x
        adj = edge_index if isinstance(self.full_adj, Tensor) else select(self.full_adj, nodes)
        return GraphInputs(features, adj, nodes.numel()), self.data.y[seeds], mapping

    @torch.no_grad()
    def full_logits(self, state: StateDict, recompute_bn: bool = True) -> Tensor:
        """Logits of every node, layer by layer over batches of adjacency rows (bounded memory at scale)."""
        return self.inference.logits(self.load(state, recompute_bn))

    def load(self, state: StateDict, recompute_bn: bool = True) -> GNN:
        """The model holding ``state``; batch-norm statistics recomputed on the training neighbourhood."""
        self.model.load_state_dict(state)
        if recompute_bn and self.train_hood is not None:
            recompute_batch_norm(self.model, self.train_hood[0])
        return self.model

    @torch.no_grad()
    def logits(self, state: StateDict, inputs: GraphInputs, recompute_bn: bool = True) -> Tensor:
        model = self.load(state, recompute_bn)
        model.eval()
        return model(inputs)

    def validation(self, state: StateDict, recompute_bn: bool = True) -> Metrics:
        """Validation accuracy and loss of ``state`` (on the validation neighbourhood)."""
        inputs, y, where = self.val
        return metrics(self.logits(state, inputs, recompute_bn)[where], y)

    def split(self, state: StateDict, mask_name: str, recompute_bn: bool = True) -> Metrics:
        """Accuracy and loss of ``state`` on a whole split of the full graph."""
        mask = self.data[mask_name]
        return metrics(self.full_logits(state, recompute_bn)[mask], self.data.y[mask])


def metrics(logits: Tensor, y: Tensor) -> Metrics:
    """Accuracy and mean cross-entropy."""
    return Metrics((logits.argmax(-1) == y).float().mean().item(), F.cross_entropy(logits, y).item())


@torch.no_grad()
def recompute_batch_norm(model: nn.Module, inputs: GraphInputs) -> None:
    """Reset batch-norm running statistics and re-estimate them in one forward pass (dropout off)."""
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average: one pass gives the exact batch statistics
    model.eval()
    for norm in norms:
        norm.train()
    model(inputs)
    model.eval()


# ---------------------------------------------------------------- loading a run


@dataclass
class Ingredients:
    """The finished ingredients of a run, compatible with each other."""

    names: list[str]
    states: list[StateDict]
    metas: list[dict[str, Any]]
    missing: list[str]
    skipped: list[str]


def load_ingredients(run_dir: Path, skip_bad: bool = False) -> Ingredients:
    """Load every finished ingredient; name missing ones; refuse (or skip) corrupt or mismatched ones."""
    run = read_json(run_dir / "run.json")
    names, states, metas, missing, skipped = [], [], [], [], []
    reference: tuple[dict[str, Any], dict[str, tuple[int, ...]]] | None = None
    for k in range(int(run["ingredients"])):
        name = ingredient_name(k)
        weights, meta_path = run_dir / f"{name}.safetensors", run_dir / f"{name}.json"
        if not weights.exists() and not meta_path.exists():
            missing.append(name)
            continue
        try:
            meta = read_json(meta_path)
            if meta.get("status") != "done":
                missing.append(name)
                continue
            state = load_state(weights)
            shapes = {key: tuple(v.shape) for key, v in state.items()}
            if reference is None:
                reference = (meta["recipe"], shapes)
            elif meta["recipe"] != reference[0] or shapes != reference[1]:
                raise LadleError(f"{weights} does not match the other ingredients (another recipe or architecture)")
        except LadleError as error:
            if not skip_bad:
                raise LadleError(f"{error} (or pass --skip-bad to soup the rest)") from None
            log.warning("skipping %s: %s", name, error)
            skipped.append(name)
            continue
        names.append(name)
        states.append(state)
        metas.append(meta)
    if not states:
        raise LadleError(f"no finished ingredient in {run_dir} (missing: {', '.join(missing) or 'none'})")
    if missing:
        log.warning("souping %d of %d ingredients; missing or unfinished: %s", len(states), run["ingredients"],
                    ", ".join(missing))
    return Ingredients(names, states, metas, missing, skipped)


# ---------------------------------------------------------------- the whole soup step


def soup_run(run_dir: str | Path | None = None, method: str | None = None, grid: int | None = None,
             search: str | None = None, metric: str | None = None, recompute_bn: bool | None = None,
             skip_bad: bool = False, data_root: str | Path | None = None, write: bool = True) -> dict[str, Any]:
    """Soup a run's ingredients with the chosen methods and write the soups and the report.

    Unset options come from the run's recipe (section ``soup``). Returns the report as a dict.
    This is the library call behind ``python -m ladle.soup``.
    """
    from ladle.report import write_report

    path = resolve_run_dir(run_dir)
    run = read_json(path / "run.json")
    bundle = load_ingredients(path, skip_bad)
    recipe = recipe_from_dict(bundle.metas[0]["recipe"])
    options = recipe.soup
    method = method or options.method
    grid = grid or options.grid
    fast = (search or options.search) == "fast"
    metric = metric or options.metric
    if metric not in SOUP_METRICS:
        raise LadleError(f"--metric must be one of {', '.join(SOUP_METRICS)}")
    recompute = options.recompute_bn if recompute_bn is None else recompute_bn
    data = load_dataset(recipe.dataset, data_root, recipe.split, recipe.features)
    if data.num_features != run["dataset"]["features"] or data.num_classes != run["dataset"]["classes"]:
        raise LadleError(f"dataset '{recipe.dataset}' does not match the run's (features/classes changed)")
    evaluator = Evaluator(recipe, data)

    def score(state: StateDict) -> Metrics:
        return evaluator.validation(state, recompute)

    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    ingredient_val = [score(s) for s in bundle.states]
    for name, state, val in zip(bundle.names, bundle.states, ingredient_val):
        test = evaluator.split(state, "test_mask", recompute)
        rows.append({"name": name, "kind": "ingredient", "val_acc": val.acc, "val_loss": val.loss,
                     "test_acc": test.acc})
    order = sorted(range(len(bundle.states)), key=lambda i: ingredient_val[i].key(metric), reverse=True)
    setup_seconds = time.perf_counter() - start

    methods = ["uniform", "greedy", "gis", "learned"] if method == "all" else [method]
    soups: list[SoupResult] = []
    for name in methods:
        began = time.perf_counter()
        if name == "uniform":
            result = SoupResult("uniform", uniform_soup(bundle.states), 0, list(range(len(bundle.states))))
        elif name == "greedy":
            result = greedy_soup(bundle.states, order, score, metric)
        elif name == "gis":
            result = greedy_interpolation_soup(bundle.states, order, score, metric, grid, fast)
        else:
            from ladle.learned import learned_soup

            result = learned_soup(bundle.states, evaluator, partition=name == "learned-partition", seed=recipe.seed)
        result.seconds = time.perf_counter() - began
        soups.append(result)

    references = []
    logits = torch.stack([evaluator.full_logits(s, recompute) for s in bundle.states]).mean(0)
    references.append({"name": "ensemble", "kind": "reference", **_split_metrics(logits, data)})
    averaged_path = path / "averaged.safetensors"
    if averaged_path.exists():
        averaged = load_state(averaged_path)
        references.append({"name": "averaged", "kind": "reference",
                           **_split_metrics(evaluator.full_logits(averaged, recompute), data)})
    baseline_path = path / "baseline.safetensors"
    if baseline_path.exists():
        baseline = load_state(baseline_path)
        references.append({"name": "baseline", "kind": "reference",
                           **_split_metrics(evaluator.full_logits(baseline, recompute), data)})

    soup_rows = []
    for result in soups:
        if recompute and evaluator.model.has_batch_norm():
            evaluator.load(result.state, True)
            result.state = {k: v.clone() for k, v in evaluator.model.state_dict().items()}
        val = evaluator.split(result.state, "val_mask", False)
        test = evaluator.split(result.state, "test_mask", False)
        row = {"name": f"soup-{result.method}", "kind": "soup", "method": result.method, "val_acc": val.acc,
               "val_loss": val.loss, "test_acc": test.acc, "evaluations": result.evaluations,
               "kept": [bundle.names[i] for i in result.kept], "alphas": result.alphas, "curves": result.curves,
               "seconds": result.seconds, "search": "fast" if fast else "grid", "grid": grid, "metric": metric}
        if hasattr(result, "mixing"):
            row |= {"layers": result.layers, "mixing": result.mixing, "best_epoch": result.best_epoch}
        soup_rows.append(row)
        if write:
            save_state(path / f"soup-{result.method}.safetensors", result.state)
            write_json(path / f"soup-{result.method}.json", {k: v for k, v in row.items() if k != "curves"}
                       | {"recipe": recipe.to_dict(), "recompute_bn": recompute})

    ingredient_seconds = sum(m.get("train_seconds", 0.0) for m in bundle.metas)
    report = {
        "run_dir": str(path), "dataset": recipe.dataset, "model": recipe.model, "view": recipe.view.kind,
        "init": run.get("init"), "ingredients": rows, "soups": soup_rows, "references": references,
        "best_ingredient": max(rows, key=lambda r: (r["val_acc"], -r["val_loss"])),
        "mean_ingredient": {"val_acc": sum(r["val_acc"] for r in rows) / len(rows),
                            "test_acc": sum(r["test_acc"] for r in rows) / len(rows)},
        "missing": bundle.missing, "skipped": bundle.skipped, "recompute_bn": recompute, "metric": metric,
        "soup_seconds": setup_seconds + sum(s.seconds for s in soups),
        "ingredient_train_seconds": ingredient_seconds,
        "views": [m.get("view", {}) for m in bundle.metas],
    }
    if write:
        write_report(path, report)
    return report


def _split_metrics(logits: Tensor, data: Data) -> dict[str, float]:
    val = metrics(logits[data.val_mask], data.y[data.val_mask])
    test = metrics(logits[data.test_mask], data.y[data.test_mask])
    return {"val_acc": val.acc, "val_loss": val.loss, "test_acc": test.acc}


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ladle.soup`` command line."""
    parser = argparse.ArgumentParser(prog="python -m ladle.soup", description="Soup the ingredients of a run.")
    parser.add_argument("--run-dir", help="run directory (default checkpoints/latest)")
    parser.add_argument("--method", choices=SOUP_METHODS,
                        help="soup method (default all: uniform, greedy, gis, learned)")
    parser.add_argument("--grid", type=int, help="alpha grid points for gis (default 21)")
    parser.add_argument("--search", choices=("grid", "fast"), help="alpha search for gis (default grid)")
    parser.add_argument("--metric", choices=SOUP_METRICS, help="validation score to maximise (default acc+loss)")
    parser.add_argument("--no-recompute-bn", dest="recompute_bn", action="store_false", default=None,
                        help="keep averaged batch-norm statistics instead of recomputing them")
    parser.add_argument("--skip-bad", action="store_true", help="skip corrupt or mismatched ingredients")
    parser.add_argument("--data-root", help="dataset root folder")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ladle.soup``."""
    from ladle.report import format_table

    args = build_parser().parse_args(argv)
    if args.grid is not None and args.grid < 2:
        raise LadleError("--grid must be >= 2")
    report = soup_run(args.run_dir, args.method, args.grid, args.search, args.metric, args.recompute_bn,
                      args.skip_bad, args.data_root)
    print(format_table(report))
    print(f"report: {Path(report['run_dir']) / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
