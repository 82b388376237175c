"""Your own PyG graph through train and soup: prepared into shards exactly as a named dataset is (the same
weights, bit for bit), recorded by its identity, asked for again by the soup, refused in one line when a
part is missing."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS

import ladle
from ladle.core.errors import LadleError
from ladle.core.files import read_json
from ladle.core.recipe import load_recipe
from ladle.core.storage import load_state

RANDOM = [*TRUNKLESS, "view.kind=random", "epochs=3"]


@pytest.fixture(scope="module")
def runs(data_root: Path, cora_data, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same recipe trained on Cora named from the data root, and on Cora given in memory."""
    root = tmp_path_factory.mktemp("your-data")
    named = ladle.train_ingredients(load_recipe(None, RANDOM), ingredients=2, workers=1, data_root=data_root,
                                    run_dir=root / "named").run_dir
    given = ladle.train_ingredients(load_recipe(None, [*RANDOM, "dataset=my-graph"]), ingredients=2, workers=1,
                                    data=cora_data, run_dir=root / "given").run_dir
    return named, given


def test_a_graph_given_in_memory_trains_as_the_named_dataset(runs: tuple[Path, Path], cora_data) -> None:
    named, given = runs
    for name in ("ingredient-00", "ingredient-01"):
        ours, theirs = load_state(given / f"{name}.safetensors"), load_state(named / f"{name}.safetensors")
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name
    record = read_json(given / "run.json")["data"]
    assert record["root"] == "a graph given in memory" and record["identity"].startswith("graph-")
    report = ladle.soup_run(given, method="uniform", data=cora_data)
    (row,) = report["soups"]
    logits = ladle.predict(given, cora_data)
    test = cora_data.test_mask
    assert float((logits.argmax(1)[test] == cora_data.y[test]).float().mean()) == pytest.approx(row["test_acc"])


def test_the_soup_asks_for_the_graph_again_and_refuses_another(runs: tuple[Path, Path], cora_data) -> None:
    _, given = runs
    with pytest.raises(LadleError, match="was trained on a graph given in memory .*: give it again"):
        ladle.soup_run(given, method="uniform", write=False)
    other = cora_data.clone()
    other.y = other.y.roll(1)
    with pytest.raises(LadleError, match="was trained on a graph given in memory .*, not on a graph given in memory"):
        ladle.soup_run(given, method="uniform", data=other, write=False)


def test_a_graph_missing_a_part_is_refused_in_one_line(cora_data, tmp_path: Path) -> None:
    partial = cora_data.clone()
    del partial.val_mask
    with pytest.raises(LadleError, match=r"^the graph given has no val_mask \(ladle needs x, y, edge_index, "
                                         r"train_mask, val_mask, test_mask\)$"):
        ladle.train_ingredients(load_recipe(None, RANDOM), ingredients=2, data=partial, run_dir=tmp_path / "run")
    broken = cora_data.clone()
    broken.edge_index = broken.edge_index + cora_data.num_nodes
    with pytest.raises(LadleError, match="edge_index must name nodes 0..2707"):
        ladle.train_ingredients(load_recipe(None, RANDOM), ingredients=2, data=broken, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
