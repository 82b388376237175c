"""bench/varrate.py's choice of graph and schedules: named benchmark graphs, spec names, rate fraction."""
from __future__ import annotations

from bench.varrate import GRAPHS, parse_run, resolve_graph
from ladle.graph.synthetic import parse_synthetic
from ladle.varrate.report import pareto_front, write_bytes_report


def test_named_graph_brings_its_spec_and_partition() -> None:
    spec, partition, name = resolve_graph("csbm", None)
    assert (spec, partition, name) == (GRAPHS["csbm"][0], "random", "csbm")
    options = parse_synthetic(spec)  # a valid synthetic spec: weak features, homophilous neighbourhoods
    assert options["signal"] < 0.1 and options["homophily"] >= 0.9
    assert resolve_graph("CSBM", "metis") == (spec, "metis", "csbm")  # --partition wins


def test_other_datasets_pass_through_with_a_file_safe_name() -> None:
    assert resolve_graph("cora", None) == ("cora", "metis", "cora")
    spec = "synthetic:nodes=1000,classes=2"
    assert resolve_graph(spec, "random") == (spec, "random", "synthetic-nodes-1000-classes-2")


def test_rate_fraction_reaches_ratio_one_early() -> None:
    name, schedule, compressor = parse_run("linear/int8", 64.0, fraction=0.95)
    assert (name, compressor) == ("linear-int8", "int8")
    assert schedule.rate(0, 200) == 64.0
    assert schedule.rate(190, 200) == 1.0 and schedule.rate(199, 200) == 1.0
    assert schedule.rate(189, 200) > 1.0
    _, fixed, _ = parse_run("fixed:16", 64.0, fraction=0.95)
    assert fixed.rate(199, 200) == 16.0


def test_pareto_front_keeps_what_nothing_beats_on_both_axes(tmp_path) -> None:
    entries = [{"name": "full", "bytes": 300, "test_acc": 0.91}, {"name": "none", "bytes": 100, "test_acc": 0.87},
               {"name": "linear", "bytes": 200, "test_acc": 0.86}, {"name": "tail", "bytes": 150, "test_acc": 0.92},
               {"name": "same as tail", "bytes": 150, "test_acc": 0.92}]
    assert pareto_front(entries) == [1, 3, 4]  # linear: fewer bytes and more accuracy elsewhere; full: beaten by tail
    write_bytes_report(tmp_path, "t", entries)
    rows = [line for line in (tmp_path / "report.md").read_text().splitlines() if line.startswith("| ") and "|---" not in line]
    assert [row.split(" | ")[3] for row in rows[1:]] == ["", "yes", "", "yes", "yes"]
