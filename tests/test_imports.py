"""The package's shape: stage packages imported in one order only (imports inside functions included), no
import cycle, no module over 450 lines, the run directory's file names spelled in ``ladle/core/rundir.py``
alone, and each soup method's name written only where it registers."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ladle"
MAX_LINES = 450
RUN_DIR_OWNER = "ladle.core.rundir"
RUN_DIR_NAMES = ("run.json", "init.safetensors", "trunk.safetensors", "partition.safetensors", "ingredient-",
                 ".progress.safetensors", "averaged.safetensors", "baseline.safetensors", "soup-", "report.json",
                 "report.md", "accuracy.png", "alpha.png", "accuracy-bytes.png", "varrate.json", "model.safetensors",
                 "run.lock", "metrics.csv", "metrics-", "tensorboard-logs")


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, not ``__init__``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module that importing ``name`` executes last: its longest prefix that is a module."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, wherever the import statement is (top level or not)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets += [f"{base}.{alias.name}" for alias in node.names]
        graph[name] = {t for t in (_resolve(target, modules) for target in targets) if t and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_cycle_finder_finds_a_cycle_and_accepts_a_tree() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "ladle.train.loop" in graph["ladle.train.worker"] and "ladle.varrate.trainer" in graph["ladle.varrate.ranks"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


# Stage packages, lowest first: a module may import its own package and the packages before it, never one
# after it. Soup comes before train because training checks a recipe's soup method against the registry.
STAGES = ("core", "graph", "nn", "soup", "train", "varrate")


def stage(module: str) -> int | None:
    """The rank of ``module``'s stage package (None for the top-level modules: the package, the commands)."""
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else None


def test_stage_order_checker_refuses_an_upward_import() -> None:
    assert upward_imports({"ladle.core.recipe": {"ladle.graph.views"}}) == ["ladle.core.recipe -> ladle.graph.views"]
    assert upward_imports({"ladle.graph.views": {"ladle.core.recipe"}, "ladle.cli": {"ladle.train.cli"}}) == []


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a stage package into a later stage package, or out of the stage packages."""
    found = []
    for module, targets in graph.items():
        rank = stage(module)
        if rank is None:
            continue
        found += [f"{module} -> {target}" for target in sorted(targets)
                  if stage(target) is None or stage(target) > rank
                  or (stage(target) == rank and target.split(".")[1] != module.split(".")[1])]
    return found


def test_stage_packages_import_only_earlier_stages() -> None:
    graph = import_graph()
    assert {stage(module) for module in graph} >= set(range(len(STAGES))), "a stage package is missing"
    assert upward_imports(graph) == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_module_is_short(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines (at most {MAX_LINES}): split it"


def _string_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string constant except docstrings (f-strings' literal parts included)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_run_directory_file_names_live_in_rundir() -> None:
    offences = []
    for name, path in _modules().items():
        literals = _string_literals(ast.parse(path.read_text(), str(path)))
        found = [f"{path.name}:{line} {text!r}" for line, text in literals for file in RUN_DIR_NAMES if file in text]
        if name == RUN_DIR_OWNER:
            assert found, "the run directory's owner names no file: is RUN_DIR_NAMES out of date?"
        else:
            offences += found
    assert not offences, "run-directory file names outside ladle/rundir.py: " + "; ".join(offences)


def test_each_soup_method_name_is_written_only_where_it_registers() -> None:
    from ladle.soup import pipeline  # noqa: F401  (imports every module that registers a method)
    from ladle.soup.methods import SOUPS
    assert {"uniform", "greedy", "gis", "learned", "learned-partition"} <= set(SOUPS)
    offences = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        registering = {node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                       and getattr(node.func, "id", None) == "register"}
        offences += [f"{path.name}:{line} {text!r}" for line, text in _string_literals(tree)
                     if text in SOUPS and line not in registering]
    assert not offences, "soup method names spelled outside their register(...) call: " + "; ".join(offences)


def test_the_registry_is_whole_whichever_module_is_imported_first() -> None:
    import subprocess
    import sys
    code = "from ladle.soup.methods import SOUPS; print(' '.join(SOUPS))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["uniform", "greedy", "gis", "learned", "learned-partition"]
