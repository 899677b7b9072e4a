"""Rollouts from an in-process vLLM engine, as the core's `RolloutBatch` (imports vLLM at import time).

`start_vllm` starts an engine that reports processed log-probs (what an RL ratio needs); `vllm_rollout` samples a
batch with the core `Truncation` and returns the sampled tokens' log-probs and the top-K (or whole) processed
distribution of every step, with which entries vLLM returned. ``tim-plugins measure --rollout vllm`` uses both.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from vllm import LLM

from tim_plugins.rollout.batch import RolloutBatch
from tim_plugins.truncation import Truncation

from .sampling import make_vllm_sampling_params

__all__ = ["start_vllm", "vllm_rollout"]


def start_vllm(path: str, *, dtype: str, seed: int, fp32_head: bool, max_logprobs: int) -> LLM:
    """An in-process vLLM engine on ``path`` that returns processed log-probs (and up to ``max_logprobs`` of
    them per token, -1 = the whole vocabulary)."""
    if path.endswith(".gguf") or not (Path(path) / "config.json").exists():
        raise ValueError(f"vllm rollouts need an HF checkpoint folder, got {path!r}: pass --model DIR with a "
                         "config.json (GGUF files are not supported here)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: no spawn guard
    extra = {"hf_overrides": {"head_dtype": "float32"}} if fp32_head else {}
    # vLLM's CPU backend reserves gpu_memory_utilization × RAM for the KV cache: ask for a fixed 1 GiB.
    # The engine args (kv_cache_memory_bytes, hf_overrides head_dtype, logprobs_mode, max_logprobs):
    # VLLM_SOURCES vllm.engine.arg_utils:EngineArgs and VLLM_SOURCES vllm.config.model:_get_head_dtype
    memory = {} if torch.cuda.is_available() else {"kv_cache_memory_bytes": 2**30}
    return LLM(model=path, dtype=dtype, seed=seed, logprobs_mode="processed_logprobs", enable_prefix_caching=False,
               max_logprobs=max_logprobs, **memory, **extra)


def vllm_rollout(llm: LLM, enc, *, max_new_tokens: int, temperature: float, top_p: float, top_k: int, min_p: float,
                 seed: int, num_logprobs: int, vocab: int) -> RolloutBatch:
    """Sample ``max_new_tokens`` per prompt of ``enc`` (left-padded ``input_ids`` / ``attention_mask``) without
    stopping at EOS; ``num_logprobs`` log-probs per token fill ``full_logprobs`` (``known`` marks them, None when
    the whole vocabulary came back). ``sample_seconds`` times the sampling with the sampled tokens' log-probs only.

    vLLM ends a request without an error where prompt + completion reach the engine's ``max_model_len``: such a
    row has fewer tokens, and ``completion_mask`` is 0 past the tokens vLLM returned (their ids and log-probs are
    0 padding, not samples), so a consumer scores ``completion_mask``'s tokens only. The short row is kept rather
    than the batch refused: the other rows, and this row's sampled tokens, are valid measurements."""
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
    mask = torch.zeros(B, T, dtype=torch.long)
    logps = torch.zeros(B, T)
    full = torch.full((B, T, vocab), -math.inf)
    known = torch.zeros(B, T, vocab, dtype=torch.bool)
    # logprobs: one dict token_id -> Logprob per step (VLLM_SOURCES vllm.sampling_params:SamplingParams)
    for b, out in enumerate(outs):
        toks = list(out.outputs[0].token_ids)
        ids[b, : len(toks)] = torch.tensor(toks)
        mask[b, : len(toks)] = 1
        for t, (tok, entries) in enumerate(zip(toks, out.outputs[0].logprobs)):
            idx = torch.tensor(list(entries.keys()))
            full[b, t, idx] = torch.tensor([e.logprob for e in entries.values()])
            known[b, t, idx] = True
            logps[b, t] = entries[tok].logprob
    # positions past a short row have no entries at all: whether the whole vocabulary came back is asked of the
    # returned tokens only
    return RolloutBatch(enc["input_ids"], enc["attention_mask"].long(), ids, mask, logps, full_logprobs=full,
                        known=None if bool(known[mask.bool()].all()) else known, sample_seconds=seconds)
