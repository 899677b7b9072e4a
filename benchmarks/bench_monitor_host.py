"""Host cost of the monitor's CUDA path, measured on any machine: ``reset()`` + ``update()`` + ``compute()``
with the kernel launch stubbed out, so that only the monitor's own Python is timed, today's against c959215's.

    python -m benchmarks.bench_monitor_host [--quick] [--old-ref REF]

On a GPU this host code adds to every call. Two candidates, in interleaved rounds on the same 256×4096 tensors
(fp32, bool mask), each timed back-to-back (``warm``) and right after an eager metric pass over another batch
(``cold``: the caches then hold other code, as between a training step's kernels):
- ``today``: the checks, the path choice and the launch arguments, up to ``_mismatch_kernel[grid](...)`` (stubbed:
  Triton's own launch, its argument binding included, is not timed here; ``bench_metrics`` and
  ``sweep_metrics_kernel`` time whole calls on a GPU);
- ``old``: c959215's path from its launch plan, up to its direct launch past Triton's JIT (stubbed).
Writes ``benchmarks/results/monitor_host.json``; the ratios are old time / today's time.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from benchmarks._common import write_results
from benchmarks._old_monitor import OLD_REF, load_old_monitor
from benchmarks.bench_metrics import monitor_step


class _NoLaunch:
    """Stands in for the Triton kernel: ``kernel[grid](*args, **options)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **options: None


@contextlib.contextmanager
def _stubbed_launches(old_package: str | None):
    import importlib

    import tim_plugins._mismatch_kernel as kernel

    saved = kernel._mismatch_kernel
    kernel._mismatch_kernel = _NoLaunch()
    restore = []
    if old_package is not None:  # as c959215's own benchmark stubbed it
        launch = importlib.import_module(f"{old_package}._mismatch_launch")
        restore = [(launch, name, getattr(launch, name)) for name in ("_INTERPRET", "_launch_hooks_set",
                                                                      "_current_device")]
        restore += [(launch._FastLauncher, name, getattr(launch._FastLauncher, name)) for name in ("jit", "launch")]
        launch._INTERPRET = False
        launch._launch_hooks_set = lambda: False
        launch._current_device = lambda: -1
        launch._FastLauncher.jit = lambda self, key, grid, args, num_warps: self.compiled.update({key: "compiled"})
        launch._FastLauncher.launch = lambda self, compiled, device_index, grid, args: None
    try:
        yield
    finally:
        kernel._mismatch_kernel = saved
        for owner, name, value in restore:
            setattr(owner, name, value)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--old-ref", default=OLD_REF, help="git commit of the monitor to compare with ('' = none)")
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
    old = load_old_monitor(args.old_ref) if args.old_ref else None
    if old is not None:
        monitors["old"] = old.MismatchMonitor()
        monitors["old"]._use_triton = lambda tensor: True
    with _stubbed_launches(old.__package__ if old is not None else None):
        candidates = {name: monitor_step(mon, rollout, train, mask) for name, mon in monitors.items()}
        for fn in candidates.values():
            for _ in range(5):
                fn()
        if old is not None and monitors["old"]._kernel_scratch.get("plans") is None:
            raise RuntimeError("c959215's monitor made no launch plan: its planned path would not be timed")
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
        "old_ref": args.old_ref or None,
        "rounds": rounds,
        "seconds_per_call": seconds,
    }
    if old is not None:
        results["ratio_old_over_today_warm"] = seconds["old_warm"] / seconds["today_warm"]
        results["ratio_old_over_today_cold"] = seconds["old_cold"] / seconds["today_cold"]
    write_results("monitor_host", results)
    print(", ".join(f"{name} {value * 1e6:.1f} us" for name, value in seconds.items())
          + "".join(f"; {k} {v:.2f}" for k, v in results.items() if k.startswith("ratio")))
    return results


if __name__ == "__main__":
    main()
