"""Shared fixtures: a writable copy of the read-only shared datasets, and Cora."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

SHARED_DATASETS = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The shared dataset folder (read-only); ladle stages what it needs into its own cache."""
    root = Path(os.environ.get("LADLE_DATA", SHARED_DATASETS))
    if not (root / "Cora").is_dir():
        pytest.skip(f"datasets not found under {root}")
    return root


@pytest.fixture(scope="session")
def cora(data_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """Cora with its public split, loaded by PyG from a writable copy."""
    from torch_geometric.datasets import Planetoid

    root = tmp_path_factory.mktemp("planetoid")
    shutil.copytree(data_root / "Cora", root / "Cora")
    return Planetoid(str(root), "Cora")[0]
