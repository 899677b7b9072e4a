"""``make bench``: run every benchmark and write one index of ratios.

    python -m benchmarks.run_all [--quick] [--only NAME ...]

Writes ``benchmarks/results/index.json`` (each benchmark's headline ratios, the machine, versions, and the
command that produced them) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks._common import RESULTS_DIR, environment, write_results

# module → (results file, headline keys)
BENCHMARKS = {
    "bench_metrics": ("metrics_vs_verl", ("speedup",)),
    "bench_monitor_host": ("monitor_host", None),
    "bench_by_key": ("by_key", None),
    "bench_safe_vocab": ("safe_vocab", None),
    "ablate_min_p": ("ablate_min_p", ("chosen_min_p",)),
    "bench_trl_step": ("trl_step", None),
    "bench_probe": ("probe", None),
    "study": ("study", ("reference_arm", "wall_seconds")),
    "bench_report": ("report_scaling", None),
    "bench_fused_safe_vocab": ("fused_safe_vocab", None),
    "bench_replay_cost": ("replay_cost", None),
    "bench_weight_sync": ("weight_sync", None),
    "bench_server_probe": ("server_probe", None),
}


def _headline(data: dict, keys) -> dict:
    if keys:
        return {k: data.get(k) for k in keys}
    # Benchmarks report their ratios under keys containing "ratio" or "speedup" (top level or in "ratios").
    out = {k: v for k, v in data.get("ratios", {}).items()} if isinstance(data.get("ratios"), dict) else {}
    out.update({k: v for k, v in data.items() if ("ratio" in k or "speedup" in k) and not isinstance(v, dict)})
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args(argv)
    index = {}
    for name, (result, keys) in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        cmd = [sys.executable, "-m", f"benchmarks.{name}"] + (["--quick"] if args.quick else [])
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        entry = {"command": " ".join(["python", "-m", f"benchmarks.{name}"] + cmd[3:]),
                 "returncode": proc.returncode, "seconds": round(time.time() - t0, 1)}
        # Some benchmarks keep quick results apart (<name>_quick.json); only a file written by this run counts.
        names = [f"{result}_quick", result] if args.quick else [result]
        fresh = [RESULTS_DIR / f"{n}.json" for n in names
                 if (RESULTS_DIR / f"{n}.json").exists() and (RESULTS_DIR / f"{n}.json").stat().st_mtime >= t0]
        path = fresh[0] if fresh else None
        if proc.returncode == 0 and path is not None:
            data = json.loads(path.read_text())
            entry["headline"] = _headline(data, keys)
            entry["goal"] = data.get("goal") or data.get("goals")
        else:
            entry["error"] = (proc.stderr or proc.stdout)[-2000:] or "no results file written by this run"
        index[name] = entry
        shown = entry.get("headline") or entry.get("error", "")[-300:]
        print(f"{name:20s} rc={proc.returncode} {json.dumps(shown, default=str)}")
    write_results("index", {"benchmarks": index, "host": environment()})
    return index


if __name__ == "__main__":
    main()
