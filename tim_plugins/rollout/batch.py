"""The rollout record: one batch of sampled completions with their processed log-probs, as every sampler returns
it (HF ``generate``, the exact sampler, the vLLM adapter) and the trainer side scores it; and the EOS rule that
gives its completion mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RolloutBatch", "completion_mask_from_eos"]


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
            truncated tokens), when the sampler was asked for them; else None.
        known: [B, T, V] bool, which entries of ``full_logprobs`` the engine returned (an engine that reports
            only its top-K log-probs); None = all of them.
        sample_seconds: wall time of the sampling itself (without a whole-vocabulary readout after it); None
            when not timed.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    full_logprobs: torch.Tensor | None = None
    known: torch.Tensor | None = None
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
