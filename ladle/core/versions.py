"""The versions a run's numbers depend on (Python, ladle, torch, PyG, METIS, NumPy, SciPy), recorded in ``run.json``:
the same seed gives the same weights only with the same libraries, so a figure names what made it."""
from __future__ import annotations

import platform
from collections.abc import Mapping
from importlib import metadata

LIBRARIES = ("ladle", "torch", "torch-geometric", "pymetis", "numpy", "scipy")


def library_versions() -> dict[str, str | None]:
    """Python's version and each of :data:`LIBRARIES`' installed one (None where it is not installed)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def changed_versions(recorded: object) -> list[str]:
    """``"torch 2.13.0 -> 2.14.0"`` for each version in ``recorded`` (a run's ``versions``) that this process does
    not have; none for a run that recorded none."""
    if not isinstance(recorded, Mapping):
        return []
    now = library_versions()
    return [f"{name} {version} -> {now.get(name)}" for name, version in recorded.items() if now.get(name) != version]
