"""Host cost of the monitor's CUDA path, measured on any machine: ``reset()`` + ``update()`` + ``compute()``
with the kernel launch stubbed out, so that only the monitor's own Python is timed.

    python -m benchmarks.bench_monitor_host [--quick]

On a GPU this host code adds to every call, in microseconds per call: compare them with the kernel's GPU time
and Triton's own launch (``bench_metrics`` and ``sweep_metrics_kernel`` time whole calls on a GPU). On the same
256×4096 tensors (fp32, bool mask), each call is timed back-to-back (``warm``) and right after an eager metric
pass over another batch (``cold``: the caches then hold other code, as between a training step's kernels): the
checks, the path choice and the launch arguments, up to ``_mismatch_kernel[grid](...)`` (stubbed: Triton's own
launch, its argument binding included, is not timed here). Writes ``benchmarks/results/monitor_host.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from benchmarks._common import write_results
from benchmarks.bench_metrics import monitor_step


class _NoLaunch:
    """Stands in for the Triton kernel: ``kernel[grid](*args, **options)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **options: None


@contextlib.contextmanager
def _stubbed_launch():
    import tim_plugins._mismatch_kernel as kernel

    saved = kernel._mismatch_kernel
    kernel._mismatch_kernel = _NoLaunch()
    try:
        yield
    finally:
        kernel._mismatch_kernel = saved


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    from tim_plugins.metrics import MismatchMonitor

    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(256, 4096, generator=g)
    train = rollout + 0.01 * torch.randn(256, 4096, generator=g)
    mask = torch.rand(256, 4096, generator=g) < 0.9
    other = tuple(x[:8, :256].clone() for x in (rollout, train, mask))
    eager = MismatchMonitor(compile=False)

    def other_code():
        eager.reset()
        eager.update(*other).compute(sync=False)

    monitors = {"today": MismatchMonitor()}
    monitors["today"]._path = lambda device: "kernel"  # the CUDA path, on CPU tensors
    with _stubbed_launch():
        candidates = {name: monitor_step(mon, rollout, train, mask) for name, mon in monitors.items()}
        for fn in candidates.values():
            for _ in range(5):
                fn()
        rounds = 300 if args.quick else 2000
        times = {f"{name}_{kind}": [] for name in candidates for kind in ("warm", "cold")}
        for _ in range(rounds):
            for name, fn in candidates.items():
                fn()
                t0 = time.perf_counter()
                fn()
                times[f"{name}_warm"].append(time.perf_counter() - t0)
                other_code()
                t0 = time.perf_counter()
                fn()
                times[f"{name}_cold"].append(time.perf_counter() - t0)
    seconds = {name: statistics.median(ts) for name, ts in times.items()}
    results = {
        "what": "reset() + update() + compute() of the CUDA path, launch stubbed, 256x4096 fp32, bool mask",
        "rounds": rounds,
        "seconds_per_call": seconds,
    }
    write_results("monitor_host", results)
    print(", ".join(f"{name} {value * 1e6:.1f} us" for name, value in seconds.items()))
    return results


if __name__ == "__main__":
    main()
