"""The variable-rate report: a table and plot of test accuracy against bytes sent."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ladle.core.files import atomic_open
from ladle.core.rundir import RunDir
from ladle.core.storage import save_figure

log = logging.getLogger(__name__)


def report_entry(meta: dict[str, Any]) -> dict[str, Any]:
    """A run's entry of :func:`write_bytes_report`: its figures and its (bytes, best-so-far test acc) curve."""
    schedule = meta["schedule"]
    name = schedule["kind"]
    if name == "fixed":
        name = f"fixed r={schedule['rate_max']:g}"
    extras = [] if name in ("full", "none") else [meta["compressor"]]
    if meta.get("error_feedback"):
        extras.append("error feedback")
    if meta.get("select", 1.0) < 1:
        extras.append(f"select {meta['select']:g}")
    if schedule.get("tail"):
        extras.append(f"exact last {schedule['tail']}")
    if meta.get("gradients", "float32") != "float32":
        extras.append(f"{meta['gradients']} gradients")
    if not meta.get("cache_inputs", False):
        extras.append("inputs exchanged every step")
    if extras:
        name += f" ({', '.join(extras)})"
    seconds = meta["seconds_per_epoch"]
    halo, halo_curve = 0, []
    for row in meta["history"]:
        halo += row["forward_halo"] + row["backward_halo"]
        halo_curve.append((halo, row["best_test_acc"]))
    sent = meta["bytes"]
    return {"name": name, "test_acc": meta["test_acc"], "bytes": sent["total"], "halo_bytes": halo,
            "allreduce_bytes": sent["allreduce"], "eval_bytes": sent["eval_halo"],
            "other_bytes": sent["metrics"] + sent["setup"], "step_seconds": seconds["step"],
            "eval_seconds": seconds["eval"], "epochs": meta["epochs_run"],
            "note": f"evaluated every {meta['eval_every']} epochs ({meta['evaluations']} times)",
            "curve": [(row["total_bytes"], row["best_test_acc"]) for row in meta["history"]],
            "halo_curve": halo_curve}


def pareto_front(entries: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of the entries no other entry beats on both axes (as many or fewer bytes and as high or higher test
    accuracy, one of them strictly), by bytes."""
    def dominated(i: int) -> bool:
        a = entries[i]
        return any(b["bytes"] <= a["bytes"] and b["test_acc"] >= a["test_acc"]
                   and (b["bytes"], b["test_acc"]) != (a["bytes"], a["test_acc"]) for b in entries)

    return sorted((i for i in range(len(entries)) if not dominated(i)), key=lambda i: entries[i]["bytes"])


def write_bytes_report(out_dir: Path, title: str, entries: Sequence[dict[str, Any]]) -> list[Path]:
    """A Markdown table and (when matplotlib is importable) a plot in ``out_dir``: test accuracy
    against the cumulative bytes sent while training (left) and against the halo bytes alone (right),
    one curve per entry, or a star for an entry without a curve (the soup); the final points' Pareto front
    (:func:`pareto_front`) is a dashed line on the left and a column of the table.

    Entries: ``name``, ``test_acc``, ``bytes`` (everything sent), and optionally its parts ``halo_bytes``,
    ``allreduce_bytes``, ``eval_bytes``, ``other_bytes``, ``step_seconds`` (per epoch) and ``eval_seconds``
    (per evaluation), ``epochs``, ``curve`` and ``halo_curve`` (lists of
    ``(cumulative bytes, best-validation test accuracy so far)``) and ``note``.
    """
    def cell(entry: dict[str, Any], key: str, fmt: str) -> str:
        return format(entry[key], fmt) if entry.get(key) is not None else "-"

    lines = [f"# {title}", "", "Test accuracy at the best-validation evaluation against every byte sent, summed "
             "over ranks: total = training halo (forward + backward) + gradient all-reduce + evaluation halo + "
             "other (metric reductions, setup); collectives counted as ring algorithms send them.", "",
             "| run | test acc | total bytes | Pareto front | halo bytes | all-reduce bytes | eval bytes | other bytes "
             "| step s/epoch | eval s/evaluation | epochs | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    front = pareto_front(entries)
    for i, entry in enumerate(entries):
        lines.append(f"| {entry['name']} | {entry['test_acc']:.4f} | {entry['bytes']:,} | {'yes' if i in front else ''} | "
                     f"{cell(entry, 'halo_bytes', ',')} | {cell(entry, 'allreduce_bytes', ',')} | "
                     f"{cell(entry, 'eval_bytes', ',')} | {cell(entry, 'other_bytes', ',')} | "
                     f"{cell(entry, 'step_seconds', '.3f')} | {cell(entry, 'eval_seconds', '.3f')} | "
                     f"{cell(entry, 'epochs', 'd')} | "
                     f"{entry.get('note', '')} |")
    files = RunDir(out_dir)
    files.path.mkdir(parents=True, exist_ok=True)
    with atomic_open(files.report_md, "w") as stream:
        stream.write("\n".join(lines) + "\n")
    written = [files.report_md]
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
    except ImportError:
        log.info("matplotlib not installed: no plot (pip install 'ladle[plots]')")
        return written
    figure = Figure(figsize=(12, 4.5))
    total_axis, halo_axis = figure.subplots(1, 2, sharey=True)
    colours = colormaps["tab20" if len(entries) > 10 else "tab10"]
    for i, entry in enumerate(entries):
        colour = colours(i % colours.N)
        for axis, key, final in ((total_axis, "curve", entry["bytes"]),
                                 (halo_axis, "halo_curve", entry.get("halo_bytes", 0))):
            curve = [(b, acc) for b, acc in entry.get(key, []) if b > 0]
            if curve:
                axis.plot([b for b, _ in curve], [acc for _, acc in curve], color=colour, lw=1.2, label=entry["name"])
                axis.plot([final], [entry["test_acc"]], "o", color=colour)
            elif axis is total_axis:  # a run that sent nothing on this axis cannot sit on a log scale
                axis.plot([max(1, final)], [entry["test_acc"]], "*", ms=12, color=colour, label=entry["name"])
    if len(front) > 1:
        total_axis.plot([max(1, entries[i]["bytes"]) for i in front], [entries[i]["test_acc"] for i in front], "--",
                        color="black", lw=1, drawstyle="steps-post", label="Pareto front (final points)")
    total_axis.set_xlabel("cumulative bytes sent (everything)")
    halo_axis.set_xlabel("cumulative halo bytes (forward + backward)")
    total_axis.set_ylabel("test accuracy (best validation so far)")
    for axis in (total_axis, halo_axis):
        axis.set_xscale("log")
    total_axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    return written + [save_figure(figure, files.bytes_plot)]
