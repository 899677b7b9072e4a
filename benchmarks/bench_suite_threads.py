"""Two test suites side by side (as `make test` runs them, SUITE_JOBS=2): each with torch's default threads (every
core per process) against each with the cores shared out (OMP_NUM_THREADS = cores / 2, the Makefile's
SUITE_THREADS).

One run of an arm starts two copies of the same pytest selection at once and takes the wall time until both end;
the arms alternate (default, shared, default, shared, ...) so that a drift of the machine's speed falls on both.
The figure is the ratio of the medians, shared / default (< 1: sharing the cores out is faster), with each arm's
runs for the spread. Writes benchmarks/results/suite_threads.json.

    python benchmarks/bench_suite_threads.py [--repeats 3] [-- PYTEST SELECTION ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "suite_threads.json"
# CPU-bound toy-model tests of the main suite: TRL trainer steps (test_trl_matrix) and the measure app.
DEFAULT_SELECTION = ["tests/test_trl_matrix.py", "tests/test_measure.py", "-k", "not smollm2"]


def _pair(selection: list[str], threads: int | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection]
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(2)]
    codes = [p.wait() for p in procs]
    wall = time.monotonic() - t0
    if any(codes):
        raise SystemExit(f"a copy failed (exit codes {codes}) with threads={threads}: {' '.join(cmd)}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("selection", nargs="*", help="pytest arguments (after --); default: %(default)s")
    args = ap.parse_args()
    selection = args.selection or DEFAULT_SELECTION
    cores = os.cpu_count() or 1
    shared = max(1, cores // 2)
    walls: dict[str, list[float]] = {"default": [], "shared": []}
    for i in range(args.repeats):
        for arm, threads in (("default", None), ("shared", shared)):
            walls[arm].append(round(_pair(selection, threads), 1))
            print(f"repeat {i + 1}: {arm} {walls[arm][-1]} s", flush=True)
    med = {arm: statistics.median(v) for arm, v in walls.items()}
    result = {
        "what": "wall time of two copies of one pytest selection run side by side, until both end",
        "selection": selection, "cores": cores,
        "arms": {"default": "torch's default threads (every core per process)",
                 "shared": f"OMP_NUM_THREADS={shared} (cores / 2, the Makefile's SUITE_THREADS at SUITE_JOBS=2)"},
        "walls_s": walls, "median_s": med, "ratio_shared_over_default": round(med["shared"] / med["default"], 3),
        "date": time.strftime("%Y-%m-%d"),
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_s", "ratio_shared_over_default")}))


if __name__ == "__main__":
    main()
