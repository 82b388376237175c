"""ladle: train many GNN ingredients with zero communication, then soup their weights.

The library API behind the command lines::

    from ladle import load_recipe, train_ingredients, soup_run
    run = train_ingredients(load_recipe("cora-gcn"), ingredients=8)
    report = soup_run(run.run_dir)

Names are imported on first use, so ``python -m ladle.train`` does not import itself twice.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
_API = {
    "Recipe": "ladle.core.recipe", "load_recipe": "ladle.core.recipe",
    "RunResult": "ladle.train.launch", "train_ingredients": "ladle.train.launch",
    "soup_run": "ladle.soup.pipeline",
}
__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'ladle' has no attribute {name!r}")
