"""``python -m ladle.train`` flags end to end: ``--seed``, ``--independent-init`` / shared init, and
``--average-every`` with the soup's ``averaged`` reference."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS
from torch_geometric.data import Data

from ladle.core.errors import LadleError
from ladle.core.recipe import load_recipe
from ladle.core.storage import StateDict, load_state
from ladle.core.weights import distance
from ladle.nn.models import build_model
from ladle.soup.cli import main as soup_main
from ladle.soup.pipeline import soup_run
from ladle.train.cli import main as train_main

SHORT = ["-k", "2", "--workers", "1", *TRUNKLESS, "view.kind=cluster", "epochs=3"]
SAVED = ("init", "ingredient-00", "ingredient-01")


def _distance(a: StateDict, b: StateDict) -> float:
    """Largest absolute difference between two state dicts' floating-point entries."""
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point())


@pytest.fixture(scope="module")
def seeded_runs(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three short ClusterGCN runs from the command line: ``--seed 3`` twice, ``--seed 4`` once."""
    root = tmp_path_factory.mktemp("seeds")
    runs = {}
    for name, seed in (("first", 3), ("again", 3), ("other", 4)):
        runs[name] = root / name
        assert train_main([*SHORT, "--seed", str(seed), "--data-root", str(data_root), "--run-dir", str(runs[name])]) == 0
    return runs


def test_seed_from_the_cli_decides_every_weight(seeded_runs: dict[str, Path]) -> None:
    """Same ``--seed``: bitwise the same init and ingredients; another seed: other weights everywhere."""
    for name in SAVED:
        first, again, other = (load_state(seeded_runs[run] / f"{name}.safetensors")
                               for run in ("first", "again", "other"))
        assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first), name
        floats = [k for k in first if first[k].is_floating_point() and first[k].abs().sum() > 0]
        assert floats and all(not torch.equal(first[k], other[k]) for k in floats), name
    for run, seed in (("first", 3), ("other", 4)):
        assert json.loads((seeded_runs[run] / "run.json").read_text())["recipe"]["seed"] == seed
        for k in range(2):  # README: ingredient k uses S * 1000 + k + 1
            assert json.loads((seeded_runs[run] / f"ingredient-{k:02d}.json").read_text())["seed"] == seed * 1000 + k + 1
    ingredients = [load_state(seeded_runs["first"] / f"ingredient-{k:02d}.safetensors") for k in range(2)]
    assert _distance(*ingredients) > 0  # same init, other batches and dropout


def test_independent_init_draws_each_ingredient_from_its_own_seed(data_root: Path, cora_data: Data,
                                                                  tmp_path: Path) -> None:
    """With a learning rate too small to move a weight by 1e-4, every ingredient still sits on its own
    initial draw (seeded S * 1000 + k + 1), far from the shared init and from the others."""
    overrides = ["view.kind=full", "epochs=2", "lr=1e-6"]
    run = tmp_path / "run"
    assert train_main(["-k", "3", "--workers", "1", *TRUNKLESS, "--independent-init", "--seed", "2", "--data-root",
                       str(data_root), "--run-dir", str(run), *overrides]) == 0
    recipe = load_recipe(None, [*TRUNKLESS, *overrides, "seed=2"])
    shared = load_state(run / "init.safetensors")
    weights = [load_state(run / f"ingredient-{k:02d}.safetensors") for k in range(3)]
    for k, state in enumerate(weights):
        assert json.loads((run / f"ingredient-{k:02d}.json").read_text())["init"] == "independent"
        torch.manual_seed(2 * 1000 + k + 1)
        drawn = build_model(recipe, cora_data.num_features, cora_data.num_classes).state_dict()
        assert _distance(state, drawn) < 1e-4 < 0.01 < _distance(state, shared), k
    assert min(_distance(weights[i], weights[j]) for i in range(3) for j in range(i + 1, 3)) > 0.01
    assert json.loads((run / "run.json").read_text())["init"] == "independent"
    # the soup report's distance from init is each ingredient's from its own draw, not from init.safetensors
    basin = soup_run(run, method="uniform", data_root=data_root, write=False)["basin"]
    assert basin["start"] == "init" and all(row["from_init"] < 0.01 for row in basin["distances"])
    assert all(distance(state, shared) > 1 for state in weights)


def test_average_every_refuses_a_users_folder_and_bad_counts_before_making_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A folder of a user's files is refused, nothing in it replaced; a refused count leaves no run directory; flags
    it does not use are refused, and a recipe's trunk it does not train is said."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "metrics.csv").write_text("my,own,data\n1,2,3\n")
    with pytest.raises(LadleError, match="holds files but no ladle run .metrics.csv.: choose a new or empty"):
        train_main(["--average-every", "2", "-k", "2", "--run-dir", str(folder)])
    assert [p.name for p in folder.iterdir()] == ["metrics.csv"] and "my,own" in (folder / "metrics.csv").read_text()
    assert "--average-every trains no trunk and reads no branch.* key" in caplog.text  # the default recipe has one
    for flags, message in ((["--average-every", "0"], "--average-every must be >= 1 epoch, got 0"),
                           (["--average-every", "2", "-k", "0"], "--ingredients must be >= 1, got 0"),
                           (["--average-every", "2", "--device", "cuda", "--baseline", "--save-every", "1"],
                            "on the CPU, and saves at the end: drop --device, --baseline, --save-every$")):
        with pytest.raises(LadleError, match=message):
            train_main([*flags, "--run-dir", str(tmp_path / "new")])
        assert not (tmp_path / "new").exists()


@pytest.mark.usefixtures("one_thread")
def test_average_every_from_the_cli_is_a_soup_reference(seeded_runs: dict[str, Path], data_root: Path,
                                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--average-every 3`` averages two random-partition trainers after epochs 3, 6, 9 and the last, counts
    the bytes of a ring all-reduce, and the soup of the ingredient run reports the averaged model's scores."""
    run = tmp_path / "run"
    shutil.copytree(seeded_runs["first"], run)
    assert train_main(["--average-every", "3", "-k", "2", *TRUNKLESS, "--seed", "3", "view.kind=random", "epochs=10",
                       "--data-root", str(data_root), "--run-dir", str(run)]) == 0
    assert "averaged every 3 epochs, K=2" in capsys.readouterr().out
    meta = json.loads((run / "averaged.json").read_text())
    assert (meta["average_every"], meta["ingredients"], meta["recipe"]["view"]["kind"]) == (3, 2, "random")
    assert [row["epoch"] for row in meta["history"]] == [2, 5, 8, 9] and meta["averages"] == 4
    assert meta["bytes"] == 4 * 2 * (2 - 1) * meta["model_bytes"] > 0
    assert meta["test_acc"] > 0.5
    assert soup_main(["--run-dir", str(run), "--data-root", str(data_root), "--method", "uniform"]) == 0
    report = json.loads((run / "report.json").read_text())
    references = {ref["name"]: ref for ref in report["references"]}
    assert set(references) == {"ensemble", "averaged"}
    assert report["versions"]["soup"]["torch"] == report["versions"]["run"]["torch"] == torch.__version__
    assert references["averaged"]["val_acc"] == pytest.approx(meta["val_acc"], abs=1 / 500)  # one node at most
    assert references["averaged"]["test_acc"] == pytest.approx(meta["test_acc"], abs=1 / 1000)
    assert "averaged (ref)" in (run / "report.md").read_text()
