"""A run directory has one owner at a time: train, resume, averaging and the soup's writes hold its lock, a
second process is refused in one line naming the first, and a directory that holds another run is refused
unless ``--resume``."""
from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import (
    PROJECT,
    TRUNKLESS,
    copy_run,
    lock_once_workers_exit,
    run_in_process,
    run_module,
)

from ladle.core import rundir
from ladle.core.errors import LadleError
from ladle.core.recipe import load_recipe
from ladle.core.rundir import new_run_dir
from ladle.core.runlock import lock_run_dir
from ladle.soup.pipeline import soup_run
from ladle.train.launch import train_ingredients

FULL = [*TRUNKLESS, "view.kind=full", "epochs=3"]


@pytest.fixture(scope="module")
def finished_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run: two Cora ingredients on the full graph, 3 epochs each."""
    return train_ingredients(load_recipe(None, FULL), ingredients=2, workers=1, data_root=data_root,
                             run_dir=tmp_path_factory.mktemp("lock") / "run").run_dir


def _files(run: Path) -> dict[str, int]:
    """Modification time of every file of a run but its lock file (which records each owner)."""
    return {path.name: path.stat().st_mtime_ns for path in run.iterdir() if path.name != "run.lock"}


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr.strip()


def _train(*args: str, stderr: int = subprocess.DEVNULL) -> subprocess.Popen:
    """``python -m ladle.train args`` in its own process group (so the test can kill it and its workers)."""
    return subprocess.Popen([sys.executable, "-m", "ladle.train", *args], cwd=PROJECT, stdout=subprocess.DEVNULL,
                            stderr=stderr, text=True, start_new_session=True)


def test_a_second_train_is_refused_while_the_first_runs(data_root: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["-k", "1", "--workers", "1", "view.kind=full", "epochs=100000", "patience=100000",
            "--data-root", str(data_root), "--run-dir", str(run_dir)]
    first = _train(*args)
    second = None
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "run.json").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.poll() is None, "the first train stopped early"
        second = _train(*args, stderr=subprocess.PIPE)
        _, stderr = second.communicate(timeout=90)
        error = _one_line(subprocess.CompletedProcess(second.args, second.returncode, "", stderr))
        assert re.fullmatch(rf"error: run directory {re.escape(str(run_dir))} is in use by pid {first.pid} "
                            r"\(ladle\.train since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\); wait for it to end or choose "
                            r"another --run-dir", error), error
    finally:
        for process in (first, second):
            if process is not None:
                with contextlib.suppress(ProcessLookupError):  # the whole group: the train and its workers
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    lock_once_workers_exit(run_dir)  # the kernel dropped the killed owner's locks


def test_a_worker_of_a_killed_launcher_keeps_the_run_owned(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    worker = subprocess.Popen([sys.executable, "-c", "import sys, time; from ladle.core.runlock import hold_as_worker; "
                               "hold_as_worker(sys.argv[1]); print('holding', flush=True); time.sleep(600)", str(run)],
                              cwd=PROJECT, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "holding"
        with pytest.raises(LadleError, match=f"run directory {run} is still in use by the workers of a command that "
                                             r"stopped \(they exit within seconds of it\); retry"):
            with lock_run_dir(run, "ladle.train --resume"):
                pass
    finally:
        worker.kill()
        worker.wait()
    with lock_run_dir(run, "ladle.train --resume"):  # the worker is gone: the run is free
        pass


def test_resume_averaging_and_soup_are_refused_while_another_owns_the_run(finished_run: Path, data_root: Path,
                                                                          tmp_path: Path) -> None:
    run = copy_run(finished_run, tmp_path)
    before = _files(run)
    commands = [("ladle.train", "--resume"), ("ladle.train", "--average-every", "2", "-k", "2", *FULL),
                ("ladle.soup", "--method", "uniform")]
    with lock_run_dir(run, "ladle.train"):
        for command in commands:
            error = _one_line(run_in_process(*command, "--run-dir", str(run), "--data-root", str(data_root)))
            assert f"run directory {run} is in use by pid {os.getpid()} (ladle.train since " in error, error
        with pytest.raises(LadleError, match="is in use by pid"):  # another open of the lock, in this process
            soup_run(run, method="uniform", data_root=data_root)
    assert _files(run) == before
    soup_run(run, method="uniform", data_root=data_root)  # released: the soup writes
    assert (run / "soup-uniform.safetensors").is_file()


def test_a_directory_holding_another_run_is_refused_unless_resumed(finished_run: Path, data_root: Path,
                                                                   tmp_path: Path) -> None:
    run = copy_run(finished_run, tmp_path)
    before = _files(run)
    error = _one_line(run_in_process("ladle.train", "-k", "2", *FULL, "hidden=32", "--run-dir", str(run),
                                     "--data-root", str(data_root)))
    assert error == (f"error: run directory {run} already holds another run (hidden 32, run.json 64): finish it "
                     "with --resume, or choose another --run-dir")
    with pytest.raises(LadleError, match=r"another run \(ingredients 3, run.json 2; view.kind 'random', "
                                         r"run.json 'full'\)"):
        train_ingredients(load_recipe(None, [*FULL, "view.kind=random"]), ingredients=3, run_dir=run,
                          data_root=data_root)
    assert _files(run) == before
    resumed = run_module("ladle.train", "--resume", "--run-dir", str(run), "--data-root", str(data_root))
    assert resumed.returncode == 0, resumed.stderr


def test_a_planted_lock_link_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").symlink_to(target)
    with pytest.raises(LadleError, match=f"cannot lock run directory {run}: Too many levels of symbolic links"):
        with lock_run_dir(run, "ladle.train"):
            pass
    assert target.read_text() == "keep"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _kill_launcher_then_expect_gone(launcher: subprocess.Popen, processes: list[int], run: Path) -> None:
    """SIGKILL the launcher alone (not its process group); every one of ``processes`` must exit within 30 s, and
    the run be free again."""
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in processes), "a worker outlived its launcher"
    lock_once_workers_exit(run, seconds=5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_die_with_their_launcher(data_root: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "ladle.train", "-k", "2", "--workers", "2", *TRUNKLESS,
                                 "view.kind=saint-rw", "epochs=100000", "patience=100000", "--data-root",
                                 str(data_root), "--run-dir", str(run)], cwd=PROJECT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len(list(run.glob("metrics-ingredient-*.csv"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        children = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(launcher.pid)], capture_output=True,
                                  text=True).stdout.splitlines()
        workers = [int(line.split()[0]) for line in children if "spawn_main" in line]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers), children
        _kill_launcher_then_expect_gone(launcher, workers, run)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_varrate_ranks_die_with_their_launcher(data_root: Path, tmp_path: Path) -> None:
    """Ranks fork from a server process the launcher starts: killing the launcher alone ends the server and every
    rank, and the run is free again."""
    run = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "ladle.varrate", "--ranks", "2", "--schedule", "full",
                                 "epochs=100000", "patience=100000", "--data-root", str(data_root), "--run-dir",
                                 str(run)], cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        assert launcher.stderr is not None
        for line in launcher.stderr:  # rank 0 says so once every rank has joined
            if "training 2 ranks" in line:
                break
        group = subprocess.run(["ps", "-ww", "-o", "pid=", "-g", str(launcher.pid)], capture_output=True,
                               text=True).stdout.split()
        children = [int(pid) for pid in group if int(pid) != launcher.pid]
        assert len(children) >= 2 and all(_alive(pid) for pid in children), group  # the server and its ranks
        _kill_launcher_then_expect_gone(launcher, children, run)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


def test_commands_started_in_the_same_second_each_get_their_own_folder(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> Frozen:
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(rundir, "dt", SimpleNamespace(datetime=Frozen))
    root = tmp_path / "checkpoints"
    with pytest.raises(RuntimeError, match="stopped"):
        with new_run_dir("demo", root) as first, new_run_dir("demo", root) as second:
            assert (first.name, second.name) == ("demo-20260102-030405", "demo-20260102-030405-1")
            (second / "run.json").write_text("{}")
            raise RuntimeError("stopped")
    assert [path.name for path in root.iterdir()] == ["demo-20260102-030405-1"]  # the empty one removed, not the other


def test_a_launch_refused_leaves_no_folder_behind(data_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    with pytest.raises(LadleError, match="nowhere does not exist"):
        train_ingredients(load_recipe(None, FULL), ingredients=1, data_root=tmp_path / "nowhere", checkpoints_root=root)
    assert list(root.iterdir()) == []
