"""The mismatch monitor vs verl's own mismatch metric code on the same 256×4096 tensors.

Baseline (verl 0.9.1): ``verl.utils.debug.metrics.calculate_debug_metrics`` (training/rollout_probs_diff_*,
Pearson correlation) + ``compute_rollout_corr_metrics_from_logprobs`` (rollout_corr/kl, k3_kl, chi2, ppl).
Ours: ``MismatchMonitor.update`` + ``compute`` (every tim/* metric incl. histograms, quantiles, buckets),
eager and torch.compile'd. Both get the same fp32 log-probs and the same int64 response mask, as verl has
them. Goal: >= 20× faster.

The candidates are timed in interleaved rounds (verl, ours, verl, ours, ...), so a slow spell of a shared
machine hits all of them; the ratio reported is the ratio of medians. On CUDA a call that returns its metrics
as Python numbers (verl's functions through ``.item()``, ``compute()`` through its wait) is timed to its
return: the GPU work it started is done by then. A call that only queues GPU work (``update()`` alone) is
timed to the end of a device synchronisation. So that a fixed cost of the timing itself does not shrink the
ratio, the synchronisation is not added to the calls that have waited already; the ``*_synced`` entries time
verl and the Triton monitor with one added anyway (how this benchmark timed them before), for comparison.

    python -m benchmarks.bench_metrics [--quick] [--device cuda] [--verl-source DIR] [--tuning JSON]

Runs in the verl environment (``.venv-verl``); ``--verl-source`` takes verl's functions from a copy of its
source files instead, for machines where verl cannot be installed (see ``benchmarks/_verl_baseline.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._common import write_results
from benchmarks._verl_baseline import load_verl_baseline


def _tensors(B: int, T: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 4.0
    train = rollout + 0.02 * torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.9).long()
    return rollout.to(device), train.to(device), mask.to(device)


def _interleaved_medians(candidates: dict, repeats: int, sync, waited: set) -> dict[str, float]:
    """Median seconds per call of each candidate; those in ``waited`` return host numbers (they waited for
    the device themselves) and are timed to their return, the others to the end of a device synchronisation."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            sync()
            t0 = time.perf_counter()
            fn()
            if name not in waited:
                sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _agreement(ours: dict, verl: dict) -> dict[str, list[float]]:
    """The metrics both compute, side by side ([tim, verl]): proof that both measured the same thing."""
    return {
        "kl_k1 vs rollout_corr/kl": [ours["tim/token/kl_k1"], verl["rollout_corr/kl"]],
        "kl_k3 vs rollout_corr/k3_kl": [ours["tim/token/kl_k3"], verl["rollout_corr/k3_kl"]],
        "chi2 vs rollout_corr/chi2_token": [ours["tim/token/chi2"], verl["rollout_corr/chi2_token"]],
        "prob_abs_diff_mean vs training/rollout_probs_diff_mean": [
            ours["tim/token/prob_abs_diff_mean"], verl["training/rollout_probs_diff_mean"]
        ],
        "prob_abs_diff_max vs training/rollout_probs_diff_max": [
            ours["tim/token/prob_abs_diff_max"], verl["training/rollout_probs_diff_max"]
        ],
    }


def _parts(mon, rollout, train, mask) -> dict:
    """The compiled monitor's steps, each alone: where its time goes."""
    import math

    from tim_plugins._mismatch_pass import N_BUCKETS, batch_stats, cell_counts, compiled_batch_stats

    n_sb = mon._layout.n_signed_bins
    args = (rollout, train, mask, None, math.log(mon.ratio_band[0]), math.log(mon.ratio_band[1]), n_sb)
    fused = compiled_batch_stats() if not mon._compile_failed else batch_stats
    cell = fused(*args)[3]
    mon.reset()
    mon.update(rollout, train, mask)
    return {
        "part_fused_pass": lambda: fused(*args),
        "part_cell_counts": lambda: cell_counts(cell, N_BUCKETS * n_sb + 1),
        "part_compute": lambda: mon.compute(sync=False),
    }


def _apply_tuning(overrides: str | None) -> dict:
    """Set the kernel's TUNING from a JSON object of overrides, or "alternates" (the settings the default
    does not use); unknown names are a mistake. Returns the settings used."""
    import json

    from tim_plugins._mismatch_launch import ALTERNATE_OPTIONS, TUNING

    if overrides:
        values = ALTERNATE_OPTIONS if overrides == "alternates" else json.loads(overrides)
        unknown = sorted(set(values) - set(TUNING))
        if unknown:
            raise SystemExit(f"--tuning names {unknown} are not kernel settings: use some of {sorted(TUNING)}")
        TUNING.update(values)
    return dict(TUNING)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--verl-source", default=None,
                        help="a verl package folder to load verl's functions from, instead of importing verl")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the compiled monitor's parts: fused pass, histogram counts, compute()")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (1 gives stable ratios on a shared machine)")
    parser.add_argument("--tuning", default=None,
                        help='CUDA kernel settings over the defaults, as JSON (e.g. \'{"HISTOGRAM": "block"}\'), '
                             'or "alternates" for _mismatch_launch.ALTERNATE_OPTIONS')
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from tim_plugins.metrics import MismatchMonitor

    baseline = load_verl_baseline(args.verl_source)
    device = torch.device(args.device)
    rollout, train, mask = _tensors(args.batch, args.length, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    monitors = {"tim_eager": MismatchMonitor(compile=False), "tim_compiled": MismatchMonitor(compile=True)}
    monitors["tim_compiled"]._triton_failed = True  # the torch.compile path, also on CUDA
    if device.type == "cuda":
        from tim_plugins._optional import is_triton_available

        if is_triton_available():
            monitors["tim_triton"] = MismatchMonitor()  # the CUDA default: one Triton kernel
            tuning = _apply_tuning(args.tuning)

    def ours(mon):
        def run():
            mon.reset()
            mon.update(rollout, train, mask)
            return mon.compute(sync=False)
        return run

    def update_only(mon):
        def run():
            mon.reset()
            mon.update(rollout, train, mask)
        return run

    candidates = {"verl": lambda: baseline.run(rollout, train, mask)}
    candidates.update({name: ours(mon) for name, mon in monitors.items()})
    waited = set(candidates)  # verl and update() + compute() return host numbers
    if device.type == "cuda":
        candidates["verl_synced"] = candidates["verl"]
        if "tim_triton" in monitors:
            candidates["tim_triton_synced"] = candidates["tim_triton"]
    candidates["tim_compiled_update_only"] = update_only(monitors["tim_compiled"])
    if "tim_triton" in monitors:
        candidates["tim_triton_update_only"] = update_only(monitors["tim_triton"])
    if args.breakdown:
        candidates.update(_parts(monitors["tim_compiled"], rollout, train, mask))
    for fn in candidates.values():  # warm-up; the first compiled call compiles
        for _ in range(3):
            fn()
    sync()
    repeats = 7 if args.quick else 21
    seconds = _interleaved_medians(candidates, repeats, sync, waited)

    fastest = "tim_triton" if "tim_triton" in monitors else "tim_compiled"
    results = {
        "shape": [args.batch, args.length],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "verl_functions_from": baseline.origin,
        "repeats": repeats,
        "seconds": seconds,
        "speedup_eager": seconds["verl"] / seconds["tim_eager"],
        "speedup_compiled": seconds["verl"] / seconds["tim_compiled"],
        "compile_fell_back_to_eager": monitors["tim_compiled"]._compile_failed,
        "agreement": _agreement(ours(monitors[fastest])(), baseline.run(rollout, train, mask)),
        "goal": "speedup >= 20",
    }
    if "tim_triton" in monitors:
        results["speedup_triton"] = seconds["verl"] / seconds["tim_triton"]
        # Both timed with a device synchronisation after the call (the timing before this benchmark's fix).
        results["speedup_triton_synced"] = seconds["verl_synced"] / seconds["tim_triton_synced"]
        # update() alone: the per-micro-batch cost, with no host sync (compute() runs once per step).
        results["speedup_triton_update_only"] = seconds["verl"] / seconds["tim_triton_update_only"]
        results["triton_fell_back"] = monitors["tim_triton"]._triton_failed
        results["tuning"] = tuning
    name = "metrics_vs_verl" if device.type == "cpu" else f"metrics_vs_verl_{device.type}"
    path = write_results(name, results)
    t = seconds
    print(f"[{results['device']}] verl {t['verl'] * 1e3:.2f} ms | tim eager {t['tim_eager'] * 1e3:.2f} ms "
          f"({results['speedup_eager']:.1f}x) | tim compiled {t['tim_compiled'] * 1e3:.2f} ms "
          f"({results['speedup_compiled']:.1f}x; update alone {t['tim_compiled_update_only'] * 1e3:.2f} ms)"
          + (f" | tim triton {t['tim_triton'] * 1e3:.3f} ms ({results['speedup_triton']:.1f}x)"
             + f" [{results['speedup_triton_synced']:.1f}x with a synchronisation after each call]"
             if "tim_triton" in t else "")
          + f" -> {path}")
    return results


if __name__ == "__main__":
    main()
