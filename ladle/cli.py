"""Console-script entry points (``ladle-train`` ...): each runs a command's ``main`` as ``python -m`` does."""
from __future__ import annotations

from ladle import prepare as _prepare
from ladle.core.errors import run_cli
from ladle.soup import cli as _soup
from ladle.train import cli as _train
from ladle.varrate import cli as _varrate


def train() -> int:
    """``ladle-train``: the arguments of ``python -m ladle.train``."""
    return run_cli(_train.main)


def soup() -> int:
    """``ladle-soup``: the arguments of ``python -m ladle.soup``."""
    return run_cli(_soup.main)


def prepare() -> int:
    """``ladle-prepare``: the arguments of ``python -m ladle.prepare``."""
    return run_cli(_prepare.main)


def varrate() -> int:
    """``ladle-varrate``: the arguments of ``python -m ladle.varrate``."""
    return run_cli(_varrate.main)
