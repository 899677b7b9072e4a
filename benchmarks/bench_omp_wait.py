"""What ``OMP_WAIT_POLICY=PASSIVE`` (exported by the Makefile) does to the test suites on a small CPU machine: one
SmolLM2 arm of ``tests/test_trl_real_model.py`` (TRL's GRPOTrainer, vLLM colocate rollouts, 2 steps) alone, and two
of them side by side (as ``make test`` runs two suites at once), each under libgomp's default wait policy (a thread
at a barrier spins before it sleeps), ``PASSIVE`` (it sleeps at once) and ``OMP_NUM_THREADS=1``.

    python -m benchmarks.bench_omp_wait [--repeats N] [--quick]

Every process of a suite (the trainer, vLLM's engine, verl's workers) keeps its own OpenMP pool of one thread per
core; with more busy processes than cores, a spinning thread holds a core another process needs. Writes
``benchmarks/results/omp_wait_policy.json``: wall seconds per setting (median, spread over repeats; the side-by-side
figure is the slower of the two arms) and the ratios to the default's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import spread, write_results

ROOT = Path(__file__).resolve().parents[1]
ARM = ROOT / "tests" / "trl_real_model_arm.py"
SETTINGS = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "one_thread": {"OMP_NUM_THREADS": "1"}}


def _env(setting: str, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.update(SETTINGS[setting], WANDB_MODE="offline", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def _arms(model: Path, setting: str, n: int, work: Path) -> float:
    """n arms started together; the wall seconds until the last one ends."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, str(ARM), "--model", str(model), "--out", str(work / f"{setting}{i}"),
                               "--callback", "monitor"], env=_env(setting, 29640 + i), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for i in range(n)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"benchmarks.bench_omp_wait: an arm failed under {setting} (exit codes {codes})")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one repeat")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    from tim_plugins import real_model

    model = real_model.smollm2_path()
    seconds: dict[str, dict[str, list[float]]] = {"alone": {s: [] for s in SETTINGS},
                                                  "two_side_by_side": {s: [] for s in SETTINGS}}
    with tempfile.TemporaryDirectory(prefix="tim-bench-omp-") as tmp:
        for _ in range(repeats):
            for setting in SETTINGS:
                seconds["alone"][setting].append(_arms(model, setting, 1, Path(tmp)))
                seconds["two_side_by_side"][setting].append(_arms(model, setting, 2, Path(tmp)))
    stats = {case: {s: spread(xs) for s, xs in by.items()} for case, by in seconds.items()}
    ratios = {case: {s: stats[case][s]["median"] / stats[case]["default"]["median"] for s in SETTINGS}
              for case in stats}
    results = {"what": "one SmolLM2 TRL arm (2 GRPO steps, vLLM colocate) alone and two side by side, per OpenMP "
                       "setting; wall seconds (side by side: until both ended)",
               "cpus": os.cpu_count(), "repeats": repeats, "seconds": seconds, "spread": stats,
               "ratio_to_default": ratios}
    path = write_results("omp_wait_policy", results)
    for case in stats:
        print(case, {s: f"{stats[case][s]['median']:.0f} s ({ratios[case][s]:.2f})" for s in SETTINGS})
    print(path)
    return results


if __name__ == "__main__":
    main()
