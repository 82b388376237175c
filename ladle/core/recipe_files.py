"""Where recipes are found and how a recipe file is read: ``./recipes`` first, then the recipes shipped with
ladle (package data, so a plain ``pip install`` finds them from any folder); YAML without aliases."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ladle.core.errors import LadleError
from ladle.core.files import check_regular


class RecipeLoader(yaml.SafeLoader):
    """``yaml.safe_load`` without aliases: a recipe is a few keys, and nested aliases expand exponentially
    (a 623-byte file can stand for gigabytes)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a recipe",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)


def recipe_dirs() -> list[Path]:
    """Where ``--recipe NAME`` is looked up: ``./recipes``, then the shipped recipes (``ladle/recipes`` of an
    installed package, or the ``recipes/`` of a checkout)."""
    installed, checkout = (Path(__file__).resolve().parents[i] / "recipes" for i in (1, 2))
    return [Path.cwd() / "recipes", installed if installed.is_dir() else checkout]


def recipe_names() -> dict[str, Path]:
    """Every recipe ``--recipe NAME`` finds, by name (``./recipes`` wins over a shipped one of that name)."""
    return {path.stem: path for folder in reversed(recipe_dirs()) if folder.is_dir()
            for path in sorted(folder.glob("*.yaml"))}


def resolve_recipe_path(name_or_path: str) -> Path:
    """A recipe file from a path or a name in one of :func:`recipe_dirs`."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    for folder in recipe_dirs():
        candidate = folder / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    if path.is_dir():
        raise LadleError(f"recipe {path} is a directory, not a recipe file (give a .yaml file or a recipe name)")
    raise LadleError(
        f"recipe '{name_or_path}' not found (a .yaml path, or one of: {', '.join(sorted(recipe_names())) or 'none'})"
    )


def read_recipe_file(recipe: str) -> dict[str, Any]:
    """The values of the recipe file named ``recipe`` (a name or a path); ``name`` defaults to the file's stem."""
    path = resolve_recipe_path(recipe)
    check_regular(path, f"recipe {path}")
    try:
        loaded = yaml.load(path.read_text(), Loader=RecipeLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as error:
        first = str(error).splitlines()[0]
        raise LadleError(f"recipe {path} is not valid YAML: {first}") from None
    except UnicodeDecodeError:
        raise LadleError(f"recipe {path} is not a text file (not UTF-8): give a YAML recipe") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise LadleError(f"recipe {path} must be a mapping of keys to values")
    loaded.setdefault("name", path.stem)
    return loaded
