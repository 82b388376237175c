"""Ingredients on a two-node Ray cluster of this machine: each Ray worker's peak RSS against a local part worker's,
and what losing a node costs.

    python bench/ray_nodes.py                          # physics-metis, K = 8, 300 epochs
    python bench/ray_nodes.py --recipe cora-metis --epochs 400

The recipe's K part ingredients (``trunk.epochs=0``: part workers only, no whole-graph trunk) are trained three
times through ``python -m ladle.train``, one thread per worker: on the local backend (a worker per core),
on a Ray cluster of two nodes on loopback (a head and a second raylet, 1 CPU each), and on that cluster again
with the second node's raylet killed (SIGKILL) while it trains an ingredient. Each ingredient's JSON gives the
peak RSS of the process that trained it (VmHWM, Ray's own libraries included) and its weights, which must equal
the local run's. Writes ``bench/results/ray-nodes.json``. :func:`loopback_cluster` is shared with
``tests/test_ray_cluster.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ladle.core.files import read_json
from ladle.core.storage import load_state

RAY = Path(sys.executable).with_name("ray")
RESULTS = Path(__file__).resolve().parent / "results"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


NODE_STARTS = 3  # tries at the second node: on a loaded machine its raylet may miss Ray's 30 s to register


@contextmanager
def loopback_cluster() -> Iterator[tuple[str, int]]:
    """A Ray head and a second node on loopback, 1 CPU each, with a token of their own set in this process's
    environment (children inherit it); yields the head's address and the second raylet's node-manager port."""
    port = _free_port()
    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0")
    common = ["--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    try:
        # short: Ray's socket paths must fit 107 bytes
        with tempfile.TemporaryDirectory(prefix="ray-", ignore_cleanup_errors=True) as temp:
            try:
                _ray_start(["--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", temp, *common])
                for attempt in range(1, NODE_STARTS + 1):
                    second = _free_port()
                    try:
                        _ray_start(["--address", f"127.0.0.1:{port}", "--node-manager-port", str(second), *common])
                        break
                    except RuntimeError:
                        late = raylet_pid(second)  # a raylet late to register must not join the cluster later
                        if late is not None:
                            _kill_trees({late})
                        if attempt == NODE_STARTS:
                            raise
                yield f"127.0.0.1:{port}", second
            finally:
                _stop_cluster(temp, port)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _ray_start(args: list[str]) -> None:
    """``ray start`` with ``args``; its error output in the exception when it fails."""
    started = subprocess.run([str(RAY), "start", *args], capture_output=True, text=True)
    if started.returncode:
        raise RuntimeError(f"ray start {' '.join(args)} failed: {started.stderr[-2000:]}")


def _stop_cluster(temp: str, port: int) -> None:
    """SIGKILL this cluster's processes alone — those whose arguments name its temp folder or its GCS port, and their
    descendants (``ray stop`` would stop every Ray cluster of the machine, a concurrent test's too)."""
    marks = (temp.encode(), f":{port}".encode())
    _kill_trees({pid for pid, _, args in _processes() if pid != os.getpid()
                 and any(mark in arg for arg in args for mark in marks)})


def _kill_trees(roots: set[int], timeout: float = 10) -> None:
    """SIGKILL ``roots`` and their descendants, and wait until they are gone."""
    table = [(pid, parent, args) for pid, parent, args in _processes() if pid != os.getpid()]
    doomed = set(roots)
    while children := {pid for pid, parent, _ in table if parent in doomed} - doomed:
        doomed |= children
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(pid) for pid in doomed):
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _processes() -> Iterator[tuple[int, int, list[bytes]]]:
    """(pid, parent pid, arguments) of every process."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
        yield int(proc.name), parent, args


def raylet_pid(node_manager_port: int) -> int | None:
    """The pid of the raylet listening on ``node_manager_port``, or None."""
    return next((pid for pid, _, args in _processes() if args[0].endswith(b"/raylet")
                 and f"--node_manager_port={node_manager_port}".encode() in args), None)


def training_pid(raylet: int) -> int | None:
    """The pid of a worker of ``raylet`` running an ingredient task (Ray titles it ``ray::_train_task``), or None."""
    return next((pid for pid, parent, args in _processes() if parent == raylet
                 and args[0].startswith(b"ray::_train_task")), None)


def kill_node_while_training(train: subprocess.Popen, node_manager_port: int, timeout: float = 120) -> int:
    """Wait until the node of ``node_manager_port`` trains an ingredient for ``train``, then SIGKILL its workers and
    its raylet at once, as a machine that dies takes them all (a raylet killed alone leaves its workers to notice a
    moment later, long enough to finish a short ingredient); return the pid of the worker that was training there."""
    raylet = raylet_pid(node_manager_port)
    if raylet is None:
        raise RuntimeError("the second node's raylet is not running")
    deadline, victim = time.monotonic() + timeout, None
    while victim is None and train.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        victim = training_pid(raylet)
    if victim is None:
        raise RuntimeError("no ingredient ever ran on the second node")
    time.sleep(1)  # into its epochs
    for pid in [pid for pid, parent, _ in _processes() if parent == raylet] + [raylet]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return victim


def _train(args: list[str], run_dir: Path, node_manager_port: int | None = None) -> dict[str, Any]:
    """One ``ladle.train`` run (killing a node when ``node_manager_port`` is given): its ingredients' figures."""
    began = time.perf_counter()
    train = subprocess.Popen([sys.executable, "-m", "ladle.train", *args, "--run-dir", str(run_dir)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    victim = kill_node_while_training(train, node_manager_port) if node_manager_port is not None else None
    _, err = train.communicate()
    if train.returncode:
        raise RuntimeError(f"ladle.train failed: {err[-2000:]}")
    metas = sorted((read_json(path) for path in run_dir.glob("ingredient-*.json")), key=lambda m: m["name"])
    return {"seconds": time.perf_counter() - began, "killed_worker": victim,
            "killed_worker_finished_one": victim in {meta["pid"] for meta in metas},  # True: the kill came too late
            "ingredients": [{key: meta[key] for key in ("name", "pid", "peak_rss_mb", "test_acc", "train_seconds")}
                            for meta in metas]}


def _same_weights(run: Path, reference: Path) -> bool:
    for path in reference.glob("ingredient-*.safetensors"):
        ours, theirs = load_state(run / path.name), load_state(path)
        if ours.keys() != theirs.keys() or not all(torch.equal(ours[k], theirs[k]) for k in theirs):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="physics-metis")
    parser.add_argument("-k", "--ingredients", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=300, help="enough for the kill to land inside an ingredient")
    parser.add_argument("--data-root", help="dataset root folder")
    parser.add_argument("--out", type=Path, default=RESULTS / "ray-nodes.json")
    args = parser.parse_args()
    common = ["--recipe", args.recipe, "-k", str(args.ingredients), "trunk.epochs=0", f"epochs={args.epochs}",
              *(["--data-root", args.data_root] if args.data_root else [])]
    record: dict[str, Any] = {"command": " ".join(sys.argv), "recipe": args.recipe, "ingredients": args.ingredients,
                              "epochs": args.epochs}
    with tempfile.TemporaryDirectory() as scratch:
        runs = Path(scratch)
        cores = len(os.sched_getaffinity(0))  # a worker per core: one thread each, as each Ray task
        record["local"] = _train([*common, "--workers", str(cores)], runs / "local")
        with loopback_cluster() as (address, second):
            ray = [*common, "--backend", "ray", "--address", address]
            record["ray"] = _train(ray, runs / "ray")
            record["ray, a node killed"] = _train(ray, runs / "killed", second)
        for name, folder in (("ray", "ray"), ("ray, a node killed", "killed")):
            record[name]["weights_equal_local"] = _same_weights(runs / folder, runs / "local")
    local_peak = max(i["peak_rss_mb"] for i in record["local"]["ingredients"])
    for name in ("ray", "ray, a node killed"):
        peak = max(i["peak_rss_mb"] for i in record[name]["ingredients"])
        record[name]["peak_over_local"] = peak / local_peak
        print(f"{name}: peak worker RSS {peak:.0f} MiB = {peak / local_peak:.2f}x the local worker's "
              f"({local_peak:.0f} MiB); {record[name]['seconds']:.0f} s against {record['local']['seconds']:.0f} s "
              f"locally; weights equal the local run's: {record[name]['weights_equal_local']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
