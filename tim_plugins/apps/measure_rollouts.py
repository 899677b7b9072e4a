"""The rollout pipelines and the trainer scoring behind ``tim-plugins measure`` (one batch at a time).

Each rollout pipeline returns a ``RolloutBatch``: the sampled tokens, their processed log-probs and the whole
processed next-token distribution of every step (HF ``generate`` and the exact sampler here; vLLM's top-K
log-probs and which entries are known from the vLLM adapter, ``tim_plugins.integrations.vllm.rollout``). The
trainer side is one full-sequence forward (``tim_plugins.rollout.scoring``) that returns the sampled tokens'
log-probs under the same truncation (the safe-vocabulary log-probs of ``tim_plugins.safe_vocab``) and its own
whole distribution, truncated the same way.

A response is generated to ``max_new_tokens`` without stopping and ends, for scoring, at its first EOS at or
after position ``min_new_tokens``: an earlier EOS is scored like any other token and sampling continues past it
(vLLM's ``ignore_eos``). Both sides score the unmodified distributions, so the minimum length adds no bias.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tim_plugins._optional import require
from tim_plugins.apps.compare_settings import DTYPE_NAMES
from tim_plugins.apps.models import resolve_model
from tim_plugins.rollout.batch import RolloutBatch

if TYPE_CHECKING:
    from tim_plugins.safe_vocab import SafeLogprobs

__all__ = [
    "DTYPES",
    "load_model",
    "response_mask",
    "hf_rollout",
    "exact_rollout",
    "TrainerOut",
    "trainer_score",
]

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


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
    from tim_plugins.integrations.hf.rollout import generate_with_logprobs

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


@dataclass
class TrainerOut:
    """Trainer side of one batch: sampled-token log-probs [B, T] (safe-vocab when truncating), whether each
    sampled token is in the trainer's kept set [B, T], the truncated distribution [B, T, V], the untruncated
    sampled-token log-probs [B, T] (only when truncating), and the safe-vocabulary fields shaped [B, T] (only when
    truncating; what ``StepPipeline.measure(safe=...)`` takes)."""

    logprobs: torch.Tensor
    in_safe: torch.Tensor
    full_logprobs: torch.Tensor
    untruncated: torch.Tensor | None
    safe: "SafeLogprobs | None"


@torch.no_grad()
def trainer_score(model, roll: RolloutBatch, mask: torch.Tensor, *, temperature: float, top_p: float, top_k: int,
                  min_p: float, order: str, exact: bool) -> TrainerOut:
    """One full-sequence forward of the trainer on the rollout's tokens (``rollout.scoring``), scored over ``mask``.

    ``exact``: the forward at the exact sampler's padded shape, without position ids (``exact_logprobs``);
    else the HF trainer's forward with the positions ``generate`` used.
    """
    from tim_plugins.rollout.scoring import completion_logits, score_completions, scores_from_logits
    from tim_plugins.safe_vocab import SafeLogprobs, safe_logprobs_from_logits
    from tim_plugins.truncation import Truncation, truncation_threshold

    T = roll.completion_ids.shape[1]
    in_safe = torch.ones_like(mask, dtype=torch.bool)
    if exact:
        ids, attn = roll.input_ids, torch.cat([roll.prompt_mask, torch.ones_like(mask)], dim=1)
        scores = score_completions(model, ids, attn, T, temperature=temperature, full=True)
        return TrainerOut(scores.logprobs, in_safe, scores.full_logprobs, None, None)
    attn = torch.cat([roll.prompt_mask, mask], dim=1)
    logits = completion_logits(model, roll.input_ids, attn, T, positions_from_mask=True).float()
    untruncated = scores_from_logits(logits, roll.completion_ids, temperature, full=True)
    trunc = Truncation(min_p=min_p, top_p=top_p, top_k=top_k, temperature=temperature, order=order)
    if not trunc.active:
        return TrainerOut(untruncated.logprobs, in_safe, untruncated.full_logprobs, None, None)
    B, _, V = logits.shape
    safe = safe_logprobs_from_logits(logits.reshape(B * T, V), roll.completion_ids.reshape(-1), min_p=min_p,
                                     temperature=temperature, top_p=top_p, top_k=top_k, order=order)
    z = logits / temperature
    tau = truncation_threshold(z.reshape(B * T, V), trunc).reshape(B, T, 1)
    full = torch.log_softmax(torch.where(z >= tau, z, -math.inf), dim=-1)
    safe = SafeLogprobs(*(x.reshape(B, T) for x in (safe.logprobs, safe.in_safe, safe.pruned_mass, safe.size)))
    return TrainerOut(safe.logprobs, safe.in_safe, full, untruncated.logprobs, safe)
