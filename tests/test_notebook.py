"""notebooks/explore.ipynb runs top to bottom, as Jupyter would run it, and is committed without outputs."""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import nbformat
import pytest
from conftest import PROJECT, run_module
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

NOTEBOOK = PROJECT / "notebooks" / "explore.ipynb"
KERNEL = "ladle-test"
FIGURES = ("curves", "views", "partitions", "alpha-gis", "comparison")


def execute(kernels: Path, data_root: Path, **settings: str) -> nbformat.NotebookNode:
    """Run the notebook from ``notebooks/`` in a kernel of this interpreter, on ``data_root``; ``settings``
    become ``LADLE_NB_<NAME>`` variables (any others from the environment are dropped)."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    env = {key: value for key, value in os.environ.items() if not key.startswith("LADLE_NB_")}
    env["LADLE_DATA"] = str(data_root)
    env |= {f"LADLE_NB_{name.upper()}": value for name, value in settings.items()}
    manager = AsyncKernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
    client = NotebookClient(notebook, km=manager, timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute(env=env)
    return notebook


def printed(notebook: nbformat.NotebookNode) -> str:
    """Everything the notebook's cells printed."""
    return "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for output in cell.outputs)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private kernel spec that runs this interpreter (nothing registered globally)."""
    folder = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(folder / KERNEL)
    return folder


@pytest.fixture(scope="module")
def trained(data_root: Path, kernels: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The notebook run in its default mode, shrunk: train 3 ingredients of a trunkless recipe for 30 epochs, then
    soup and plot."""
    out = tmp_path_factory.mktemp("notebook")
    notebook = execute(kernels, data_root, recipe="cora-gcn", ingredients="3", epochs="30",
                       checkpoints=str(out / "checkpoints"), figures=str(out / "figures"))
    return out, printed(notebook)


def test_notebook_trains_soups_and_saves_its_figures(trained: tuple[Path, str]) -> None:
    out, text = trained
    runs = [path for path in (out / "checkpoints").iterdir() if path.name not in ("latest", "my-gnn")]
    assert len(runs) == 1 and (runs[0] / "report.json").is_file()
    assert len(list(runs[0].glob("ingredient-*.safetensors"))) == 3
    for name in FIGURES:
        figure = out / "figures" / f"{name}.png"
        assert figure.is_file() and figure.stat().st_size > 0, name
    assert not (out / "figures" / "accuracy-bytes.png").exists()
    assert "soup-gis" in text
    assert "no variable-rate" in text  # the varrate section says how to get a result, and skips
    # your own GNN (notebooks/my_gnn.py): a second run, souped, its chosen soup loaded back as that class
    assert len([path for path in (out / "checkpoints" / "my-gnn").iterdir() if path.name != "latest"]) == 1
    own = re.search(r"loaded MeanGNN, soup-\w+: test accuracy (0\.\d{4}), the report's (0\.\d{4})", text)
    assert own is not None and own[1] == own[2] and float(own[1]) > 0.7, text[-800:]
    assert (out / "figures" / "your-model.png").stat().st_size > 0


@pytest.mark.skipif(importlib.util.find_spec("ladle.varrate") is None, reason="no variable-rate mode")
def test_notebook_loads_an_existing_run_and_plots_accuracy_against_bytes(
        trained: tuple[Path, str], data_root: Path, kernels: Path, tmp_path: Path) -> None:
    out, _ = trained
    varrate = run_module("ladle.varrate", "--ranks", "2", "--run-dir", str(tmp_path / "varrate" / "linear"),
                         "--data-root", str(data_root), "epochs=10")
    assert varrate.returncode == 0, varrate.stderr
    notebook = execute(kernels, data_root, run_dir=str(out / "checkpoints" / "latest"),
                       checkpoints=str(tmp_path / "unused"), figures=str(tmp_path / "figures"),
                       varrate_dir=str(tmp_path / "varrate"))
    assert "loading the run" in printed(notebook)
    assert not (tmp_path / "unused").exists()  # nothing trained
    for name in (*FIGURES, "accuracy-bytes"):
        figure = tmp_path / "figures" / f"{name}.png"
        assert figure.is_file() and figure.stat().st_size > 0, name


def test_committed_notebook_has_no_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]
