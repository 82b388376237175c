"""A run directory has one owner at a time: train, resume, averaging, varrate and the soup's writes hold an
exclusive ``flock`` on its ``run.lock`` (:func:`lock_run_dir`), which the kernel releases when the process dies; the
launcher's worker processes hold a shared ``flock`` on ``workers.lock`` (:func:`hold_as_worker`) until they exit,
so a directory whose launcher was killed stays owned until its last worker is gone."""
from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ladle.core.errors import LadleError
from ladle.core.rundir import RunDir


@contextmanager
def lock_run_dir(run_dir: Path, command: str) -> Iterator[None]:
    """Own ``run_dir`` while the block runs: an exclusive, non-blocking ``flock`` on its lock file, which
    records the pid, ``command`` and start time; a directory another process owns is refused in one line.
    The kernel drops the lock when the process dies, so a killed run can be resumed at once."""
    fd = _acquire(run_dir)
    try:
        owner = {"pid": os.getpid(), "command": command, "since": dt.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        _remove_leftovers(run_dir)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_leftovers(run_dir: Path) -> None:
    """Remove the temporary files of atomic writes (``.<name>.<random>.tmp``) that a killed owner left: the
    directory is ours now, so no write is under way."""
    for temp in Path(run_dir).glob(".*.tmp"):
        if temp.is_file() and not temp.is_symlink():
            temp.unlink(missing_ok=True)


def check_free(run_dir: Path) -> None:
    """Refuse now, before long work, a run directory another process owns (the work takes the lock later)."""
    if RunDir(run_dir).lock.exists():
        os.close(_acquire(run_dir))


def _acquire(run_dir: Path) -> int:
    """A descriptor of the run directory's lock file, locked exclusively (refused when another holds it, or
    while workers of an earlier owner still live)."""
    path = RunDir(run_dir).lock
    fd = _open_lock(run_dir, path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _owner(fd)
        os.close(fd)
        raise LadleError(f"run directory {run_dir} is in use by {owner}; wait for it to end or choose another "
                         "--run-dir") from None
    except OSError as error:  # a file system without flock
        os.close(fd)
        raise LadleError(f"cannot lock run directory {run_dir}: {error.strerror} ({path})") from None
    if RunDir(run_dir).workers_lock.exists():
        workers = _open_lock(run_dir, RunDir(run_dir).workers_lock)
        try:
            fcntl.flock(workers, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free only when no worker holds it shared
        except BlockingIOError:
            os.close(fd)
            raise LadleError(f"run directory {run_dir} is still in use by the workers of a command that stopped "
                             "(they exit within seconds of it); retry") from None
        finally:
            os.close(workers)
    return fd


def _open_lock(run_dir: Path, path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as error:
        raise LadleError(f"cannot lock run directory {run_dir}: {error.strerror} ({path})") from None


_held: list[int] = []  # the worker-lock descriptors of this process, open until it exits


def hold_as_worker(run_dir: Path) -> None:
    """Hold a shared lock on ``run_dir``'s ``workers.lock`` for the rest of this (worker) process's life, so the
    directory is not handed to another command while the worker still trains into it."""
    fd = _lock_shared(run_dir)
    if fd is not None:
        _held.append(fd)


@contextmanager
def working_in(run_dir: Path) -> Iterator[None]:
    """Hold a shared lock on ``run_dir``'s ``workers.lock`` while a task of a pool worker, which outlives one run,
    trains into it: as :func:`hold_as_worker`, for one task."""
    fd = _lock_shared(run_dir)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _lock_shared(run_dir: Path) -> int | None:
    """A descriptor holding ``workers.lock`` shared, or None on a file system without flock (the run lock alone)."""
    fd = _open_lock(run_dir, RunDir(run_dir).workers_lock)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return None
    return fd


def _owner(fd: int) -> str:
    """``pid N (command since T)`` from a lock file's record, or ``another process`` while it is unwritten."""
    try:
        owner = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(owner['pid'])} ({owner['command']} since {owner['since']})"
    except (ValueError, KeyError, TypeError):
        return "another process"
