"""Shared fixtures: the read-only shared datasets, a private cache, and Cora loaded through ladle."""
from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

PROJECT = Path(__file__).resolve().parents[1]
SHARED_DATASETS = PROJECT.parent / "shared" / "datasets"
# The 0.1 embedded defaults, for tests that train ingredients straight from the shared init: no trunk,
# 200 epochs, constant learning rate, best-validation weights (the embedded default now has a trunk).
TRUNKLESS = ("trunk.epochs=0", "epochs=200", "branch.schedule=constant", "branch.keep=best")
# GraphSAINT walks from one root, one batch an epoch: each step sees three nodes, so nothing on the view learns Cora
# (the launcher's fallback to the whole graph, ladle.train.view_check, must fire).
STARVED_VIEW = ("view.kind=saint-rw", "view.batch_size=1", "view.steps_per_epoch=1", "view.sample_coverage=1",
                "trunk.epochs=2", "epochs=8", "soup.method=uniform")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each test worker keeps to its own share of the cores (its training workers, torch
    threads and subprocesses inherit it), so two test workers do not fight over both cores: on the 2-core
    machine, Cora ingredients trained with 2 threads each beside another test took 3x as long as with 1."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker and count > 1 and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= count:
            share = set(cores[int(worker.removeprefix("gw")) % count::count])
            os.sched_setaffinity(0, share)
            torch.set_num_threads(len(share))


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage datasets into a cache of this test session (subprocesses inherit it)."""
    cache = tmp_path_factory.mktemp("ladle-cache")
    os.environ["LADLE_CACHE"] = str(cache)
    return cache


def under_ci() -> bool:
    """Whether a CI system runs the suite (``CI=true``, as GitHub, GitLab and most others set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The shared dataset folder (read-only); ladle stages what it needs into its own cache.

    Without it a dataset test skips locally, but fails under CI: a green CI run must have tested on data.
    """
    root = Path(os.environ.get("LADLE_DATA", SHARED_DATASETS))
    if not (root / "Cora").is_dir():
        message = f"datasets not found under {root} (looked for {root / 'Cora'}; set LADLE_DATA to the dataset root)"
        if under_ci():
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    return root


@pytest.fixture(scope="session")
def cora(data_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """Cora with its public split, loaded by PyG from a writable copy (raw features)."""
    from torch_geometric.datasets import Planetoid

    root = tmp_path_factory.mktemp("planetoid")
    shutil.copytree(data_root / "Cora", root / "Cora")
    return Planetoid(str(root), "Cora")[0]


@pytest.fixture(scope="session")
def cora_data(data_root: Path):
    """Cora as ladle loads it: public split, row-normalised features, ``num_classes`` set."""
    from ladle.graph.datasets import load_dataset

    return load_dataset("cora", data_root)


def run_module(module: str, *args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` as a user would; capture its output."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          cwd=cwd or PROJECT, timeout=timeout)


COMMANDS = {"ladle.train": "ladle.train.cli", "ladle.soup": "ladle.soup.cli", "ladle.prepare": "ladle.prepare",
            "ladle.varrate": "ladle.varrate.cli"}


def run_in_process(module: str, *args: str) -> subprocess.CompletedProcess:
    """:func:`run_module` without a new interpreter (3 s of imports saved): the same entry point
    (:func:`ladle.core.errors.run_cli` around the command's ``main``), its stdout, and on its stderr the log lines
    an INFO root logger prints, as the command's own would (its workers' output is not captured). Not for what
    needs a process of its own: a kill, a console script, the thread count a command sets."""
    from ladle.core.errors import run_cli

    main = importlib.import_module(COMMANDS[module]).main
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root, level = logging.getLogger(), logging.getLogger().level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_cli(main, list(args))
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a busy 2-core machine two threads stall each other on every small op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def copy_run(run: Path, tmp_path: Path) -> Path:
    """A copy of a finished run (its ``shards`` link kept) as ``tmp_path/run``, to damage or resume."""
    target = tmp_path / "run"
    shutil.copytree(run, target, symlinks=True)
    return target


def train_until_crash(recipe, data, task, evaluations: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Train ``task`` in this process and stop it with an error at its ``evaluations``-th validation (epoch
    ``evaluations - 1``), as a crash mid-run would: what it saved by then stays on disk."""
    from ladle.train import loop
    from ladle.train.loop import train_task

    evaluate, calls = loop.evaluate, []

    def crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == evaluations:
            raise RuntimeError("killed")
        return evaluate(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(loop, "evaluate", crash)
        with pytest.raises(RuntimeError, match="killed"):
            train_task(recipe, data, task)


def train_then_kill(args: list[str], run_dir: Path, marker: str) -> None:
    """Start ``python -m ladle.train`` on ``run_dir`` and SIGKILL it (whole process group) as soon as the
    file ``marker`` appears there: a crash in the middle of training. Returns once its workers have exited too
    (until then the run is refused as still in use, and a user retries)."""
    process = subprocess.Popen([sys.executable, "-m", "ladle.train", *args, "--run-dir", str(run_dir)], cwd=PROJECT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (run_dir / marker).exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, f"training finished before {marker} appeared, so it could not be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    lock_once_workers_exit(run_dir)


def lock_once_workers_exit(run_dir: Path, seconds: float = 30) -> None:
    """Take the run's lock as soon as a killed owner's workers have exited (refused until then), then let it go."""
    from ladle.core.errors import LadleError
    from ladle.core.runlock import lock_run_dir

    deadline = time.monotonic() + seconds
    while True:
        try:
            with lock_run_dir(run_dir, "test"):
                return
        except LadleError as error:
            assert "still in use by the workers of a command that stopped" in str(error), error
            assert time.monotonic() < deadline, "the killed owner's workers still hold the run"
            time.sleep(0.1)

# The files that take longest, started first: with ``-n 2 --dist loadfile`` the two workers then end together
# instead of one finishing a long file alone (longest-processing-time-first scheduling).
SLOW_FILES = ("test_ray.py", "test_varrate.py", "test_varrate_exchange.py", "test_ray_cluster.py", "test_notebook.py",
              "test_trunk.py", "test_workers.py", "test_run_lock.py", "test_metrics.py", "test_safety.py", "test_train.py",
              "test_shards.py", "test_soup.py", "test_console_scripts.py", "test_view_check.py", "test_cli.py",
              "test_pyg_sampler.py", "test_your_model.py", "test_parallel_phase.py", "test_learned.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run :data:`SLOW_FILES` first, in that order; every other test keeps its place."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))
