"""Console-script entry points (``ladle-train`` ...): each runs a command's ``main`` as ``python -m`` does, importing
that command alone (so ``ladle-train --help`` needs no torch, as ``python -m ladle.train --help`` does not)."""
from __future__ import annotations

from ladle.core.errors import run_cli


def train() -> int:
    """``ladle-train``: the arguments of ``python -m ladle.train``."""
    from ladle.train.cli import main
    return run_cli(main)


def soup() -> int:
    """``ladle-soup``: the arguments of ``python -m ladle.soup``."""
    from ladle.soup.cli import main
    return run_cli(main)


def prepare() -> int:
    """``ladle-prepare``: the arguments of ``python -m ladle.prepare``."""
    from ladle.prepare import main
    return run_cli(main)


def varrate() -> int:
    """``ladle-varrate``: the arguments of ``python -m ladle.varrate``."""
    from ladle.varrate.cli import main
    return run_cli(main)
