"""Cost of replaying the engine's kept set (``tim_plugins.replay``) against recomputing the truncation on the
trainer's logits (``tim_plugins.safe_vocab``), same run, CPU.

    python -m benchmarks.bench_replay_cost [--tokens 1024] [--vocab 151936] [--top-k 20] [--top-p 0.8]
                                           [--repeats 5] [--quick]

Arms, forward + backward of Σ g·logp from fp32 logits [N, V] (the logits path; the hidden-state path runs the same
folds around its GEMMs):
  full        ``safe_logprobs_from_logits`` with nothing cut (the plain log-softmax's cost in the same folds)
  recompute   ``safe_logprobs_from_logits(top_k, top_p)``: the sampler's rule recomputed per row
  replay      ``replay_logprobs_from_logits`` over kept sets of the same sizes (vLLM's sets: top_k bounds them)
and the host-side packing of one id list per token (``KeptSets.from_lists``, what the vLLM converter calls).
Reports median times, their ratios to ``recompute``, and the packed layout's bytes against a dense [N, V] bool
mask. ``benchmarks/results/replay_cost.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks._common import spread, write_results
from tim_plugins.replay import KeptSets, replay_logprobs_from_logits
from tim_plugins.safe_vocab import safe_logprobs_from_logits
from tim_plugins.truncation import Truncation, truncation_threshold


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.repeats = 64, 5003, 2
    n, v = args.tokens, args.vocab
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=gen) * 3
    trunc = Truncation(top_k=args.top_k, top_p=args.top_p)
    tau = truncation_threshold(logits, trunc)
    # the engine's sets: the trainer's own (same logits here), as id lists — what vLLM hands out per token
    lists = [(row >= t).nonzero().squeeze(-1).tolist() for row, t in zip(logits, tau)]
    tokens = torch.tensor([ids[0] for ids in lists])
    g = torch.randn(n, generator=gen)

    t0 = time.perf_counter()
    kept = KeptSets.from_lists(lists)
    pack_s = time.perf_counter() - t0

    def step(fn):
        x = logits.clone().requires_grad_()
        t = time.perf_counter()
        (fn(x).logprobs * g).sum().backward()
        return time.perf_counter() - t

    arms = {
        "full": lambda x: safe_logprobs_from_logits(x, tokens, min_p=0.0),
        "recompute": lambda x: safe_logprobs_from_logits(x, tokens, min_p=0.0, top_k=args.top_k, top_p=args.top_p),
        "replay": lambda x: replay_logprobs_from_logits(x, tokens, kept),
    }
    step(arms["replay"])  # warm-up
    times = {a: [] for a in arms}
    loads = []
    for rep in range(args.repeats):
        loads.append(os.getloadavg()[0])
        for a in (arms if rep % 2 == 0 else dict(reversed(list(arms.items())))):
            times[a].append(step(arms[a]))
    # the two sets agree here (same logits): replay and recompute give the same values
    same = torch.equal(replay_logprobs_from_logits(logits, tokens, kept).logprobs,
                       safe_logprobs_from_logits(logits, tokens, min_p=0.0, top_k=args.top_k,
                                                 top_p=args.top_p).logprobs)
    med = {a: statistics.median(ts) for a, ts in times.items()}
    packed_bytes = kept.ids.numel() * kept.ids.element_size() + kept.offsets.numel() * kept.offsets.element_size()
    results = {
        "tokens": n, "vocab": v, "top_k": args.top_k, "top_p": args.top_p, "repeats": args.repeats,
        "loss": "sum(g * logp), forward + backward, fp32 logits",
        "seconds": {a: spread(ts) for a, ts in times.items()},
        "ratio_replay_vs_recompute": med["replay"] / med["recompute"],
        "ratio_replay_vs_full": med["replay"] / med["full"],
        "ratio_recompute_vs_full": med["recompute"] / med["full"],
        "pack_from_lists_seconds": pack_s,
        "kept_size_mean": float(kept.sizes.double().mean()),
        "packed_bytes": packed_bytes, "dense_bool_mask_bytes": n * v,
        "replay_equals_recompute_on_the_same_logits": same,
        "loadavg_1min_per_repeat": loads,
    }
    path = write_results("replay_cost_quick" if args.quick else "replay_cost", results, args.out)
    print({k: results[k] for k in ("ratio_replay_vs_recompute", "ratio_replay_vs_full", "ratio_recompute_vs_full",
                                    "packed_bytes", "dense_bool_mask_bytes", "pack_from_lists_seconds")}, path)


if __name__ == "__main__":
    main()
