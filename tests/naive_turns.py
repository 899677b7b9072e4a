"""Test helper: the turn of every token of multi-turn completions, counted token by token (the reference the
vectorised ``tim_plugins.by_key.turn_keys`` is checked against, in the TRL and the verl tests)."""

from __future__ import annotations

import torch

__all__ = ["turns_naive"]


def turns_naive(model_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] number of environment segments (runs of 0 in ``model_mask``) before each token."""
    out = torch.zeros_like(model_mask, dtype=torch.long)
    for b in range(model_mask.shape[0]):
        turn, prev_env = 0, False
        for t in range(model_mask.shape[1]):
            env = not bool(model_mask[b, t])
            turn += int(env and not prev_env)
            prev_env = env
            out[b, t] = turn
    return out
