"""bench/varrate.py's choice of graph and schedules: named benchmark graphs, spec names, rate fraction."""
from __future__ import annotations

from bench.varrate import GRAPHS, parse_run, resolve_graph
from ladle.graph.synthetic import parse_synthetic


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
