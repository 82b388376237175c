"""Recipes: the default, the shipped files, overrides, and errors that name the key."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TRUNKLESS

from ladle.core.errors import LadleError
from ladle.core.recipe import (
    BranchConfig,
    Recipe,
    TrunkConfig,
    load_recipe,
)
from ladle.core.recipe_files import recipe_dirs


def test_default_recipe_file_is_the_embedded_default_with_a_trunk() -> None:
    recipe = load_recipe("default")
    assert recipe.trunk == TrunkConfig() and recipe.trunk.epochs > 0 and recipe.trunk_view().kind == "saint-rw"
    assert recipe.branch == BranchConfig() and recipe == Recipe() == load_recipe(None)


def test_metis_recipes_differ_only_in_the_dataset() -> None:
    recipes = [load_recipe(f"{dataset}-metis").to_dict() for dataset in ("cora", "citeseer", "physics")]
    for recipe in recipes:
        assert recipe["view"]["kind"] == "metis" and recipe["trunk"]["epochs"] > 0
        recipe.pop("name"), recipe.pop("dataset")
    assert recipes[0] == recipes[1] == recipes[2]


@pytest.mark.parametrize("name", ["cora-gcn", "citeseer-gcn", "physics-gcn", "cora-sage", "cora-gat"])
def test_shipped_recipes_load(name: str) -> None:
    recipe = load_recipe(name)
    assert recipe.name == name
    assert recipe.model in name


def test_every_recipe_in_the_folder_is_valid() -> None:
    files = sorted(recipe_dirs()[1].glob("*.yaml"))
    assert len(files) >= 6
    for path in files:
        load_recipe(str(path))


def test_overrides_reach_nested_keys_and_convert_types() -> None:
    recipe = load_recipe("cora-gcn", ["dataset=citeseer", "view.kind=metis", "epochs=50", "lr=1",
                                      "view.fanout=[5, 3]", "soup.grid=11"])
    assert (recipe.dataset, recipe.view.kind, recipe.epochs, recipe.soup.grid) == ("citeseer", "metis", 50, 11)
    assert recipe.lr == 1.0 and isinstance(recipe.lr, float)
    assert recipe.view.fanout == (5, 3)
    assert load_recipe(None, [*TRUNKLESS, "lr=1e-3"]).lr == 1e-3
    # one value of a list key is a list of one, however the number is spelled (YAML reads 1e-4 as a string)
    for spelled in ("0.0001", "1e-4", "[0.0001]"):
        assert load_recipe(None, [f"branch.weight_decay={spelled}"]).branch.weight_decay == (0.0001,), spelled
    assert load_recipe(None, ["branch.lr_scale=0.5", "view.fanout=10"]).branch.lr_scale == (0.5,)


@pytest.mark.parametrize("override, needle", [
    ("bogus=1", "'bogus'"),
    ("view.bogus=1", "'view.bogus'"),
    ("epochs=ten", "'epochs'"),
    ("epochs=0", "epochs"),
    ("dropout=1.5", "dropout"),
    ("model=mlp", "model"),
    ("view.kind=nope", "view.kind"),
    ("view.parts=0", "view.parts"),
    ("noequals", "key=value"),
])
def test_bad_overrides_name_the_key(override: str, needle: str) -> None:
    with pytest.raises((LadleError, ValueError), match=needle.replace(".", r"\.").replace("[", r"\[")):
        load_recipe(None, [*TRUNKLESS, override])


def test_malformed_yaml_and_missing_recipe(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("dataset: [cora\n")
    with pytest.raises(LadleError, match="not valid YAML"):
        load_recipe(str(broken))
    with pytest.raises(LadleError, match="not found"):
        load_recipe("no-such-recipe")


def test_unknown_soup_method_is_refused_before_training(tmp_path: Path) -> None:
    """soup.method is checked against the soup registry when training starts, before anything is written."""
    from ladle.train.launch import train_ingredients
    with pytest.raises(LadleError, match="unknown soup method 'best' \\(one of: uniform, greedy, gis, learned"):
        train_ingredients(load_recipe(None, ["soup.method=best"]), ingredients=1, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
