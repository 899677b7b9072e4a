"""The mismatch monitor vs verl's own mismatch metric code on the same 256×4096 tensors.

Baseline (verl 0.9.1): ``verl.utils.debug.metrics.calculate_debug_metrics`` (training/rollout_probs_diff_*,
Pearson correlation) + ``compute_rollout_corr_metrics_from_logprobs`` (rollout_corr/kl, k3_kl, chi2, ppl).
Ours: ``MismatchMonitor.update`` + ``compute`` (every tim/* metric incl. histograms, quantiles, buckets),
eager and torch.compile'd. Goal: >= 20× faster. Runs in the verl environment (``.venv-verl``).

    python -m benchmarks.bench_metrics [--quick]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._common import median_time, write_results


def _tensors(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 4.0
    train = rollout + 0.02 * torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.9).long()
    return rollout, train, mask


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (1 gives stable ratios on a shared machine)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_corr_metrics_from_logprobs
    from verl.utils.debug.metrics import calculate_debug_metrics

    from tim_plugins.metrics import MismatchMonitor

    rollout, train, mask = _tensors(args.batch, args.length)
    data = DataProto.from_dict(tensors={
        "rollout_log_probs": rollout, "old_log_probs": train, "response_mask": mask,
        "responses": torch.zeros_like(mask),
    })

    def verl_metrics():
        calculate_debug_metrics(data)
        compute_rollout_corr_metrics_from_logprobs(train, rollout, mask)

    eager = MismatchMonitor(compile=False)
    compiled = MismatchMonitor(compile=True)
    bool_mask = mask.bool()

    def ours(mon):
        def run():
            mon.reset()
            mon.update(rollout, train, bool_mask)
            mon.compute(sync=False)
        return run

    repeats = 5 if args.quick else 15
    t_verl = median_time(verl_metrics, repeats=repeats)
    t_eager = median_time(ours(eager), repeats=repeats)
    t_compiled = median_time(ours(compiled), repeats=repeats, warmup=3)  # first call compiles
    results = {
        "shape": [args.batch, args.length],
        "threads": torch.get_num_threads(),
        "seconds": {"verl": t_verl, "tim_eager": t_eager, "tim_compiled": t_compiled},
        "speedup_eager": t_verl / t_eager,
        "speedup_compiled": t_verl / t_compiled,
        "compile_fell_back_to_eager": compiled._compile_failed,
        "goal": "speedup >= 20",
    }
    path = write_results("metrics_vs_verl", results)
    print(f"verl {t_verl * 1e3:.1f} ms | tim eager {t_eager * 1e3:.1f} ms ({results['speedup_eager']:.1f}x) | "
          f"tim compiled {t_compiled * 1e3:.1f} ms ({results['speedup_compiled']:.1f}x) -> {path}")
    return results


if __name__ == "__main__":
    main()
