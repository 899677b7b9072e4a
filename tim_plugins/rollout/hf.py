"""HF ``generate`` rollouts that keep the *processed* log-probs of what was sampled, and the trainer-side
recomputation of the same tokens.

Processed log-probs are those of the distribution actually sampled from: log_softmax of the scores after
temperature and truncation, recorded by ``rollout.recorder`` as ``generate`` runs. TRL's built-in generation
discards them; an RL ratio needs them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tim_plugins.rollout.recorder import record_processed_logprobs

__all__ = [
    "RolloutBatch",
    "generate_with_logprobs",
    "position_ids_from_mask",
    "completion_logits",
    "trainer_logprobs",
    "completion_mask_from_eos",
]


@dataclass
class RolloutBatch:
    """One batch of rollouts.

    Attributes:
        prompt_ids: [B, P] left-padded prompt tokens.
        prompt_mask: [B, P] 1 for real prompt tokens.
        completion_ids: [B, T] sampled tokens (right-padded after EOS).
        completion_mask: [B, T] 1 up to and including the first EOS.
        logprobs: [B, T] float32 processed log-probs of the sampled tokens (0 where masked).
        full_logprobs: [B, T, V] float32 processed log-probs of the whole vocabulary at each step (``-inf`` for
            truncated tokens), when asked for (``generate_with_logprobs(return_full_logprobs=True)``); else None.
        sample_seconds: wall time of the sampling itself (``model.generate`` with the per-token log-prob
            recorder), without the whole-vocabulary readout after it; None when not timed.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    full_logprobs: torch.Tensor | None = None
    sample_seconds: float | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_id: int | list[int] | None,
                             min_length: int = 1) -> torch.Tensor:
    """[B, T] long mask that keeps tokens up to and including the first EOS of each row; with ``min_length`` an
    EOS ends the row only at 0-based position >= ``min_length`` − 1 (the earlier ones are kept as tokens)."""
    if eos_token_id is None:
        return torch.ones_like(completion_ids, dtype=torch.long)
    eos_ids = torch.as_tensor(eos_token_id, dtype=completion_ids.dtype, device=completion_ids.device).reshape(-1)
    is_eos = torch.isin(completion_ids, eos_ids)
    if min_length > 1:
        is_eos &= torch.arange(completion_ids.shape[1], device=completion_ids.device) >= min_length - 1
    # Tokens after the first EOS: an EOS occurred strictly before them.
    after = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
    return (~after).long()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions as ``generate`` computes them for left-padded rows: cumsum(mask) − 1, pads at 0."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_(min=0)


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


def completion_logits(model, batch: RolloutBatch) -> torch.Tensor:
    """[B, T, V] logits that predict each completion token, from one full-sequence forward (no KV cache),
    with the positions ``generate`` used."""
    input_ids, attention_mask = batch.input_ids, batch.attention_mask
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    P, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    return out.logits[:, P - 1 : P - 1 + T, :]


@torch.no_grad()
def trainer_logprobs(model, batch: RolloutBatch, *, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] float32 log-probs of the completion tokens under softmax(logits / temperature) over the full
    vocabulary: what verl and TRL trainers compute (no truncation)."""
    logits = completion_logits(model, batch).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
