"""TIMCallback on a CUDA GRPOTrainer (the GPU machine's own torch / transformers, TRL carried as a wheel): what the
CPU suite cannot run. The safe vocabulary through TRL's fused lm_head takes TRL's Triton path there (only the
labelled positions are scored: the compact layout ``translate.map_safe_calls`` maps) and tim-plugins' Triton safe-vocab
kernels; ``num_iterations=2`` exercises the staleness split. Writes one JSON of what it found; exits 1 when a
check fails.

    python -m benchmarks.gpu_trl_check OUT.json [--cpu]
"""

from __future__ import annotations

import json
import math
import sys


def main(out_path: str) -> int:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.toy_model import build_toy_model, synthetic_prompts

    cpu = "--cpu" in sys.argv  # a dry run of the script itself on a CPU machine
    if not torch.cuda.is_available() and not cpu:
        print("gpu_trl_check: no CUDA device (--cpu: a dry run on the CPU)", file=sys.stderr)
        return 1
    args = GRPOConfig(use_cpu=cpu, output_dir="/tmp/tim-gpu-check", max_steps=4, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=24, logging_steps=1, bf16=False, num_iterations=2, min_p=1e-3,
                      report_to=[], save_strategy="no", gradient_checkpointing=False, learning_rate=1e-3, seed=0)
    trainer = GRPOTrainer(model=str(build_toy_model()), args=args,
                          reward_funcs=lambda completions, **k: [float(len(c)) / 10 for c in completions],
                          train_dataset=Dataset.from_dict({"prompt": synthetic_prompts(64)}))
    counts = []
    # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions
    gen = trainer._generate_and_score_completions

    def _count(*a, **k):  # the response tokens TRL built (the reference for the safe-vocab token count)
        out = gen(*a, **k)
        counts.append(int(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = _count
    cb = TIMCallback(trainer, TIMConfig(safe_vocab=True, log_detail=True))  # the checks read the detail metrics
    trainer.add_callback(cb)
    trainer.train()
    rows = [h for h in trainer.state.log_history if "tim/tokens" in h or "tim/split/tokens" in h]
    diag = {k: v for h in trainer.state.log_history for k, v in h.items() if k.startswith("tim/diag/")}
    checks = {
        "safe vocabulary route": cb.safe_route.name if cb.safe_route else None,
        "no feature off": not cb.features_off,
        "no diagnostic counted (unmapped, unsupported head, ...)": not diag,
        "safe-vocab tokens = TRL's completion tokens at each sampling step": [
            h.get("tim/safe_vocab/tokens") for h in rows if "tim/safe_vocab/tokens" in h] == counts,
        "staleness exactly 0 at the sampling steps": all(
            h["tim/split/staleness_mean"] == 0.0 for h in rows if h["step"] % 2 == 1),
        "staleness > 0 at the reuse steps": all(
            h["tim/staleness/token/abs_diff_max"] > 0 for h in rows if h["step"] % 2 == 0),
        "finite k3": all(math.isfinite(h["tim/token/kl_k3"]) for h in rows if "tim/token/kl_k3" in h),
    }
    result = {"device": "cpu" if cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "trl": trl.__version__, "checks": checks,
              "diag": diag, "completion_tokens": counts,
              "rows": [{k: v for k, v in h.items() if k.startswith(("step", "tim/token/kl_k3", "tim/safe_vocab/",
                                                                      "tim/split/", "tim/staleness/token/kl_k3"))}
                       for h in rows]}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps({"checks": checks, "diag": diag}, indent=1, default=str))
    ok = bool(checks["safe vocabulary route"]) and all(v for k, v in checks.items() if k != "safe vocabulary route")
    return 0 if ok else 1


if __name__ == "__main__":
    paths = [a for a in sys.argv[1:] if not a.startswith("--")]
    sys.exit(main(paths[0] if paths else "gpu_trl_check.json"))
