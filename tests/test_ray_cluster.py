"""A Ray cluster of two nodes on this machine (a head and a second raylet, loopback only) that loses its second
node mid-run: the ingredients that node was training are retried on the head, none is lost or kept twice, and
the weights equal a local run's. Slow (two Ray nodes start, ~1 minute): ``make test-slow``."""
from __future__ import annotations

import csv
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TRUNKLESS, run_module

from ladle.core.recipe import load_recipe
from ladle.core.storage import load_state, read_json
from ladle.train.launch import train_ingredients

pytestmark = pytest.mark.slow
K = 4
OVERRIDES = [*TRUNKLESS, "dataset=cora", "view.kind=metis", "epochs=600", "hidden=16", "seed=5", "patience=1000"]
RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _processes() -> Iterator[tuple[int, int, list[bytes]]]:
    """(pid, parent pid, arguments) of every process."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
        yield int(proc.name), parent, args


def _raylet(node_manager_port: int) -> int | None:
    """The pid of the raylet listening on ``node_manager_port`` (the second node's), or None."""
    return next((pid for pid, _, args in _processes() if args[0].endswith(b"/raylet")
                 and f"--node_manager_port={node_manager_port}".encode() in args), None)


def _training_on(raylet: int) -> int | None:
    """The pid of a worker of ``raylet`` running an ingredient task (Ray titles it ``ray::_train_task``), or None."""
    return next((pid for pid, parent, args in _processes() if parent == raylet
                 and args[0].startswith(b"ray::_train_task")), None)


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    """A head node and a second node, 1 CPU each, with a token of their own; the head's address and the second
    raylet's port. The driver (a ``ladle.train`` subprocess) inherits the token from this environment."""
    pytest.importorskip("ray")
    port, second = _free_port(), _free_port()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    common = ["--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    with tempfile.TemporaryDirectory(prefix="ray-") as temp:  # short: Ray's socket paths must fit 107 bytes
        try:
            for args in (["--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", temp],
                         ["--address", f"127.0.0.1:{port}", "--node-manager-port", str(second)]):
                started = subprocess.run([str(RAY), "start", *args, *common], capture_output=True, text=True)
                assert started.returncode == 0, started.stderr[-2000:]
            yield f"127.0.0.1:{port}", second
        finally:
            subprocess.run([str(RAY), "stop", "--force"], capture_output=True)


def test_losing_a_node_loses_no_ingredient(cluster: tuple[str, int], data_root: Path, tmp_path: Path) -> None:
    address, second = cluster
    raylet = _raylet(second)
    assert raylet is not None, "the second node's raylet is not running"
    run_dir = tmp_path / "ray"
    train = subprocess.Popen([sys.executable, "-m", "ladle.train", "--backend", "ray", "--address", address,
                              "-k", str(K), "--run-dir", str(run_dir), "--data-root", str(data_root), *OVERRIDES],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, victim = time.monotonic() + 120, None
    while victim is None and train.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        victim = _training_on(raylet)
    assert victim is not None, "no ingredient ever ran on the second node"
    time.sleep(1)  # into its epochs
    os.kill(raylet, signal.SIGKILL)  # the node is gone: its raylet, and with it the worker training there
    out, err = train.communicate(timeout=600)
    assert train.returncode == 0, err[-2000:]
    metas = [read_json(run_dir / f"ingredient-{k:02d}.json") for k in range(K)]
    assert all(meta["status"] == "done" for meta in metas) and victim not in {meta["pid"] for meta in metas}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ladle.train.launch.available_cores", lambda: 1)
        local = train_ingredients(load_recipe(None, OVERRIDES), K, workers=1, run_dir=tmp_path / "local",
                                  data_root=data_root)
    for meta in local.ingredients:
        ours, theirs = (load_state(d / f"{meta['name']}.safetensors") for d in (run_dir, local.run_dir))
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs), meta["name"]
    with open(run_dir / "metrics.csv", newline="") as stream:
        rows = Counter((row["name"], row["epoch"]) for row in csv.DictReader(stream) if row["role"] == "ingredient")
    assert len(rows) == K * 600 and set(rows.values()) == {1}, "an ingredient's epochs are missing or kept twice"
    soup = run_module("ladle.soup", "--run-dir", str(run_dir), "--data-root", str(data_root), "--method", "uniform")
    assert soup.returncode == 0, soup.stderr
