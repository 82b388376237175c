"""A graph given in memory instead of a named dataset: checked, set up as ladle sets up its datasets, and
identified by a digest of its arrays (what a run records of it, as it records a dataset's files)."""
from __future__ import annotations

import hashlib

from torch_geometric.data import Data

from ladle.core.errors import LadleError
from ladle.graph.datasets import DATASET_FORMAT, finish_graph

_USER_KEYS = ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask")


def user_graph(data: Data, features: str = "auto") -> Data:
    """A user's PyG graph (``x``, ``y``, ``edge_index``, ``train_mask``/``val_mask``/``test_mask``) checked and
    set up as ladle sets up a named dataset (float features, row-normalised when ``features`` is ``normalize``,
    ``num_classes`` set), in a new ``Data``: the user's object is left as it was."""
    missing = [key for key in _USER_KEYS if data.get(key) is None]
    if missing:
        raise LadleError(f"the graph given has no {', '.join(missing)} (ladle needs {', '.join(_USER_KEYS)})")
    nodes = int(data.x.size(0)) if data.x.dim() == 2 else -1
    edge_index = data.edge_index
    problems = ["x must be 2-D (nodes x features)"] if nodes < 0 else []
    problems += [f"{key} must hold one entry per node ({nodes})" for key in _USER_KEYS[1:2] + _USER_KEYS[3:]
                 if nodes >= 0 and data[key].numel() != nodes]
    if edge_index.dim() != 2 or edge_index.size(0) != 2 or edge_index.is_floating_point():
        problems.append("edge_index must be integers of shape [2, edges]")
    elif edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= max(nodes, 0)):
        problems.append(f"edge_index must name nodes 0..{nodes - 1}")
    if problems:
        raise LadleError(f"the graph given does not fit: {'; '.join(problems)}")
    graph = Data(x=data.x, y=data.y, edge_index=edge_index.long(), num_nodes=nodes,
                 **{mask: data[mask].bool().view(-1) for mask in _USER_KEYS[3:]})
    graph.name = "user"
    return finish_graph(graph, features == "normalize")


def graph_identity(data: Data) -> str:
    """A digest of a graph given in memory (its arrays, their dtypes and shapes): the identity a run records of
    its data, as :func:`~ladle.graph.datasets.dataset_identity` is for a dataset's files."""
    digest = hashlib.sha256(f"ladle-graph {DATASET_FORMAT}\n".encode())
    for key in _USER_KEYS:
        array = data[key].contiguous().numpy()
        digest.update(f"{key}:{array.dtype}:{list(array.shape)}\n".encode())
        digest.update(memoryview(array).cast("B"))
    return f"graph-{digest.hexdigest()[:16]}"
