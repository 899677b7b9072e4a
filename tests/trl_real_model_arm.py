"""One arm of tests/test_trl_real_model.py, in its own process: TRL's GRPOTrainer on SmolLM2-135M-Instruct with
vLLM colocate rollouts (CPU build, bf16) against an fp32 trainer, 2 steps.

Run by the test (bounded, in its own process group), never collected by pytest. It writes to ``--out``:
- ``result.json``: TRL's ``log_history``, the bits of each loss TRL's ``_compute_loss`` returned, a SHA-256 of the
  final parameters and of the sampled tokens, the live engine's dtype, wall time and peak RSS;
- ``steps.pt``: per step, what TRL built at generation (sampling and old log-probs, loss mask, IS ratio, tokens)
  and, with ``--kept-mass``, the test's own reference for the truncated samplers: the probability mass the
  sampler's top-p / min-p keep at each position, from the fp32 trainer's full softmax at the rollout weights.

Only public API of the adapter is used: ``TIMCallback(trainer, TIMConfig(...))`` and ``trainer.add_callback``.
The wrappers here are test-side wrappers of TRL's own methods, installed before the callback attaches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Name three primary colors.",
    "Explain what a prime number is.",
    "Give me a tip for staying focused while studying.",
    "What is 12 times 7?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
]

# vLLM's KV cache for the rollouts: every sequence of a step at vllm_max_model_length at once (16 x 256 tokens,
# bf16, 30 layers x 3 KV heads x 64: 94 MB) fits in 128 MiB, so no request waits for blocks. The CPU backend's
# default is to read TRL's vllm_gpu_memory_utilization as a share of the machine's RAM.
KV_CACHE_BYTES = 128 * 2**20


def _reward(completions, **kwargs):
    """Length of the answer: varies inside a group, so the advantages (and the update) are not zero."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [len(t) / 100.0 for t in texts]


def kept_mass(logits, top_p: float, min_p: float):
    """Naive reference of vLLM's sampler on one row of logits per position (temperature 1): min-p first (an
    argmax-invariant logits processor in vllm/v1/sample/sampler.py ``sample``), then top-p on what is left
    (``apply_top_k_top_p``: keep a token when the mass strictly above it is < top_p). Returns the mass of the
    kept set under the full distribution, and the kept set."""
    import torch

    p = logits.double().softmax(-1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if min_p > 0:
        keep &= p >= min_p * p.amax(-1, keepdim=True)
    q = torch.where(keep, p, 0.0)
    q = q / q.sum(-1, keepdim=True)
    qs, idx = q.sort(-1, descending=True)
    in_nucleus = (qs.cumsum(-1) - qs) < top_p
    keep &= torch.zeros_like(keep).scatter(-1, idx, in_nucleus)
    return (p * keep).sum(-1), keep


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--callback", choices=("none", "monitor", "safe_vocab"), required=True)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=None)
    ap.add_argument("--is-mode", default="sequence_mask")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--kept-mass", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The engine's KV cache is allocated (and zeroed) whole at start-up: KV_CACHE_BYTES, passed to vllm.LLM below;
    # VLLM_CPU_KVCACHE_SPACE (whole GiB) would replace it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation
    from trl_cpu_vllm import cpu_sync_weights, llm_with

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig

    vllm_generation.VLLMGeneration.sync_weights = cpu_sync_weights
    # enforce_eager: the CPU build's torch.compile of the model took ~150 s of each engine's ~190 s start-up, with
    # no hit in vLLM's compile cache from one arm to the next; what the tests check (the monitor against TRL's own
    # metrics, the bf16 level, the truncation bias and its fix, bit-identity) does not depend on it.
    vllm_generation.LLM = llm_with(vllm_generation.LLM, dtype="bfloat16", kv_cache_memory_bytes=KV_CACHE_BYTES,
                                   enforce_eager=True)

    n = args.prompts * args.generations
    # gradient_checkpointing: TRL's GRPO default. Without it the backward of 16 sequences through 30 layers held
    # ~1.7 GiB of activations at its peak (the arm's peak PSS 5.9 GiB, with it 4.1 GiB; the same losses).
    config = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, per_device_train_batch_size=n,
        num_generations=args.generations, max_completion_length=args.tokens, max_steps=args.steps,
        logging_steps=1, report_to=[], save_strategy="no", gradient_checkpointing=True, learning_rate=1e-5,
        seed=0, disable_tqdm=True, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=256, top_p=args.top_p, min_p=args.min_p,
        vllm_importance_sampling_mode=args.is_mode,
    )
    ds = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    trainer = GRPOTrainer(model=args.model, reward_funcs=_reward, args=config, train_dataset=ds)
    t_init = time.time() - t0

    steps, loss_bits = [], []
    gen, compute_loss = trainer._generate_and_score_completions, trainer._compute_loss

    def _generate_and_score_completions(*a, **k):
        built = gen(*a, **k)
        rec = {"step": trainer.state.global_step + 1}
        for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_per_token_logps",
                    "old_per_token_logps", "importance_sampling_ratio", "tool_mask"):
            if isinstance(built.get(key), torch.Tensor):
                rec[key] = built[key].detach().clone()
        if args.kept_mass:  # at the rollout's weights: the optimizer has not stepped since the sync
            rec.update(_reference_distribution(trainer.model, rec, args.top_p, args.min_p or 0.0))
        steps.append(rec)
        return built

    def _compute_loss(model, inputs, *a, **k):
        loss = compute_loss(model, inputs, *a, **k)
        loss_bits.append(float(loss.detach()).hex())
        return loss

    trainer._generate_and_score_completions = _generate_and_score_completions
    trainer._compute_loss = _compute_loss
    if args.callback != "none":
        tim = TIMConfig(log_detail=True, safe_vocab=True) if args.callback == "safe_vocab" else TIMConfig(log_detail=True)
        trainer.add_callback(TIMCallback(trainer, tim))
    initial = _params_sha256(trainer.model)
    t1 = time.time()
    trainer.train()
    t_train = time.time() - t1

    params = _params_sha256(trainer.model)
    engine = trainer.vllm_generation.llm.llm_engine.vllm_config.model_config
    torch.save(steps, out / "steps.pt")
    result = {
        "log_history": trainer.state.log_history, "loss_bits": loss_bits, "initial_params_sha256": initial,
        "params_sha256": params,
        "completions_sha256": [hashlib.sha256(rec["completion_ids"].numpy().tobytes()).hexdigest() for rec in steps],
        "engine_dtype": str(engine.dtype).replace("torch.", ""),
        "trainer_dtype": str(next(trainer.model.parameters()).dtype).replace("torch.", ""),
        "init_s": t_init, "train_s": t_train, "wall_s": time.time() - t0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))


def _params_sha256(model) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _reference_distribution(model, rec, top_p: float, min_p: float) -> dict:
    """The fp32 trainer's full next-token distribution at each completion position (one forward of prompt +
    completion, no grad): the kept mass of the sampler's truncation, whether the sampled token is in the kept
    set, and the sampled token's full-softmax log-prob (equal to TRL's old log-probs: checks the alignment)."""
    import torch

    ids = torch.cat([rec["prompt_ids"], rec["completion_ids"]], dim=1)
    mask = torch.cat([rec["prompt_mask"], rec["completion_mask"]], dim=1)
    width = rec["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=width + 1).logits[:, :-1]
    mass, keep, logp = [], [], []
    for row, tok in zip(logits, rec["completion_ids"]):  # one sequence at a time: [T, V] float64 stays small
        m, k = kept_mass(row, top_p, min_p)
        mass.append(m)
        keep.append(k.gather(-1, tok[:, None])[:, 0])
        logp.append(row.double().log_softmax(-1).gather(-1, tok[:, None])[:, 0])
    return {"kept_mass": torch.stack(mass), "sampled_in_kept": torch.stack(keep), "full_logp": torch.stack(logp)}


if __name__ == "__main__":
    main()
