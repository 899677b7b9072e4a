"""Trainer-side scoring of completions, written once: one full-sequence forward without a KV cache, the
tempered log-softmax (fp32) of the positions that predict the completion, the completion tokens' log-probs
gathered from it, and on request their entropy and the whole distribution.

Every trainer-side recomputation in the package is `score_completions` (or `scores_from_logits` on logits a
caller already has): the exact sampler's trainer side (``rollout.exact.exact_logprobs``, bitwise equal to its
rollout log-probs; the sampler itself samples from `completion_logits` + `tempered_log_softmax`), the TRL
adapter's exact mode, the HF trainer recomputation and ``tim-plugins measure``'s trainer side. Two kinds of
positions: the model's default ones (the exact sampler's fixed padded buffer) or ``positions_from_mask`` (the
positions HF ``generate`` used for left-padded rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["tempered_log_softmax", "position_ids_from_mask", "completion_logits", "CompletionScores",
           "scores_from_logits", "score_completions"]


def tempered_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p = log_softmax(z / T) in fp32; T == 0 (greedy) uses the untempered distribution, as vLLM does."""
    z = logits.float()
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    return torch.log_softmax(z, dim=-1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions as ``generate`` computes them for left-padded rows: cumsum(mask) − 1, pads at 0."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_(min=0)


def completion_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int, *,
                      positions_from_mask: bool = False) -> torch.Tensor:
    """[B, T, V] logits that predict the last ``completion_width`` (T) tokens of ``input_ids`` [B, P + T], from one
    forward over the whole sequence without a KV cache (a view of the model's logits: no copy).

    ``positions_from_mask``: pass ``position_ids_from_mask(attention_mask)`` (HF ``generate``'s positions); else
    the model's default positions (the exact sampler's)."""
    kwargs = {"position_ids": position_ids_from_mask(attention_mask)} if positions_from_mask else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
    p = input_ids.shape[1] - int(completion_width)
    return logits[:, p - 1 : p - 1 + int(completion_width)]


@dataclass
class CompletionScores:
    """Scores of the completion positions: ``logprobs`` [B, T] fp32 of the completion tokens; ``entropy`` [B, T]
    (H = −Σ p log p of each position's distribution) and ``full_logprobs`` [B, T, V] when asked for, else None."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    full_logprobs: torch.Tensor | None = None


def scores_from_logits(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float, *,
                       entropy: bool = False, full: bool = False) -> CompletionScores:
    """`CompletionScores` of the logits [B, T, V] that predict ``completion_ids`` [B, T]."""
    logp = tempered_log_softmax(logits, temperature)
    sampled = logp.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if entropy else None
    return CompletionScores(sampled, ent, logp if full else None)


def score_completions(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int, *,
                      temperature: float, positions_from_mask: bool = False, entropy: bool = False,
                      full: bool = False) -> CompletionScores:
    """Score the last ``completion_width`` tokens of ``input_ids`` [B, P + T] (prompt | completion, with its
    ``attention_mask``) under the model's tempered distribution. Runs with gradients when they are on (the
    trainer's loss forward); wrap it in ``torch.no_grad()`` to only measure."""
    logits = completion_logits(model, input_ids, attention_mask, completion_width,
                               positions_from_mask=positions_from_mask)
    return scores_from_logits(logits, input_ids[:, input_ids.shape[1] - int(completion_width):], temperature,
                              entropy=entropy, full=full)
