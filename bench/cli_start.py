"""How long a command line takes to answer what needs no torch: ``--help``, ``--list-recipes``, a bad recipe key,
the cache's listing, each run as a user runs it (``python -m ...``, a fresh interpreter, timed from outside),
against, in the same invocation, what those commands imported before reading their arguments (torch, PyG and the
training and shard code) and a command that still imports them first (``ladle.soup --help``). Not a test:

    python bench/cli_start.py                 # 5 repeats, the cases alternated
    python bench/cli_start.py --repeats 1 --out smoke.json
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
# case -> the interpreter's arguments; exit codes other than 0 and 2 (a refused input) are failures
CASES = {
    "ladle.train --help": ["-m", "ladle.train", "--help"],
    "ladle.train --list-recipes": ["-m", "ladle.train", "--list-recipes"],
    "ladle.train bogus=1": ["-m", "ladle.train", "bogus=1"],
    "ladle.prepare --list": ["-m", "ladle.prepare", "--list"],
    "ladle.soup --help (imports first)": ["-m", "ladle.soup", "--help"],
    "their imports before (reference)": ["-c", "import ladle.train.launch, ladle.graph.shards"],
}
REFERENCE = "their imports before (reference)"


def one(argv: list[str], cache: str) -> float:
    """Wall seconds of one fresh interpreter running ``argv``."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=PROJECT, capture_output=True, text=True,
                          env={**os.environ, "LADLE_CACHE": cache})
    seconds = time.perf_counter() - began
    if done.returncode not in (0, 2):
        raise SystemExit(f"{argv}: exit {done.returncode}\n{done.stderr}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=PROJECT / "bench" / "results" / "cli-start.json")
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(args.repeats):
            for case, argv in CASES.items():
                seconds[case].append(one(argv, cache))
    reference = statistics.median(seconds[REFERENCE])
    rows = {case: {"seconds": values, "median": statistics.median(values),
                   "reference / this": reference / statistics.median(values)} for case, values in seconds.items()}
    for case, row in rows.items():
        print(f"{case:<36} median {row['median']:5.2f} s  reference / this {row['reference / this']:5.1f}x")
    write_json(args.out, {"machine": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
                          "repeats": args.repeats, "cases": rows})


if __name__ == "__main__":
    main()
