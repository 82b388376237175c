"""Files written safely without torch: atomic writes, JSON metadata, and the check that a path ladle reads is a
plain file. Every write goes to a temporary file in the same folder, is fsynced, then renamed over the target: a
crash leaves the old file or the new, never half. Torch-free, so the command lines parse and refuse bad input
before torch is imported (tensors and arrays: :mod:`ladle.core.storage`)."""
from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from ladle.core.errors import LadleError


@contextmanager
def atomic_open(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Write ``path`` through a temp file in its folder, fsync, then rename; clean up on failure.

    The temp file is created ``0o666`` less the umask, as ``open`` would (not ``mkstemp``'s ``0600``),
    so a run is readable by whoever may read the folder: ``0644`` under the usual umask ``022``.
    """
    path = Path(path)
    temp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except PermissionError:
        raise LadleError(f"cannot write to {path.parent}: permission denied (choose another --run-dir)") from None
    try:
        with os.fdopen(handle, mode) as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, path)
    except OSError as error:
        Path(temp).unlink(missing_ok=True)
        if _disk_full(error):
            raise LadleError(f"disk full while writing {path}; free space and rerun (use --resume)") from None
        raise
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _disk_full(error: OSError) -> bool:
    """Whether a failed write ran out of space: ENOSPC or EDQUOT, or numpy's short write ("N requested and M
    written"), which carries no errno."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return error.errno is None and "requested and" in str(error) and "written" in str(error)


def check_regular(path: Path, what: str = "") -> None:
    """Refuse ``path`` unless it is a regular file (or a link to one) or missing: a FIFO would block its reader
    forever, a directory or a device fail later with no useful word."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as error:
        raise LadleError(f"cannot read {what or path}: {error.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise LadleError(f"{what or path} is {kind}, not a file ladle wrote: remove it")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Atomically write ``payload`` as pretty JSON."""
    with atomic_open(path, "w") as stream:
        json.dump(payload, stream, indent=2, sort_keys=True)
        stream.write("\n")


def read_json(path: Path, fix: str = "delete it and retrain that part") -> dict[str, Any]:
    """Read a JSON metadata file, naming it in the error when missing or corrupt; ``fix`` says what to do about
    a corrupt one."""
    check_regular(path)
    try:
        payload = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise LadleError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LadleError(f"{path} is corrupt ({error.__class__.__name__}); {fix}") from None
    if not isinstance(payload, dict):
        raise LadleError(f"{path} is corrupt: expected a JSON object")
    return payload
