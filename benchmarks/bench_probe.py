"""Overhead of the live parity probe on a monitored step.

Baseline: the per-step mismatch work an adapter does anyway (``MismatchMonitor.update`` + ``compute``) on
B×T log-probs. With probe: the same plus ``ParityProbe.check`` on the computed dict (three thresholds).
Reported: the ratio (with / without) and the probe's own time per check. Goal: ratio <= 1.01.

    python -m benchmarks.bench_probe [--quick]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from benchmarks._common import median_time, write_results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller tensors, fewer repeats")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.length = 16, 256

    from tim_plugins.metrics import MismatchMonitor
    from tim_plugins.parity import ParityProbe

    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(args.batch, args.length, generator=g) * 4.0
    train = rollout + 0.02 * torch.randn(args.batch, args.length, generator=g)
    mask = torch.rand(args.batch, args.length, generator=g) < 0.9
    monitor = MismatchMonitor(compile=False)
    # thresholds the metrics exceed, so every check trips (the slow path: trips recorded and logged)
    probe = ParityProbe(kl_k3_max=1e-6, abs_diff_max=1e-3, seq_log_ratio_abs_max=1e-3, action="warn")
    logging.getLogger("tim_plugins.parity").setLevel(logging.ERROR)  # keep the benchmark output readable

    def step():
        monitor.reset()
        monitor.update(rollout, train, mask)
        return monitor.compute(sync=False)

    step_counter = iter(range(10**9))

    def step_with_probe():
        probe.check(next(step_counter), step())

    metrics = step()
    repeats = 9 if args.quick else 31
    for _ in range(3):  # warm-up
        step_with_probe()
    # Interleaved pairs: both variants see the same machine load (other processes share the CPU).
    base_t, probe_t = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        step_with_probe()
        t2 = time.perf_counter()
        base_t.append(t1 - t0)
        probe_t.append(t2 - t1)
    base, with_probe = statistics.median(base_t), statistics.median(probe_t)
    check_only = median_time(lambda: probe.check(next(step_counter), metrics), repeats=repeats * 20, warmup=5)
    results = {
        "batch": args.batch, "length": args.length, "quick": args.quick,
        "step_s": base, "step_with_probe_s": with_probe, "probe_check_s": check_only,
        # the probe adds exactly one check to a step: this ratio is robust to machine noise
        "overhead_ratio": (base + check_only) / base,
        "measured_pair_ratio": with_probe / base,
        "goal": "overhead_ratio <= 1.01",
    }
    path = write_results("probe", results)
    print(f"step {base * 1e3:.2f} ms, with probe {with_probe * 1e3:.2f} ms (paired ratio {with_probe / base:.3f}); "
          f"probe.check alone {check_only * 1e6:.1f} us → overhead ratio {results['overhead_ratio']:.5f} → {path}")
    return results


if __name__ == "__main__":
    main()
