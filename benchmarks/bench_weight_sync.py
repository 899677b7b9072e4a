"""Cost of the weight-sync check (``tim_plugins.weight_sync``) against the sync itself, on a 0.5B-shaped model.

Trainer: a transformers ``Qwen2ForCausalLM`` with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 / 2 heads,
intermediate 4864, vocabulary 151,936, tied embeddings; 494M parameters), random fp32 weights built here. Engine: a
vLLM ``LLM`` of the same config in bf16 with dummy weights (``load_format="dummy"``: no checkpoint), in-process. Two
syncs, each in its own process (its own engine):

- ``plain``: TRL's colocate sync, one ``model.load_weights([(name, tensor)])`` per parameter, on an engine that keeps
  plain linear weights (vLLM's CPU GEMM dispatch made to compute with ``F.linear``, as the test suites do): the check
  reads every sampled element directly, as it does on a GPU engine with unquantized weights;
- ``packed``: vLLM's own ``reload_weights`` (what the CPU test suites sync through), on the CPU build's prepacked
  linear weights: the check reads linear weights through the layers' forward (one-hot rows), i.e. one pass over
  every linear weight per check, as it would for a quantized engine.

Per round (after warm-up rounds), interleaved: the sync alone, and the sync with the check (sampling what is streamed,
then reading the engine and classifying). Reported per variant: the check's own time (``SyncReport.seconds``) over
the median plain sync (the goal: <= 1 %), and the end-to-end ratio (sync with check / sync alone; noisier, it carries
both syncs' spread). Repeats, median, spread. A CPU measurement on a shared machine: the ratios, not the seconds,
are the figure.

    python -m benchmarks.bench_weight_sync [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import RESULTS_DIR, spread, write_results

GOAL = 0.01  # the check's own time over the sync's, per checked sync
QWEN2_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
QUICK = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}


def _config_dir(shape: dict) -> Path:
    from transformers import Qwen2Config

    folder = Path(tempfile.mkdtemp(prefix="tim_bench_sync_"))
    Qwen2Config(max_position_embeddings=512, torch_dtype="float32", **shape).save_pretrained(folder)
    return folder


def _plain_linear_weights() -> None:
    """vLLM's CPU GEMM dispatch keeps plain 2-D linear weights and computes with F.linear (the test suites' shim)."""
    import torch
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias=None: torch.nn.functional.linear(x, weight, bias)

    utils.dispatch_cpu_unquantized_gemm = dispatch


def run_variant(variant: str, shape: dict, rounds: int, warmup: int) -> dict:
    """One variant in this process: build trainer and engine, time the rounds."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import Qwen2ForCausalLM
    from vllm import LLM

    from tim_plugins.integrations.vllm.weights import VLLMWeights
    from tim_plugins.weight_sync import SyncCheck

    folder = _config_dir(shape)
    torch.manual_seed(0)
    trainer = Qwen2ForCausalLM(Qwen2ForCausalLM.config_class.from_pretrained(folder))
    params = [(n, p) for n, p in trainer.named_parameters()]
    if variant == "plain":
        _plain_linear_weights()
    llm = LLM(model=str(folder), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=256, kv_cache_memory_bytes=64 * 2**20, seed=0)
    reader = VLLMWeights.from_llm(llm)
    model = reader.model

    def sync(weights) -> None:
        if variant == "plain":  # TRL's colocate loop (trl/generation/vllm_generation.py VLLMGeneration.sync_weights)
            for name, tensor in weights:
                model.load_weights([(name, tensor)])
        else:  # vLLM's reload_weights (tests/trl_cpu_vllm.py cpu_sync_weights)
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights),
                                                          "is_checkpoint_format": True})

    check = SyncCheck()
    plain_s, with_s, check_s, bad = [], [], [], []
    with torch.no_grad():
        for r in range(warmup + rounds):
            for p in trainer.parameters():  # an optimizer step's worth of change, outside the timings
                p.add_(1e-3)
            order = ("alone", "checked") if r % 2 == 0 else ("checked", "alone")
            for kind in order:
                t0 = time.perf_counter()
                if kind == "alone":
                    sync(iter(params))
                    elapsed = time.perf_counter() - t0
                    if r >= warmup:
                        plain_s.append(elapsed)
                    continue
                record = check.begin(r)
                sync(record.observing(params))
                report = check.finish(record, reader)
                elapsed = time.perf_counter() - t0
                if r >= warmup:
                    with_s.append(elapsed)
                    check_s.append(report.seconds)
                    bad.append(report.bad_tensors)
    n_params = sum(p.numel() for _, p in params)
    sync_med = statistics.median(plain_s)
    return {
        "variant": variant, "parameters": n_params, "tensors": len(params), "engine_dtype": "bfloat16",
        "checked_tensors": report.checked_tensors, "unread_tensors": len(report.names("unread")),
        "bad_tensors": bad, "rounds": rounds,
        "sync_seconds": spread(plain_s), "sync_with_check_seconds": spread(with_s), "check_seconds": spread(check_s),
        "sync_seconds_raw": plain_s, "check_seconds_raw": check_s,
        "check_over_sync": statistics.median(check_s) / sync_med,
        "check_over_sync_per_round": [c / sync_med for c in check_s],
        "end_to_end_ratio": statistics.median(with_s) / sync_med,
    }


def reading(variants: dict) -> dict:
    """Per variant: the check's cost per checked tensor, and what the figure says against the goal."""
    out = {}
    for v, r in variants.items():
        per_tensor = r["check_seconds"]["median"] / max(1, r["checked_tensors"])
        line = (f"check {r['check_seconds']['median'] * 1e3:.1f} ms = {per_tensor * 1e6:.0f} us per tensor x "
                f"{r['checked_tensors']} tensors, against a sync of {r['sync_seconds']['median']:.2f} s "
                f"({r['check_over_sync']:.2%}; goal {GOAL:.0%})")
        if v == "packed":
            line += ("; every linear weight read through the layer's forward (one-hot rows over the whole packed "
                     "matrix), the path of prepacked CPU weights and quantized engines")
        else:
            line += "; direct reads: a fixed per-tensor cost (index, gather, bookkeeping), independent of the size"
        out[v] = {"check_us_per_tensor": per_tensor * 1e6, "goal_met": r["check_over_sync"] <= GOAL, "line": line}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, 2 rounds (the test)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", nargs="*", default=["plain", "packed"])
    parser.add_argument("--output", default=None)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant, print its JSON
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else QWEN2_05B
    rounds, warmup = (2, 1) if args.quick else (args.rounds, args.warmup)
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, shape, rounds, warmup)))
        return {}
    variants = {}
    load = {"before": os.getloadavg()}
    for variant in args.variants:
        cmd = [sys.executable, "-m", "benchmarks.bench_weight_sync", "--variant", variant, "--rounds", str(rounds),
               "--warmup", str(warmup)] + (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"variant {variant} failed ({proc.returncode}):\n{(proc.stderr or proc.stdout)[-3000:]}")
        variants[variant] = json.loads(lines[-1][len("RESULT "):])
        load[f"after_{variant}"] = os.getloadavg()
        print(f"{variant}: check / sync = {variants[variant]['check_over_sync']:.4f} (median sync "
              f"{variants[variant]['sync_seconds']['median']:.3f} s, check "
              f"{variants[variant]['check_seconds']['median'] * 1e3:.2f} ms)")
    results = {
        "quick": args.quick, "model_shape": shape, "goal": {"check_over_sync_max": GOAL},
        "ratios": {f"{v}_check_over_sync": r["check_over_sync"] for v, r in variants.items()},
        "goal_met": {v: r["check_over_sync"] <= GOAL for v, r in variants.items()},
        "variants": variants,
        "load_average_1_5_15_min": load,
        "note": "CPU, 2 cores (the load averages above say what else ran); ratios against the sync in the same "
                "process and round",
    }
    results["reading"] = reading(variants)
    path = Path(args.output) if args.output else RESULTS_DIR / ("weight_sync_quick.json" if args.quick else
                                                               "weight_sync.json")
    write_results("weight_sync", results, path)
    return results


if __name__ == "__main__":
    main()
