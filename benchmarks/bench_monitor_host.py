"""Host cost of the monitor's CUDA path, measured on any machine: ``reset()`` + ``update()`` + ``compute()``
with the kernel launch stubbed out, so that only the Python the path runs is timed.

    python -m benchmarks.bench_monitor_host [--quick]

On a GPU this host code adds to every call: the kernel starts only once ``update()`` has launched it, and
``compute()`` returns only after its own last steps (``bench_metrics`` times the whole call there). Two
candidates, in interleaved rounds on the same 256×4096 tensors (fp32, bool mask):
- ``plan_first`` (the default): ``update()`` first tries the launch plan of an earlier call with the same key
  (``launch_planned``), before any input check;
- ``checks_first``: ``update()`` as it was before that, input checks first, then the plan (forced by dropping
  the monitor's ``_planned`` before each call).
Each is timed back-to-back (``warm``) and right after an eager metric pass over another batch (``cold``: the
caches then hold other code, as between a training step's kernels). Writes
``benchmarks/results/monitor_host.json``; the ratios are checks-first time / plan-first time.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from benchmarks._common import write_results


@contextlib.contextmanager
def _stubbed_launches():
    """Triton's JIT keeps a stand-in compiled kernel and a launch does nothing: the host path runs as on a
    GPU (plans, keys, arguments), on CPU tensors (device index -1)."""
    import tim_plugins._mismatch_launch as launch

    saved = {name: getattr(launch, name) for name in ("_INTERPRET", "_launch_hooks_set", "_current_device")}
    saved_methods = {name: getattr(launch._FastLauncher, name) for name in ("jit", "launch")}
    launch._INTERPRET = False
    launch._launch_hooks_set = lambda: False
    launch._current_device = lambda: -1
    launch._FastLauncher.jit = lambda self, key, grid, args, num_warps: self.compiled.update({key: "compiled"})
    launch._FastLauncher.launch = lambda self, compiled, device_index, grid, args: None
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(launch, name, value)
        for name, value in saved_methods.items():
            setattr(launch._FastLauncher, name, value)


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

    with _stubbed_launches():
        monitor = MismatchMonitor()
        monitor._use_triton = lambda tensor: True  # the CUDA path, on CPU tensors

        def plan_first():
            monitor.reset()
            monitor.update(rollout, train, mask)
            return monitor.compute(sync=False)

        def checks_first():
            monitor._planned = None  # update() then checks its inputs before triton_update finds the plan
            return plan_first()

        candidates = {"plan_first": plan_first, "checks_first": checks_first}
        for fn in candidates.values():
            for _ in range(5):
                fn()
        if monitor._kernel_scratch.get("plans") is None:
            raise RuntimeError("no launch plan was made: the benchmark would not time the planned path")
        rounds = 300 if args.quick else 2000
        times = {f"{name}_{kind}": [] for name in candidates for kind in ("warm", "cold")}
        for _ in range(rounds):
            for name, fn in candidates.items():
                fn()
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
        "speedup_plan_first_warm": seconds["checks_first_warm"] / seconds["plan_first_warm"],
        "speedup_plan_first_cold": seconds["checks_first_cold"] / seconds["plan_first_cold"],
    }
    write_results("monitor_host", results)
    t = {k: v * 1e6 for k, v in seconds.items()}
    print(f"plan first {t['plan_first_warm']:.1f} / {t['plan_first_cold']:.1f} us (warm / cold), checks first "
          f"{t['checks_first_warm']:.1f} / {t['checks_first_cold']:.1f} us: "
          f"{results['speedup_plan_first_warm']:.2f}x / {results['speedup_plan_first_cold']:.2f}x")
    return results


if __name__ == "__main__":
    main()
