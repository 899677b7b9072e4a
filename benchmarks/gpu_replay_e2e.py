"""Replay end to end, where vLLM can return its kept sets (Model Runner V2: a CUDA build of vLLM): what the CPU suite
cannot run. vLLM samples with ``return_sampling_mask=True`` and processed log-probs at the user's top_k / top_p; an
HF trainer model (the same weights, fp32 by default) scores the same tokens; per generated token the trainer's
log-prob is taken three ways against vLLM's:

* ``full``       the whole vocabulary (what a trainer without the safe vocabulary compares: ratio ~ the kept mass);
* ``recompute``  the sampler's cut recomputed on the trainer's logits (``tim_plugins.safe_vocab``): boundary tokens
                 where the two sides' logits straddle the cut;
* ``replay``     renormalised over vLLM's own kept set (``tim_plugins.replay``): no boundary token by construction.

Writes one JSON (per mode: tokens, mean ratio exp(trainer − vLLM), k3, mean / max |Δ|, boundary fraction, mean |S|);
exits 1 when a check fails (replay has a boundary token, or its ratio is not closer to 1 than the full vocabulary's).

    python -m benchmarks.gpu_replay_e2e OUT.json [--model DIR] [--top-k 20] [--top-p 0.8] [--prompts 16]

``--model``: a local HF model folder (default: the toy model, built on the spot: no hub access needed). With
``--cpu`` it is a dry run on vLLM's CPU build, which refuses ``return_sampling_mask``: the kept sets are then the
sampler's rule recomputed in float64 on the trainer's logits (with the sampled token, which vLLM's set always holds),
so everything but vLLM's mask itself runs, and with fp32 on both sides replay and recompute read ~1. Results of a
lent device go to ``benchmarks/results/replay_e2e_cuda.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

__all__ = ["analyze", "main"]

MODES = ("full", "recompute", "replay")


def _metrics(trainer: torch.Tensor, engine: torch.Tensor, in_set: torch.Tensor | None, sizes: torch.Tensor) -> dict:
    """The monitor's own token metrics (``tim_plugins.metrics.mismatch_metrics``, float64) over the tokens in the
    trainer's set (all tokens when ``in_set`` is None), with the boundary fraction and the mean |S|."""
    from tim_plugins.metrics import mismatch_metrics

    keep = torch.ones_like(trainer, dtype=torch.bool) if in_set is None else in_set
    n = int(trainer.numel())
    m = mismatch_metrics(engine[None], trainer[None], keep[None])
    return {"tokens": n, "measured": int(keep.sum()),
            "boundary_frac": 0.0 if in_set is None else float((~in_set).sum()) / max(n, 1),
            **{k: m[f"tim/token/{k}"] for k in ("ratio_mean", "kl_k3", "abs_diff_mean", "abs_diff_max")},
            "size_mean": float(sizes.double().mean()) if sizes.numel() else math.nan}


def analyze(samples: list[dict], trunc, temperature: float) -> dict:
    """Per mode, the trainer's log-probs of every generated token against the engine's.

    Args:
        samples: one dict per completion: ``rows`` [n, V] the trainer's logits predicting each generated token (not
            divided by the temperature), ``tokens`` [n], ``engine_logprobs`` [n] (the engine's processed log-probs),
            ``kept`` (``tim_plugins.replay.KeptSets``, n rows: the engine's kept sets).
        trunc: the sampler's rule (``tim_plugins.truncation.Truncation``, temperature included).
        temperature: the sampling temperature.
    """
    from tim_plugins.replay import replay_logprobs_from_logits
    from tim_plugins.safe_vocab import safe_logprobs_from_logits

    out: dict[str, list] = {m: [] for m in MODES}
    for s in samples:
        rows, tokens = s["rows"].float(), s["tokens"].long()
        engine = s["engine_logprobs"].double()
        full = torch.log_softmax(rows.double() / temperature, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        rec = safe_logprobs_from_logits(rows, tokens, min_p=trunc.min_p, temperature=temperature, top_p=trunc.top_p,
                                        top_k=trunc.top_k, order=trunc.order)
        rep = replay_logprobs_from_logits(rows, tokens, s["kept"], temperature=temperature)
        vocab = torch.full_like(tokens, rows.shape[1])
        out["full"].append((full, engine, None, vocab))
        out["recompute"].append((rec.logprobs.double(), engine, rec.in_safe, rec.size))
        out["replay"].append((rep.logprobs.double(), engine, rep.in_safe, rep.size))
    result = {}
    for mode, parts in out.items():
        trainer, engine, in_set, sizes = (torch.cat([p[i] for p in parts]) if parts and parts[0][i] is not None
                                          else None for i in range(4))
        result[mode] = _metrics(trainer, engine, in_set, sizes)
    return result


def _kept_sets_on_cpu(rows: torch.Tensor, tokens: torch.Tensor, trunc, temperature: float):
    """The dry run's stand-in for vLLM's mask: the rule in float64 on the trainer's logits, with the sampled token
    (which vLLM's set always holds)."""
    from tim_plugins.replay import KeptSets
    from tim_plugins.truncation import truncation_threshold

    z = rows.double() / temperature
    keep = z >= truncation_threshold(z, trunc)[:, None]
    keep[torch.arange(len(z)), tokens] = True
    return KeptSets.from_lists([torch.nonzero(k).reshape(-1).tolist() for k in keep])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_replay_e2e")
    ap.add_argument("out")
    ap.add_argument("--model", default=None, help="local HF model folder (default: the toy model)")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (the trainer scores in fp32)")
    ap.add_argument("--cpu", action="store_true", help="a dry run on vLLM's CPU build (no mask: see the docstring)")
    args = ap.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_replay_e2e: no CUDA device (--cpu: a dry run on vLLM's CPU build)", file=sys.stderr)
        return 1
    if args.top_k <= 0 or args.temperature <= 0:
        ap.error("vLLM returns kept sets only with --top-k > 0 and --temperature > 0")

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from tim_plugins.integrations.vllm.sampling_mask import kept_sets_from_completion
    from tim_plugins.toy_model import build_toy_model, synthetic_prompts
    from tim_plugins.truncation import Truncation

    model_path = args.model or str(build_toy_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [tokenizer(p)["input_ids"] for p in synthetic_prompts(args.prompts, seed=0)]
    engine_args = dict(model=model_path, dtype=args.dtype, logprobs_mode="processed_logprobs", enforce_eager=True,
                       max_model_len=256, seed=0)
    if args.cpu:
        engine_args["dtype"] = "float32"
    else:
        engine_args.update(return_sampling_mask=True, gpu_memory_utilization=0.3)
    llm = LLM(**engine_args)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, logprobs=0, seed=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    trunc = Truncation(top_k=args.top_k, top_p=args.top_p, temperature=args.temperature)
    samples = []
    for prompt, out in zip(prompts, outputs):
        comp = out.outputs[0]
        tokens = torch.tensor(list(comp.token_ids), dtype=torch.long)
        if tokens.numel() == 0:
            continue
        ids = torch.tensor(prompt + tokens.tolist(), device=device)[None]
        with torch.no_grad():
            logits = trainer(ids).logits[0].float().cpu()
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]  # the row before each generated token
        engine = torch.tensor([lp[t].logprob for lp, t in zip(comp.logprobs, tokens.tolist())], dtype=torch.float64)
        kept = (_kept_sets_on_cpu(rows, tokens, trunc, args.temperature) if args.cpu
                else kept_sets_from_completion(comp))
        samples.append({"rows": rows, "tokens": tokens, "engine_logprobs": engine, "kept": kept})
    result = analyze(samples, trunc, args.temperature)
    import vllm

    report = {"what": "vLLM's own kept sets replayed against recompute and the full vocabulary",
              "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run: stand-in kept sets)",
              "vllm": vllm.__version__, "torch": torch.__version__, "model": model_path,
              "settings": {"top_k": args.top_k, "top_p": args.top_p, "temperature": args.temperature,
                           "vllm_dtype": engine_args["dtype"], "trainer_dtype": "float32",
                           "prompts": args.prompts, "max_tokens": args.max_tokens},
              "modes": result}
    checks = {"replay_has_no_boundary_token": result["replay"]["boundary_frac"] == 0.0,
              "replay_ratio_closer_to_1_than_full": abs(result["replay"]["ratio_mean"] - 1)
              <= abs(result["full"]["ratio_mean"] - 1)}
    report["checks"] = checks
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":  # vLLM's LLM() spawns processes: the guard keeps them from re-running this
    sys.exit(main())
