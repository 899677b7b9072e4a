"""Launch shapes and options of the monitor's CUDA kernel, swept on the GPU at hand: how
``_mismatch_launch.TUNING`` was chosen, and how to re-choose it for another GPU.

For each setting (BLOCK, ITERS, num_warps, REPLICAS; HISTOGRAM "global" or "block"; DEVICE_METRICS; WAIT) and
batch (256×4096, then the three best also at 8×32768 and 1024×1024): the kernel's GPU time (torch profiler),
``update()`` and ``update()`` + ``compute()`` wall time (medians, each call ending in a device
synchronisation), and whether its metrics equal the eager torch pass (relative 1e-5). Then, for the fastest correct shape, where a call's time goes: Python alone (launch
stubbed out), the launch through Triton's JIT vs the direct launcher, and ``compute()``.

    python -m benchmarks.sweep_metrics_kernel

Needs a CUDA GPU and Triton; writes ``benchmarks/results/metrics_kernel_sweep_cuda.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._common import write_results

_SHAPES = (
    # The default first; then launch shapes and histogram copies around it; then the alternate options.
    dict(BLOCK=256, ITERS=8, num_warps=4, REPLICAS=64), dict(BLOCK=256, ITERS=16, num_warps=8, REPLICAS=64),
    dict(BLOCK=512, ITERS=8, num_warps=8, REPLICAS=64), dict(BLOCK=1024, ITERS=2, num_warps=8, REPLICAS=64),
    dict(BLOCK=256, ITERS=8, num_warps=4, REPLICAS=32), dict(BLOCK=256, ITERS=8, num_warps=4, REPLICAS=128),
    dict(BLOCK=256, ITERS=8, num_warps=4, REPLICAS=64, DEVICE_METRICS=False),
    dict(BLOCK=256, ITERS=8, num_warps=4, REPLICAS=64, WAIT="device"),
    # No BLOCK=1024 with the block histogram: ptxas gives it 168 registers a thread at 8 warps.
    dict(BLOCK=256, ITERS=8, num_warps=4, REPLICAS=4, HISTOGRAM="block"),
)


def _median_us(fn, n: int = 60) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _kernel_us(mon, batch, n: int = 20) -> float:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        mon.update(*batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            mon.update(*batch)
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if "mismatch" in e.key) / n


def _differences(got: dict, want: dict, rtol: float = 1e-5) -> list:
    bad = []
    for key, y in want.items():
        x = got[key]
        if not (x == y or (x != x and y != y) or abs(x - y) <= rtol * abs(y) + 1e-9):
            bad.append([key, x, y])
    return bad


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sweep_metrics_kernel needs a CUDA GPU")
    import tim_plugins._mismatch_launch as kernels
    from benchmarks.bench_metrics import _tensors
    from tim_plugins.metrics import MismatchMonitor

    batches = {name: _tensors(*shape, "cuda") for name, shape in
               (("256x4096", (256, 4096)), ("8x32768", (8, 32768)), ("1024x1024", (1024, 1024)))}
    eager = {name: MismatchMonitor(compile=False).update(*b).compute() for name, b in batches.items()}
    default = dict(kernels.TUNING)
    rows = []

    def measure(shape: dict, names) -> dict:
        kernels.TUNING.clear()
        kernels.TUNING.update({**default, **shape})
        row = {"tuning": dict(kernels.TUNING)}
        for name in names:
            mon = MismatchMonitor()
            got = mon.update(*batches[name]).compute()
            if mon._triton_failed:
                row[name] = {"failed": True}
                continue

            def full(mon=mon, batch=batches[name]):
                mon.reset()
                mon.update(*batch)
                return mon.compute(sync=False)

            def update(mon=mon, batch=batches[name]):
                mon.reset()
                mon.update(*batch)

            row[name] = {"full_us": _median_us(full), "update_us": _median_us(update),
                         "kernel_us": _kernel_us(mon, batches[name]),
                         "differs_from_eager": _differences(got, eager[name])[:3], "failed": False}
        print(row, flush=True)
        rows.append(row)
        return row

    for shape in _SHAPES:
        measure(shape, ["256x4096"])

    def correct(row):
        return "full_us" in row.get("256x4096", {}) and not row["256x4096"]["differs_from_eager"]

    ranked = sorted(filter(correct, rows), key=lambda row: row["256x4096"]["full_us"])
    if not ranked:  # keep every row's failure or difference on record: a GPU session has no second try
        kernels.TUNING.clear()
        kernels.TUNING.update(default)
        path = write_results("metrics_kernel_sweep_cuda", {
            "device": torch.cuda.get_device_name(), "default_tuning": default, "best_tuning": None, "shapes": rows,
        })
        print(f"no setting both ran and matched the eager pass -> {path}")
        return {"best_tuning": None, "shapes": rows}
    for row in ranked[:3]:
        measure(row["tuning"], ["8x32768", "1024x1024"])
    best = ranked[0]["tuning"]

    # Where one call's time goes, with the fastest shape.
    kernels.TUNING.clear()
    kernels.TUNING.update(best)
    batch = batches["256x4096"]
    mon = MismatchMonitor()
    mon.update(*batch)
    launcher = mon._kernel_scratch["launcher"]

    def fresh_update():
        mon.reset()
        mon.update(*batch)

    tiny = _tensors(1, 16, "cuda")
    parts = {"direct_launch_enabled": launcher.enabled, "synchronize_only_us": _median_us(lambda: None),
             "kernel_1x16_us": _kernel_us(MismatchMonitor(), tiny),  # the fixed cost: tickets, fold, metrics
             "compute_only_us": _median_us(lambda: mon.compute(sync=False))}
    launch = type(launcher).launch
    type(launcher).launch = lambda self, *args, **kwargs: None
    try:
        parts["update_python_only_us"] = _median_us(fresh_update)
    finally:
        type(launcher).launch = launch
    hooks_set = kernels._launch_hooks_set
    kernels._launch_hooks_set = lambda: True  # every launch through Triton's JIT
    try:
        parts["update_jit_launch_us"] = _median_us(fresh_update)
    finally:
        kernels._launch_hooks_set = hooks_set
    parts["update_direct_launch_us"] = _median_us(fresh_update)
    kernels.TUNING.clear()
    kernels.TUNING.update(default)

    results = {"device": torch.cuda.get_device_name(), "default_tuning": default, "best_tuning": best,
               "shapes": rows, "parts_of_a_call_256x4096": parts}
    path = write_results("metrics_kernel_sweep_cuda", results)
    print(f"best {best} -> {path}")
    return results


if __name__ == "__main__":
    main()
