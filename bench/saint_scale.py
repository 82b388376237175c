"""How far a GraphSAINT random-walk batch's GCN aggregation is from the whole graph's, per graph.

ladle's saint views normalise a batch with its own degrees (an average over the neighbours it holds) and
then weight each edge by GraphSAINT's C_v / C_uv, about 1 / p for p the share of a node's neighbours a batch
holds (bench/RESULTS.md, *The random-walk view on dense graphs*): a node's aggregation in a batch is then
about 1 / p times its whole-graph value, so it grows with the degree. For each graph this prints the mean,
over a batch's nodes, of (row sum of the batch's normalised, weighted adjacency) / (row sum of the whole
graph's), for the first batches of ingredient 0 of 8, with the default recipe's view (``key=value`` overrides it,
e.g. ``view.subgraph_share=0.25``).
Not a test: run it by hand, e.g.

    python bench/saint_scale.py cora citeseer physics amherst41
"""
from __future__ import annotations

import argparse
import json

import torch
from torch import Tensor

from ladle.core.recipe import load_recipe
from ladle.graph.datasets import load_dataset
from ladle.graph.inputs import adjacency
from ladle.graph.views import build_view


def row_sums(edge_index: Tensor, num_nodes: int, edge_weight: Tensor | None = None) -> Tensor:
    """Each row's sum of the GCN adjacency the model aggregates with (self-loops included)."""
    return (adjacency(edge_index, num_nodes, "gcn", edge_weight).csr @ torch.ones(num_nodes, 1)).view(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", metavar="DATASET or key=value")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    config = load_recipe(None, [name for name in args.names if "=" in name]).view
    results = {}
    for name in (name for name in args.names if "=" not in name):
        data = load_dataset(name, args.data_root)
        view = build_view(data, config, 0, 8, 0)
        whole = row_sums(data.edge_index, data.num_nodes)
        ratios = [(row_sums(batch.edge_index, batch.num_nodes, batch.edge_weight) / whole[batch.n_id]).mean().item()
                  for _, batch in zip(range(args.batches), view.batches(0))]
        edges_per_node = data.num_edges / data.num_nodes
        results[name] = {"edges_per_node": edges_per_node, "batch_over_whole": ratios}
        print(f"{name}: {edges_per_node:.1f} edges a node, batch / whole-graph aggregation "
              f"{sum(ratios) / len(ratios):.2f}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
