"""ladle: train many GNN ingredients with zero communication, then soup their weights.

The library API behind the command lines::

    from ladle import load_model, load_recipe, predict, soup_run, train_ingredients
    run = train_ingredients(load_recipe("cora-gcn"), ingredients=8)
    report = soup_run(run.run_dir)
    soup = load_model(run.run_dir)  # the report's chosen soup, an nn.Module in eval mode
    logits = predict(run.run_dir)    # its logits for every node of the run's graph

Names are imported on first use, so ``python -m ladle.train`` does not import itself twice.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
_API = {
    "Recipe": "ladle.core.recipe", "load_recipe": "ladle.core.recipe",
    "RunResult": "ladle.train.launch", "train_ingredients": "ladle.train.launch",
    "soup_run": "ladle.soup.pipeline", "load_model": "ladle.nn.saved", "predict": "ladle.nn.saved",
    "load_dataset": "ladle.graph.datasets",
}
__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'ladle' has no attribute {name!r}")
