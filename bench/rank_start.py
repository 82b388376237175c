"""How long ``python -m ladle.varrate`` takes to start its ranks: ranks spawned (each imports torch, PyG and ladle
itself) against ranks forked from a fork server that imported them once, for a command's first run and for a second
run from the same Python process (a notebook, a sweep). One invocation, the cases alternated, each in a fresh
interpreter; a run of one epoch on Cora, so the figure is mostly the ranks' start. Not a test:

    python bench/rank_start.py                    # 2 and 4 ranks, 3 repeats
    python bench/rank_start.py --ranks 2 --repeats 1 --out smoke.json
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ladle.core.files import write_json

PROJECT = Path(__file__).resolve().parents[1]
# A fresh interpreter: argv = start method, runs, run-dir prefix, the command's arguments; prints each run's seconds.
DRIVER = """
import sys, time
from ladle.core.errors import run_cli
import ladle.varrate.ranks as ranks
from ladle.varrate.cli import main
if sys.argv[1] == "spawn":
    ranks._rank_start_method = lambda: "spawn"
for run in range(int(sys.argv[2])):
    began = time.perf_counter()
    assert run_cli(main, [*sys.argv[4:], "--run-dir", f"{sys.argv[3]}-{run}"]) == 0
    print(time.perf_counter() - began)
"""
# case -> (the ranks' start method, runs one interpreter makes: a second reuses the fork server the first started)
CASES = {"spawned": ("spawn", 1), "fork server, first run": ("forkserver", 1),
         "fork server, second run": ("forkserver", 2)}


def one(case: str, ranks: int, data_root: str | None, scratch: Path) -> float:
    """Seconds of the case's last run (imports of the driving interpreter not included)."""
    method, runs = CASES[case]
    args = ["--ranks", str(ranks), "--schedule", "full", "epochs=1", "dataset=cora"]
    if data_root:
        args += ["--data-root", data_root]
    out = subprocess.run([sys.executable, "-c", DRIVER, method, str(runs), str(scratch / f"{time.time_ns()}"),
                          *args], cwd=PROJECT, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-root", help="dataset root (default: ladle's)")
    parser.add_argument("--out", type=Path, default=PROJECT / "bench" / "results" / "rank-start.json")
    args = parser.parse_args()
    seconds: dict[str, dict[str, list[float]]] = {str(k): {case: [] for case in CASES} for k in args.ranks}
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.repeats):
            for ranks in args.ranks:
                for case in CASES:
                    seconds[str(ranks)][case].append(one(case, ranks, args.data_root, Path(scratch)))
    rows = {}
    for ranks, cases in seconds.items():
        baseline = statistics.median(cases["spawned"])
        rows[ranks] = {case: {"seconds": values, "median": statistics.median(values),
                              "spawned / this": baseline / statistics.median(values)} for case, values in cases.items()}
        for case, row in rows[ranks].items():
            print(f"{ranks} ranks, {case:<24} median {row['median']:5.1f} s  "
                  f"spawned / this {row['spawned / this']:.2f}x")
    write_json(args.out, {"machine": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
                          "repeats": args.repeats, "ranks": rows})


if __name__ == "__main__":
    main()
