"""ladle's cache folder (``$LADLE_CACHE``, else ``~/.cache/ladle``): where it is, which of its folders ladle wrote
(each marked), and how one is removed. Torch-free, so ``python -m ladle.prepare --list`` and ``--prune`` need no
torch; what the entries hold: :mod:`ladle.graph.datasets` (datasets' arrays), :mod:`ladle.graph.shards`."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ladle.core.errors import LadleError


def cache_dir() -> Path:
    """Writable folder for the datasets' arrays and the shards: ``$LADLE_CACHE``, else ``~/.cache/ladle``.

    An empty ``$LADLE_CACHE`` and the working directory are refused: either would scatter the cache's
    folders (and ``prepare --prune``'s reach) over the user's own files.
    """
    value = os.environ.get("LADLE_CACHE")
    if value is not None and not value.strip():
        raise LadleError("LADLE_CACHE is set but empty: unset it (the cache is then ~/.cache/ladle) or name a folder")
    cache = Path(value or Path.home() / ".cache" / "ladle").expanduser()
    if cache.resolve() == Path.cwd().resolve():
        raise LadleError(f"the cache {cache} (LADLE_CACHE) is the working directory: name a folder of its own")
    return cache


CACHE_MARKER = ".ladle-cache-entry"  # in every folder ladle writes into the cache; prune removes no other


def mark_cache_entry(folder: Path) -> None:
    """Create ``folder`` and mark it as ladle's own (written first, so an interrupted build is marked too)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CACHE_MARKER).write_text("written by ladle; python -m ladle.prepare --prune may remove this folder\n")


def is_cache_entry(folder: Path) -> bool:
    """Whether ``folder`` is a real folder (not a link) that ladle marked as a cache entry of its own."""
    marker = folder / CACHE_MARKER
    return folder.is_dir() and not folder.is_symlink() and marker.is_file() and not marker.is_symlink()


def discard(path: Path) -> None:
    """Remove a cache folder: renamed aside first, so no reader ever sees it half deleted."""
    aside = path.parent / f".{path.name}.discarded.{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)
