"""Reports of a run: the soup's plain-text table, JSON, Markdown and plots, and the varrate table and
plot of test accuracy against bytes sent. Plots use matplotlib's ``Figure`` (never pyplot), so no
process-wide backend is switched; without matplotlib only the text is written."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ladle.core.files import atomic_open, write_json
from ladle.core.rundir import FAILED_VIEW, RunDir
from ladle.core.storage import save_figure

log = logging.getLogger(__name__)

BASIN_POINTS = 1.0  # a larger barrier (validation points) means the ingredients are not in one basin
TRUNK_GAP_POINTS = 2.0  # a trunk this far below the full-graph baseline on validation failed on its view
CUT_SHARE = 0.5  # parts that cut more than this share of the graph's edges leave each branch the lesser part of them
RESOLUTION_POINTS = 0.5  # one test node worth this many accuracy points or more (< 200 nodes): the report says so


def table_rows(report: dict[str, Any]) -> list[tuple[str, float, float, str]]:
    """(name, val acc, test acc, note) for ingredients, summaries, soups and references."""
    rows: list[tuple[str, float, float, str]] = [
        (r["name"], r["val_acc"], r["test_acc"], "") for r in report["ingredients"]
    ]
    best, mean = report["best_ingredient"], report["mean_ingredient"]
    rows.append(("best ingredient", best["val_acc"], best["test_acc"], best["name"]))
    rows.append(("mean ingredient", mean["val_acc"], mean["test_acc"], ""))
    for soup in report["soups"]:
        note = f"{soup['evaluations']} evals, kept {len(soup['kept'])}"
        if "held_out_val_acc" in soup:
            note += f", held-out val {soup['held_out_val_acc']:.4f}"
        if soup.get("fitted"):
            note += ", fitted on validation nodes (its val is not a fair figure)"
        if soup["alphas"]:
            note += ", alphas " + " ".join(f"{a:.2f}" for a in soup["alphas"])
        rows.append((soup["name"], soup["val_acc"], soup["test_acc"], note))
    for ref in report["references"]:
        trained = f", {ref['epochs']} epochs, {ref['steps']} steps" if ref.get("steps") is not None else ""
        rows.append((f"{ref['name']} (ref)", ref["val_acc"], ref["test_acc"], "not a soup" + trained))
    return rows


def parallel_line(report: dict[str, Any]) -> str:
    """The report's first line: what the parallel phase added over the trunk and the trunk continued (test
    points, negative figures as they are), and which soup validation chose ('' without a trunk)."""
    phase = report.get("parallel_phase")
    if not phase or "trunk" not in phase["gain_points"]:
        return ""
    gains = phase["gain_points"]
    line = f"the branches added {gains['trunk']:+.1f} points over the trunk"
    if "trunk-continued" in gains:
        line += f", {gains['trunk-continued']:+.1f} over the trunk continued"
    if "mean ingredient" in gains:
        line += (f", {gains['mean ingredient']:+.1f} over the mean branch, {gains['best ingredient']:+.1f} over the "
                 "best-validation branch")
    line += f" (test, best soup by {phase['chosen_by']}: {phase['best_soup']}, {phase['test_acc']:.4f}"
    if phase["left_out"]:
        line += f"; {', '.join(phase['left_out'])} left out of that choice: fitted on validation nodes"
    return line + ")"


def trunk_line(report: dict[str, Any]) -> str:
    """A warning when the trunk validates more than :data:`TRUNK_GAP_POINTS` below what the run's full-graph
    baseline reached in the same epochs, read beside the trunk continued (the trunk's view for all the branches'
    epochs): a short trunk kept at its last epoch is often far below (CiteSeer: 27 points at 10 epochs) on a view
    that then does well. The view is said to have failed on the graph only when the trunk continued and the best
    soup both validate more than that below the baseline ('' when nothing is, or without the baseline)."""
    refs = {ref["name"]: ref for ref in report["references"]}
    trunk, baseline = refs.get("trunk"), refs.get("baseline")
    if trunk is None or baseline is None:
        return ""
    summary = report.get("trunk") or {}
    view, epochs = summary.get("view", {}).get("kind", "its view"), summary.get("epochs_run")
    baseline_then = report.get("baseline_in_trunk_epochs")
    trunk_gap = None if baseline_then is None else 100 * (baseline_then - trunk["val_acc"])
    continued, soup = (None if model is None else 100 * (baseline["val_acc"] - model["val_acc"])
                       for model in (refs.get("trunk-continued"), report.get("parallel_phase")))
    failed = continued is not None and soup is not None and min(continued, soup) > TRUNK_GAP_POINTS
    if not failed and (trunk_gap is None or trunk_gap <= TRUNK_GAP_POINTS):
        return ""
    line = "warning: "
    if trunk_gap is not None and trunk_gap > TRUNK_GAP_POINTS:
        line += f"the trunk validates {trunk_gap:.1f} points below the full-graph baseline in the same {epochs} epochs; "
    if failed:
        return line + (f"{view} failed on this graph: the trunk continued on it validates {continued:.1f} points below "
                       f"the baseline, the best soup {soup:.1f}" + ("" if view == "full" else "; where one worker "
                       "holds the whole graph, view.kind=full avoids it"))
    if continued is None:
        return line + f"no trunk continued tells whether {view} failed on this graph"
    return line + (f"continued on {view} it validates {_relative(continued)} the baseline"
                   + ("" if soup is None else f", the best soup {_relative(soup)} it") + ": the trunk lags, its "
                   "view did not fail")


def partition_line(report: dict[str, Any]) -> str:
    """A note when the parts of a partition view cut more than :data:`CUT_SHARE` of the graph's edges: each branch
    trained on its part's induced subgraph (and halo), without them ('' otherwise, and for other views)."""
    partition = report.get("partition")
    if not partition or partition["cut_edges"] <= CUT_SHARE * partition["edges"]:
        return ""
    return (f"note: {partition_text(partition)}; each branch trained on its part without the edges that leave it "
            "(view.halo adds its in-neighbours)")


def resolution_line(report: dict[str, Any]) -> str:
    """A note when one test node is worth :data:`RESOLUTION_POINTS` of accuracy or more: every difference the report
    prints then moves in steps that large (WebKB's 37 test nodes: 2.7 points), '' otherwise."""
    nodes, validation = report.get("test_nodes"), (report.get("validation") or {}).get("of")
    if not nodes or 100 / nodes < RESOLUTION_POINTS:
        return ""
    line = f"note: the test split has {nodes} nodes, one node {100 / nodes:.1f} points of accuracy"
    if validation:
        line += f" (validation: {validation} nodes, {100 / validation:.1f} points)"
    return line + ": a difference of a node or two between models is no measurement"


def partition_text(partition: dict[str, Any]) -> str:
    """'the 8 parts cut 86% of the graph's 181,908 edges (halo 0)'."""
    return (f"the {partition['parts']} parts cut {partition['cut_edges'] / partition['edges']:.0%} of the graph's "
            f"{partition['edges']:,} edges (halo {partition['halo']})")


def _relative(points_below: float) -> str:
    """'1.8 points below' or '0.4 points above'."""
    return f"{abs(points_below):.1f} points {'below' if points_below > 0 else 'above'}"


def fallback_text(failure: dict[str, Any]) -> str:
    """What the launcher did when a run's view failed (``run.json``'s ``view_fallback``, :mod:`ladle.train.view_check`):
    for the run's summary table and the soup report."""
    return (f"{failure['view']} failed on this graph ({failure_reason(failure)}): the launcher trained the trunk and "
            f"the branches again on the whole graph (the first ones are in {FAILED_VIEW}/)")


def failure_reason(failure: dict[str, Any]) -> str:
    """Why the view was said to have failed: against the full-graph baseline, or from its models' agreement."""
    if "gap_points" in failure:
        return f"{failure['best']} on it validated {failure['gap_points']:.1f} points below the full-graph baseline"
    agreement, least = 100 * failure["agreement"], 100 * failure["agreement_min"]
    return (f"the model on it that agrees most, {failure['best']}, classifies {agreement:.1f} % of its training nodes "
            f"the same in its batches as in the whole graph, < {least:.0f} %")


def fallback_line(report: dict[str, Any]) -> str:
    """What the launcher did when the asked view failed on the graph (:mod:`ladle.train.view_check`), or ''."""
    failure = report.get("view_fallback")
    return fallback_text(failure) + "; these are their soups" if failure else ""


def format_table(report: dict[str, Any]) -> str:
    """The report as an aligned plain-text table."""
    lines = [line for line in (parallel_line(report), fallback_line(report), trunk_line(report),
                               partition_line(report), resolution_line(report)) if line]
    lines.append(f"{'model':<24}{'val':>8}{'test':>8}  note")
    lines += [f"{name:<24}{val:>8.4f}{test:>8.4f}  {note}" for name, val, test, note in table_rows(report)]
    if report.get("missing"):
        lines.append(f"missing or unfinished ingredients: {', '.join(report['missing'])}")
    lines += [f"skipped (--skip-bad): {name}: {why}" for name, why in report.get("skipped", {}).items()]
    if report.get("basin"):
        lines.append(basin_line(report["basin"]))
    lines.append(time_line(report))
    lines += [line for line in (validation_line(report), scaled_line(report), forward_line(report)) if line]
    return "\n".join(lines)


def time_line(report: dict[str, Any]) -> str:
    """The soup's time against the ingredients' training, in seconds and in core-seconds (threads x seconds)."""
    line = f"soup time {report['soup_seconds']:.1f} s vs ingredient training {report['ingredient_train_seconds']:.1f} s"
    if not report.get("ingredient_core_seconds"):
        return line
    soup = report["soup_seconds"] * report["soup_threads"]
    return (f"{line}; in core-seconds {soup:.0f} ({report['soup_threads']} threads) vs "
            f"{report['ingredient_core_seconds']:.0f}: {soup / report['ingredient_core_seconds']:.2f}x")


def scaled_line(report: dict[str, Any]) -> str:
    """What ``--method all`` ran instead on a large graph, or ''."""
    scaled = report.get("scaled")
    if not scaled:
        return ""
    left = ", ".join(scaled["left_out"]) or "nothing"
    return (f"from {scaled['from_nodes']} nodes --method all leaves out {left} (too slow at this size; name it with "
            f"--method) and searches alpha {scaled['search']} (--search grid for every point)")


def forward_line(report: dict[str, Any]) -> str:
    """How models without ladle's layer-wise path (GIN, APPNP, your own) were scored, or ''."""
    if report.get("forward", "layer-wise") == "layer-wise":
        return ""
    return (f"{report['model']} has no layer-wise inference in ladle: every model was scored by whole-graph forwards "
            "of edge_index (validation: on the sub-graph the validation nodes' logits read; for a model of your own, "
            "whose reach ladle cannot know, the whole graph)")


def validation_line(report: dict[str, Any]) -> str:
    """Where candidates were scored, when it was a sample of the validation split (else empty)."""
    validation = report.get("validation") or {}
    if validation.get("nodes", 0) >= validation.get("of", 0):
        return ""
    return (f"candidates scored on a fixed sample of {validation['nodes']:,} of {validation['of']:,} validation "
            f"nodes (standard error of an accuracy there: {100 * validation['stderr']:.2f} points); "
            "the table's val column is the whole split")


def format_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: settings, the table, and each ingredient's view."""
    lines = [
        f"# Soup report: {report['dataset']} / {report['model']} / view {report['view']}",
        "",
        *([parallel_line(report)[0].upper() + parallel_line(report)[1:] + ".", ""] if parallel_line(report) else []),
        *([f"**{fallback_line(report)}.**", ""] if fallback_line(report) else []),
        *([f"**{trunk_line(report)}.**", ""] if trunk_line(report) else []),
        f"init {report['init']}, metric {report['metric']}, batch-norm recompute {report['recompute_bn']}, "
        f"{time_line(report)}",
        *[line for line in (validation_line(report), scaled_line(report), forward_line(report),
                            resolution_line(report)) if line],
        "",
        "| model | val acc | test acc | note |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {val:.4f} | {test:.4f} | {note} |" for name, val, test, note in table_rows(report)]
    if report.get("missing"):
        lines += ["", f"Missing or unfinished ingredients: {', '.join(report['missing'])}"]
    if report.get("skipped"):
        lines += ["", "Skipped by `--skip-bad`:", ""]
        lines += [f"- {name}: {why}" for name, why in report["skipped"].items()]
    if report.get("trunk"):
        trunk = report["trunk"]
        lines += ["", f"Trunk: view {trunk['view']['kind']}, {trunk['epochs_run']} epochs (kept {trunk['keep']}, "
                  f"best epoch {trunk['best_epoch']}), {trunk['train_seconds']:.1f} s, peak RSS "
                  f"{trunk['peak_rss_mb']:.0f} MB in its worker."]
    lines += soup_comparison(report)
    if report.get("basin"):
        lines += basin_section(report["basin"])
    lines += ["", "## Views", "", "| ingredient | nodes | train nodes | label histogram | kept weights |",
              "|---|---|---|---|---|"]
    keeps = {row["name"]: row for row in report.get("keeps", [])}
    for row, view in zip(report["ingredients"], report["views"]):
        histogram = view.get("label_histogram", [])
        keep = keeps.get(row["name"], {})
        lines.append(f"| {row['name']} | {view.get('nodes', '')} | {view.get('train_nodes', '')} | "
                     f"{' '.join(str(c) for c in histogram)} | {keep.get('keep', '')} |")
    lines += [f"- {row['name']}: {row['reason']}" for row in report.get("keeps", []) if row["reason"]]
    if report.get("partition"):
        lines += ["", f"Partition: {partition_text(report['partition'])}."]
    return "\n".join(lines) + "\n"


def soup_comparison(report: dict[str, Any]) -> list[str]:
    """Markdown: every soup's test accuracy beside the mean and best-validation ingredient, the trunk and
    the logit ensemble (what a soup has to beat to be worth making)."""
    references = {ref["name"]: ref["test_acc"] for ref in report["references"]}
    trunk = references.get("trunk")
    lines = ["", "## Soups beside their ingredients (test accuracy)", "",
             "| soup | test | mean ingredient | best ingredient | trunk | ensemble |", "|---|---|---|---|---|---|"]
    for soup in report["soups"]:
        lines.append(f"| {soup['name']} | {soup['test_acc']:.4f} | {report['mean_ingredient']['test_acc']:.4f} | "
                     f"{report['best_ingredient']['test_acc']:.4f} | "
                     f"{'-' if trunk is None else format(trunk, '.4f')} | {references['ensemble']:.4f} |")
    return lines


def basin_line(basin: dict[str, Any]) -> str:
    """One line: whether every interpolation step stays within 1 point of its chord (one basin)."""
    if not basin["steps"]:
        return "basin: no interpolation steps (one candidate, or no gis soup)"
    worst = max(basin["steps"], key=lambda step: step["barrier"])
    on_test = ("" if basin.get("max_test_barrier") is None
               else f"; on the test nodes, along the same path, the largest is {basin['max_test_barrier']:.1f}")
    if worst["barrier"] > BASIN_POINTS:
        on_test = on_test or "; ladle.soup --test-barrier measures the same path on the test nodes"
        return (f"ingredients are not in one basin: the validation curve toward {worst['ingredient']} sags "
                f"{worst['barrier']:.1f} points below its chord (barrier > {BASIN_POINTS:g} point{on_test})")
    return (f"one basin: every interpolation step's barrier is <= {BASIN_POINTS:g} point "
            f"(largest {worst['barrier']:.1f}{on_test})")


def basin_section(basin: dict[str, Any]) -> list[str]:
    """Markdown: the barrier of every greedy-interpolation step and each ingredient's distances."""
    start, on_test = basin["start"], basin.get("max_test_barrier") is not None
    lines = ["", "## Basin", "", basin_line(basin) + ".", "",
             f"Barrier: how far validation accuracy (points) sags below the straight line between the soup so far "
             f"and the next ingredient ({basin['soup']})" + (", and test accuracy at the same alphas" if on_test else "")
             + ".", "",
             "| step | ingredient | alpha | barrier |" + (" test barrier |" if on_test else ""),
             "|---|---|---|---|" + ("---|" if on_test else "")]
    lines += [f"| {i} | {step['ingredient']} | {step['alpha']:.2f} | {step['barrier']:.2f} |"
              + (f" {step['test_barrier']:.2f} |" if on_test else "") for i, step in enumerate(basin["steps"], start=1)]
    lines += ["", f"| ingredient | distance from {start} | distance from {basin['soup']} |", "|---|---|---|"]
    lines += [f"| {row['name']} | {row[f'from_{start}']:.3f} | {row['from_soup']:.3f} |" for row in basin["distances"]]
    return lines


def write_report(run_dir: Path, report: dict[str, Any]) -> list[Path]:
    """Write the report as JSON and Markdown and, when matplotlib is installed, the PNG plots."""
    files = RunDir(run_dir)
    write_json(files.report_json, report)
    with atomic_open(files.report_md, "w") as stream:
        stream.write(format_markdown(report))
    return plot_report(run_dir, report)


def plot_report(run_dir: Path, report: dict[str, Any]) -> list[Path]:
    """Test accuracy of ingredients vs soups vs references, and validation accuracy against alpha (gis)."""
    try:
        from matplotlib.figure import (
            Figure,  # no pyplot: leaves a notebook's plotting backend alone
        )
    except ImportError:
        log.info("matplotlib not installed: no plots (pip install 'ladle[plots]')")
        return []
    written = []
    names, tests, colours = [], [], []
    for name, _val, test, _note in table_rows(report):
        names.append(name)
        tests.append(test)
        colours.append("tab:blue" if name.startswith("ingredient") else
                       "tab:green" if name.startswith("soup") else "tab:gray")
    figure = Figure(figsize=(max(6, 0.45 * len(names)), 4))
    axis = figure.subplots()
    axis.bar(range(len(names)), tests, color=colours)
    axis.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    low = min(tests)
    axis.set_ylim(max(0.0, low - 0.05), min(1.0, max(tests) + 0.02))
    axis.set_ylabel("test accuracy")
    axis.set_title(f"{report['dataset']} / {report['model']} / {report['view']}")
    figure.tight_layout()
    written.append(save_figure(figure, RunDir(run_dir).accuracy_plot))
    gis = [s for s in report["soups"] if s["curves"]]
    if gis:
        figure = Figure(figsize=(6, 4))
        axis = figure.subplots()
        for step, curve in enumerate(gis[0]["curves"], start=2):
            alphas = [point[0] for point in curve]
            accuracy = [point[1] for point in curve]
            axis.plot(alphas, accuracy, marker=".", label=f"step {step}")
        axis.set_xlabel("alpha (weight of the soup so far)")
        axis.set_ylabel("validation accuracy")
        axis.legend(fontsize=7, ncol=2)
        figure.tight_layout()
        written.append(save_figure(figure, RunDir(run_dir).alpha_plot))
    return written


# ---------------------------------------------------------------- varrate: accuracy against bytes
