"""The mismatch monitor vs verl's own mismatch metric code, on the same 256×4096 tensors.

Baseline (verl 0.9.1): ``verl.utils.debug.metrics.calculate_debug_metrics`` (training/rollout_probs_diff_*,
Pearson correlation) + ``compute_rollout_corr_metrics_from_logprobs`` (rollout_corr/kl, k3_kl, chi2, ppl).
Ours: ``MismatchMonitor.reset`` + ``update`` + ``compute`` (every tim/* metric incl. histograms, quantiles,
buckets), eager and torch.compile'd, and on CUDA the Triton kernel (the default there). All get the same fp32
log-probs and the same int64 response mask, as verl has them. Goal: on a GPU the default path >= 10x faster than
verl (on the CPU the ratios are reported, no goal).

The candidates are timed in interleaved rounds (verl, ours, verl, ours, ...), so a slow spell of a shared
machine hits all of them; the ratio reported is the ratio of medians. A call that returns Python numbers (verl's
functions through ``.item()``, ``compute()``) is timed to its return: the GPU work it started is done by then.
``update()`` alone only queues GPU work: it is timed to the end of a device synchronisation.

    python -m benchmarks.bench_metrics [--quick] [--device cuda] [--verl-source DIR]

``--verl-source`` takes verl's functions from a copy of its source files instead of the installed verl, for
machines where verl cannot be installed (see ``benchmarks/_verl_baseline.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._common import write_results
from benchmarks._verl_baseline import load_verl_baseline
from tim_plugins.metrics import MismatchMonitor


def _tensors(B: int, T: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 4.0
    train = rollout + 0.02 * torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.9).long()
    return rollout.to(device), train.to(device), mask.to(device)


def monitor_step(mon, rollout, train, mask):
    """A call of ``reset()`` + ``update()`` + ``compute()``: a training step's use of the monitor."""
    def run():
        mon.reset()
        mon.update(rollout, train, mask)
        return mon.compute(sync=False)
    return run


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


def _parts(rollout, train, mask) -> dict:
    """The compiled torch pass's steps, each alone: where its time goes."""
    import math

    from tim_plugins._mismatch_layout import N_BUCKETS, N_SIGNED_BINS
    from tim_plugins._mismatch_pass import _compiled_token_pass, cell_counts

    band = (math.log(0.5), math.log(2.0))
    fused = _compiled_token_pass()
    cell = fused(rollout, train, mask, None, *band)[1]
    mon = MismatchMonitor(compile=True).update(rollout, train, mask)
    return {
        "part_fused_pass": lambda: fused(rollout, train, mask, None, *band),
        "part_cell_counts": lambda: cell_counts(cell, N_BUCKETS * N_SIGNED_BINS + 1),
        "part_compute": lambda: mon.compute(sync=False),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--verl-source", default=None,
                        help="a verl package folder to load verl's functions from, instead of importing verl")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the compiled pass's parts: fused pass, histogram counts, compute()")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for all candidates (1 gives stable ratios on a shared machine)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    baseline = load_verl_baseline(args.verl_source)
    device = torch.device(args.device)
    rollout, train, mask = _tensors(args.batch, args.length, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    monitors = {"tim_eager": MismatchMonitor(compile=False), "tim_compiled": MismatchMonitor(compile=True)}
    monitors["tim_compiled"]._kernel_failed = True  # the torch.compile path, also on CUDA
    if device.type == "cuda":
        monitors["tim_kernel"] = MismatchMonitor()  # the CUDA default: one Triton kernel

    def ours(mon):
        return monitor_step(mon, rollout, train, mask)

    def update_only(mon):
        def run():
            mon.reset()
            mon.update(rollout, train, mask)
        return run

    candidates = {"verl": lambda: baseline.run(rollout, train, mask)}
    candidates.update({name: ours(mon) for name, mon in monitors.items()})
    waited = set(candidates)  # verl and update() + compute() return host numbers
    fastest = "tim_kernel" if device.type == "cuda" else "tim_compiled"
    candidates[f"{fastest}_update_only"] = update_only(monitors[fastest])
    if args.breakdown:
        candidates.update(_parts(rollout, train, mask))
    for fn in candidates.values():  # warm-up; the first compiled call compiles
        for _ in range(3):
            fn()
    sync()
    repeats = 7 if args.quick else 21
    seconds = _interleaved_medians(candidates, repeats, sync, waited)

    # Whether a candidate ran another path than its name says (a compiler or kernel failure).
    fell_back = {name: mon._compile_failed for name, mon in monitors.items() if name.endswith("compiled")}
    if device.type == "cuda":
        fell_back["tim_kernel"] = monitors["tim_kernel"]._kernel_failed
    results = {
        "shape": [args.batch, args.length],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "verl_functions_from": baseline.origin,
        "repeats": repeats,
        "seconds": seconds,
        "fell_back": fell_back,
        # verl's time / ours, per candidate of ours
        "speedup": {name: seconds["verl"] / seconds[name] for name in candidates if name != "verl"},
        "agreement": _agreement(ours(monitors[fastest])(), baseline.run(rollout, train, mask)),
        "goals": {"cuda: tim_kernel vs verl": ">= 10"},
    }
    name = "metrics_vs_verl" if device.type == "cpu" else f"metrics_vs_verl_{device.type}"
    path = write_results(name, results)
    print(f"[{results['device']}] verl {seconds['verl'] * 1e3:.3f} ms; "
          + "; ".join(f"{n} {seconds[n] * 1e3:.3f} ms ({results['speedup'][n]:.1f}x)" for n in results["speedup"])
          + f" -> {path}")
    return results


if __name__ == "__main__":
    main()
