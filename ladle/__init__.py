"""ladle: train many GNN ingredients with zero communication, then soup their weights."""
from __future__ import annotations

__version__ = "0.1.0"
