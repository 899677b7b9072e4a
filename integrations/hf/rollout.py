"""HF ``generate`` rollouts that keep the *processed* log-probs of what was sampled (the trainer side scores them
with ``tim_plugins.rollout.scoring.score_completions(..., positions_from_mask=True)``, the positions ``generate``
used).

Processed log-probs are those of the distribution actually sampled from: log_softmax of the scores after
temperature and truncation, recorded by ``.recorder`` as ``generate`` runs. TRL's built-in generation discards
them; an RL ratio needs them. In the HF adapter, not the core, because the recorder patches transformers'
internals (``.sources.TRANSFORMERS_SOURCES``).
"""

from __future__ import annotations

import time

import torch

from tim_plugins.rollout.batch import RolloutBatch, completion_mask_from_eos

from .recorder import record_processed_logprobs

__all__ = ["generate_with_logprobs"]


@torch.no_grad()
def generate_with_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    logits_processor=None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    return_full_logprobs: bool = False,
) -> RolloutBatch:
    """Sample with ``model.generate`` and record processed log-probs of the sampled tokens.

    Args:
        model: a transformers causal LM in the rollout dtype.
        input_ids: [B, P] left-padded prompts.
        attention_mask: [B, P].
        top_k: 0 disables top-k (HF's own default would be 50: every knob is passed explicitly).
        logits_processor: optional extra ``LogitsProcessorList`` (e.g. the TIM injector); its effect is part
            of the processed log-probs, as a real engine's mismatch would be.
        eos_token_id: overrides the generation config's; ``[]`` never stops early (every row gets
            ``max_new_tokens`` tokens and a mask of ones).
        return_full_logprobs: also return the whole processed distribution of every step
            (``RolloutBatch.full_logprobs``, B x T x V floats).
    """
    if temperature <= 0:
        raise ValueError(
            f"temperature={temperature} is invalid for sampled rollouts: it must be > 0 (greedy decoding has "
            "no sampling distribution to compare)."
        )
    gen_cfg = model.generation_config
    eos = eos_token_id if eos_token_id is not None else gen_cfg.eos_token_id
    pad = pad_token_id if pad_token_id is not None else (gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else eos)
    if isinstance(pad, list):
        pad = pad[0]
    if seed is not None:
        torch.manual_seed(seed)
    kwargs = dict(
        do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
        min_p=float(min_p) if min_p else None, max_new_tokens=int(max_new_tokens), eos_token_id=eos,
        pad_token_id=pad, use_cache=True,
    )
    # The recorder sits after every warper, so it sees the distribution each token was sampled from (and
    # keeps one [B, V] row at a time instead of output_scores' [T, B, V]).
    with record_processed_logprobs(model, extra_processors=tuple(logits_processor or ()),
                                   keep_scores=return_full_logprobs) as recorders:
        t0 = time.perf_counter()
        sequences = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        sample_seconds = time.perf_counter() - t0
    P = input_ids.shape[1]
    completion_ids = sequences[:, P:]
    logprobs = recorders[0].finish(completion_ids[:, -1])  # [B, T] fp32
    full = recorders[0].full_logprobs() if return_full_logprobs else None
    completion_mask = completion_mask_from_eos(completion_ids, eos)
    logprobs = logprobs.masked_fill(completion_mask == 0, 0.0)
    return RolloutBatch(
        prompt_ids=input_ids, prompt_mask=attention_mask.long(), completion_ids=completion_ids,
        completion_mask=completion_mask, logprobs=logprobs, full_logprobs=full, sample_seconds=sample_seconds,
    )
