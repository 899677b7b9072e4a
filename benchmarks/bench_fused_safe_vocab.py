"""The chunked safe-vocab head (``tim_plugins.safe_vocab.safe_linear_logprobs``) against verl's own fused torch
backend (``FusedLinearForPPO``, verl/utils/experimental/torch_functional.py), forward + backward, CPU.

    python -m benchmarks.bench_fused_safe_vocab [--tokens 4096 16384] [--hidden 896 3584] [--repeats 3]
                                                [--arms verl full min_p top_k_top_p] [--quick]

Arms (each the log-probs and entropy of the labels from hidden [N, H] and an lm_head weight [V, H], V = 151,936,
fp32, loss Σ g·logp (verl's default entropy_coeff = 0), backward to hidden and weight):
  verl          verl 0.9.1's FusedLinearForPPOFunction with its default chunk (512 rows), as
                ``forward_with_torch_backend`` calls it; loaded by path from the installed verl (plain torch code)
  full          ours with nothing cut (the same distribution as verl's)
  min_p         ours at the default safe-vocabulary min_p (1e-5)
  top_k_top_p   ours with top_k = 20, top_p = 0.8 (vLLM's order)

Each run is a fresh subprocess: peak memory = the process's RSS high-water mark (``ru_maxrss``) after the step
minus the one after allocating the inputs (torch's CPU allocations are not seen by tracemalloc); time = the
step's wall time. Arms are interleaved per repeat (the machine is shared: the load average is recorded per run).
Results: ``benchmarks/results/fused_safe_vocab.json`` with, per shape, each arm's runs and the ratios
ours / verl (median time, median peak memory).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 151_936
ARMS = ("verl", "full", "min_p", "top_k_top_p")


def _verl_fused():
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("verl is not installed: the baseline arm needs verl's torch_functional.py")
    path = Path(list(spec.submodule_search_locations)[0]) / "utils" / "experimental" / "torch_functional.py"
    mod_spec = importlib.util.spec_from_file_location("_verl_fused_torch_functional", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_one(arm: str, n: int, hdim: int, vocab: int, seed: int = 0) -> dict:
    """One forward + backward of ``arm`` in this process (call it in a fresh one)."""
    import torch

    from tim_plugins.safe_vocab import DEFAULT_MIN_P, safe_linear_logprobs
    from tim_plugins.truncation import Truncation

    verl = _verl_fused() if arm == "verl" else None
    gen = torch.Generator().manual_seed(seed)
    # allocated in their dtype directly and scaled in place: a temporary copy would lift the baseline's
    # high-water mark and hide that much of the step's peak
    hidden = torch.randn(n, hdim, generator=gen).requires_grad_()
    weight = torch.randn(vocab, hdim, generator=gen).mul_(hdim ** -0.5).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    g = torch.randn(n, generator=gen)
    trunc = {"full": Truncation(), "min_p": Truncation(min_p=DEFAULT_MIN_P),
             "top_k_top_p": Truncation(top_k=20, top_p=0.8)}.get(arm)
    # warm the GEMM and elementwise kernels on a small problem (thread pools, first-call allocations)
    small = torch.randn(8, hdim) @ torch.randn(hdim, 64)
    del small
    base = _rss_peak_bytes()
    load = os.getloadavg()
    t0 = time.perf_counter()
    if verl is not None:
        logp, ent = verl.FusedLinearForPPOFunction.apply(hidden, weight, labels, 1.0, 512)
    else:
        out = safe_linear_logprobs(hidden, weight, labels, trunc, compute_entropy=True)
        logp, ent = out.logprobs, out.entropy
    t1 = time.perf_counter()
    (logp * g).sum().backward()
    t2 = time.perf_counter()
    return {"arm": arm, "tokens": n, "hidden": hdim, "vocab": vocab, "seconds": t2 - t0, "forward_s": t1 - t0,
            "backward_s": t2 - t1, "peak_bytes": _rss_peak_bytes() - base, "baseline_rss_bytes": base,
            "loadavg_start": load, "loadavg_end": os.getloadavg(),
            "logp_sum": float(logp.detach().double().sum()), "entropy_mean": float(ent.detach().double().mean())}


def _spawn(arm: str, n: int, hdim: int, vocab: int, threads: int | None) -> dict:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "benchmarks.bench_fused_safe_vocab", "--one", arm, str(n), str(hdim), str(vocab)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        return {"arm": arm, "tokens": n, "hidden": hdim, "error": (proc.stderr or proc.stdout)[-2000:],
                "returncode": proc.returncode}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict], arms: tuple[str, ...]) -> dict:
    ok = [r for r in runs if "error" not in r]
    by_arm = {a: [r for r in ok if r["arm"] == a] for a in arms}
    out = {}
    for a, rs in by_arm.items():
        if rs:
            out[a] = {"seconds_median": statistics.median(r["seconds"] for r in rs),
                      "seconds": [r["seconds"] for r in rs],
                      "peak_mib_median": statistics.median(r["peak_bytes"] for r in rs) / 2**20,
                      "peak_mib": [r["peak_bytes"] / 2**20 for r in rs], "runs": len(rs)}
    ratios = {}
    if "verl" in out:
        for a in arms:
            if a != "verl" and a in out:
                # time: medians, and the fastest runs (the least disturbed by the shared machine's other jobs)
                ratios[a] = {"time": out[a]["seconds_median"] / out["verl"]["seconds_median"],
                             "time_min": min(out[a]["seconds"]) / min(out["verl"]["seconds"]),
                             "memory": out[a]["peak_mib_median"] / out["verl"]["peak_mib_median"]}
    # the arms computed the same quantities on the same inputs: full vs verl agree (a sanity check of the harness)
    check = {}
    if by_arm.get("verl") and by_arm.get("full"):
        check["full_vs_verl_logp_sum_rel"] = abs(by_arm["full"][0]["logp_sum"] - by_arm["verl"][0]["logp_sum"]) / \
            abs(by_arm["verl"][0]["logp_sum"])
    return {"arms": out, "ratios_vs_verl": ratios, "check": check}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--hidden", type=int, nargs="+", default=[896])
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the runs (default: torch's)")
    ap.add_argument("--max-peak-gib", type=float, default=5.0,
                    help="skip a shape whose estimated peak (inputs, grads, verl's extra weight-gradient copy and "
                         "chunk temporaries) exceeds this")
    ap.add_argument("--quick", action="store_true", help="a small shape, one repeat (a smoke test)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", nargs=4, metavar=("ARM", "N", "H", "V"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        arm, n, h, v = args.one
        print(json.dumps(run_one(arm, int(n), int(h), int(v))))
        return
    if args.quick:
        args.tokens, args.hidden, args.vocab, args.repeats = [256], [64], 20_011, 1
    arms = tuple(args.arms)
    shapes, skipped = [], []
    for h in args.hidden:
        for n in args.tokens:
            # weight + its gradient + verl's per-chunk weight-gradient copy, + ~6 fp32 [512, V] chunk temporaries
            est = (3 * args.vocab * h + 6 * 512 * args.vocab + 4 * n * h) * 4 / 2**30
            (shapes if est <= args.max_peak_gib else skipped).append((n, h, round(est, 2)))
    results = {"vocab": args.vocab, "dtype": "float32", "repeats": args.repeats, "loss": "sum(g * logp)",
               "verl_chunk_rows": 512, "skipped_shapes": [{"tokens": n, "hidden": h, "estimated_peak_gib": e,
                                                            "why": f"over --max-peak-gib {args.max_peak_gib}"}
                                                           for n, h, e in skipped],
               "shapes": {}}
    from benchmarks._common import write_results

    for n, h, _ in shapes:
        runs = []
        for rep in range(args.repeats):
            order = arms if rep % 2 == 0 else tuple(reversed(arms))
            for arm in order:
                r = _spawn(arm, n, h, args.vocab, args.threads)
                runs.append(r)
                msg = r.get("error", "").splitlines()[-1:] if "error" in r else \
                    f"{r['seconds']:.1f}s peak {r['peak_bytes'] / 2**20:.0f} MiB load {r['loadavg_start'][0]:.1f}"
                print(f"N={n} H={h} rep {rep} {arm}: {msg}", flush=True)
                # after each run: a stopped benchmark keeps what it measured
                results["shapes"][f"N{n}_H{h}"] = {"tokens": n, "hidden": h, **summarise(runs, arms), "runs": runs,
                                                   "complete": False}
                write_results("fused_safe_vocab_quick" if args.quick else "fused_safe_vocab", results, args.out)
        key = f"N{n}_H{h}"
        results["shapes"][key] = {"tokens": n, "hidden": h, **summarise(runs, arms), "runs": runs, "complete": True}
        print(key, json.dumps(results["shapes"][key]["ratios_vs_verl"]), flush=True)
        write_results("fused_safe_vocab_quick" if args.quick else "fused_safe_vocab", results, args.out)  # after each shape: nothing lost if stopped
    write_results("fused_safe_vocab_quick" if args.quick else "fused_safe_vocab", results, args.out)


if __name__ == "__main__":
    main()
