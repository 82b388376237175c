"""METIS on a budget: the edges cut when METIS sees only a sample of a graph's edges, with and without the
refinement on the whole graph that ``ladle.graph.partition`` applies to a sample's parts.

For each cap (``METIS_MAX_EDGES`` = 2^c adjacency entries) and each kind of partition (plain METIS into K
parts; label-balanced: METIS into 16 K clusters grouped into K parts, what the *-metis recipes use), the
fraction of the graph's edges cut, the largest part over an equal share, and the seconds. One process, one
thread, the graph held once:

    python bench/metis_budget.py                                   # 1M nodes (see FIRST_PRODUCTS), caps 2^25..2^21
    python bench/metis_budget.py --dataset physics --caps 21 19 17

Writes ``bench/results/metis-budget.json``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from ladle.graph import partition
from ladle.graph.datasets import load_dataset
from ladle.graph.partition import (
    InEdges,
    cut_edges,
    label_balanced_partition,
    metis_partition,
)

RESULTS = Path(__file__).resolve().parent / "results"
REFINE = partition.refine_partition  # the shipped refinement, switched off and on row by row


def measure(adj: InEdges, labels: torch.Tensor, kind: str, parts: int, cap: int, refine: bool) -> dict[str, Any]:
    """One partition of ``adj`` with METIS capped at 2^``cap`` entries, refined or not."""
    partition.METIS_MAX_EDGES = 1 << cap
    partition.refine_partition = REFINE if refine else (lambda adj, given, num_parts: given)
    start = time.perf_counter()
    if kind == "labels":
        result = label_balanced_partition(adj, parts, 0, labels)
    else:
        result = metis_partition(adj, parts, 0)
    seconds = time.perf_counter() - start
    sizes = torch.bincount(result, minlength=parts)
    return {"kind": kind, "cap_log2": cap, "refined": refine, "sampled": adj.src.numel() > 1 << cap,
            "kept_fraction": min(1.0, (1 << cap) / adj.src.numel()),
            "cut_fraction": int(cut_edges(adj, result, parts).sum()) / 2 / adj.src.numel(),
            "largest_part_over_share": float(sizes.max()) * parts / adj.num_nodes, "seconds": seconds}


# synthetic-products as first named (one class a community), the graph bench/results/metis-budget.json measured
FIRST_PRODUCTS = ("synthetic:nodes=1000000,degree=26,features=100,classes=47,homophily=0.8,signal=0.15,"
                  "communities=2000,locality=0.8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=FIRST_PRODUCTS)
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--parts", "-k", type=int, default=8)
    parser.add_argument("--caps", type=int, nargs="+", default=[25, 24, 23, 22, 21])
    parser.add_argument("--json", type=Path, default=RESULTS / "metis-budget.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_dataset(args.dataset, args.data_root)
    adj = InEdges(data.edge_index, data.num_nodes)
    labels = torch.where(data.train_mask, data.y, -1)
    del data
    rows = []
    for cap in args.caps:
        for kind in ("metis", "labels"):
            for refine in (False, True) if adj.src.numel() > 1 << cap else (False,):
                row = measure(adj, labels, kind, args.parts, cap, refine)
                print(f"{kind:>7} cap 2^{cap} ({row['kept_fraction']:.0%} kept) refined={refine!s:<5} "
                      f"cut {row['cut_fraction']:.4f}  largest {row['largest_part_over_share']:.3f}  "
                      f"{row['seconds']:.1f} s", flush=True)
                rows.append(row)
    record = {"dataset": args.dataset, "nodes": adj.num_nodes, "entries": adj.src.numel(), "parts": args.parts,
              "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
