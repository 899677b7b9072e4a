"""The ``tim/safe_vocab/*`` statistics of safe-vocabulary log-probs (``tim_plugins.safe_vocab``), and the loss mask
that drops boundary disagreements.

A token the sampler kept but the trainer's own probabilities put outside its safe set S gets ``in_safe = False``
(a "boundary" token): ``safe_loss_mask`` removes it from the loss and counts it. ``SafeVocabStats`` keeps, over the
measured tokens, the pruned mass 1 − Σ_S p_T, |S| and the boundary count as sums and a maximum, so values merged
over micro-batches and ranks are exact. A measured token whose logits row has no distribution (a NaN or +inf logit:
``safe_vocab`` marks the row with a NaN pruned mass) is counted in ``invalid_tokens`` and left out of every other
statistic, as the mismatch monitor does with ``tim/invalid_tokens``.
"""

from __future__ import annotations

import math

import torch

from .accumulate import Accumulated, Accumulator
from .metrics import mismatch_metrics

__all__ = ["SafeVocabStats", "safe_loss_mask", "safe_vocab_metrics"]


def safe_loss_mask(response_mask: torch.Tensor, in_safe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop boundary disagreements from the loss.

    Args:
        response_mask: [B, T] (or [N]) bool/0-1 mask of tokens that would enter the loss.
        in_safe: same shape, from ``SafeLogprobs.in_safe`` (reshaped).
    Returns:
        (loss_mask in ``response_mask``'s dtype, 0-dim int64 count of boundary tokens); no host sync.
    """
    if response_mask.shape != in_safe.shape:
        raise ValueError(f"response_mask {tuple(response_mask.shape)} and in_safe {tuple(in_safe.shape)} differ")
    valid = response_mask.bool()
    boundary = valid & ~in_safe.bool()
    keep = valid & in_safe.bool()
    return keep.to(response_mask.dtype), boundary.sum()


class SafeVocabStats(Accumulated):
    """The ``tim/safe_vocab/*`` statistics over measured tokens, mergeable over micro-batches and ranks.

    Per valid token (``mask``): the pruned mass 1 − Σ_S p_T, |S|, and whether the token lies outside the
    trainer's S (a boundary token). Kept as sums and a maximum (``Accumulator``), so the merged values are exact;
    every statistic of an empty set is NaN, as the mismatch monitor's are. A measured token of a row without a
    distribution (NaN pruned mass) counts in ``invalid_tokens`` only.
    """

    PREFIX = "tim/safe_vocab"
    _SUMS = ("tokens", "pruned_mass", "size", "boundary", "invalid")

    def __init__(self) -> None:
        self._acc = Accumulator(self._SUMS, ("pruned_mass_max",))

    def update(self, mask: torch.Tensor, in_safe: torch.Tensor, pruned_mass: torch.Tensor,
               size: torch.Tensor) -> None:
        """Add one batch: ``mask`` [B, T] (or [N]) of measured tokens and the same-shaped fields of a
        ``SafeLogprobs`` (reshaped). No host sync."""
        measured = mask.bool()
        pruned = pruned_mass.reshape(measured.shape).double()
        ok = torch.isfinite(pruned)  # NaN exactly on the rows without a distribution (safe_vocab)
        valid = measured & ok
        neg_inf = torch.full((), -math.inf, dtype=torch.float64, device=pruned.device)
        self._acc.add(
            (valid.sum(), torch.where(valid, pruned, 0.0).sum(),
             torch.where(valid, size.reshape(valid.shape).double(), 0.0).sum(),
             (valid & ~in_safe.reshape(valid.shape).bool()).sum(), (measured & ~ok).sum()),
            (torch.where(valid, pruned, neg_inf).amax() if valid.numel() else neg_inf,),
        )

    def load_state_dict(self, state) -> None:
        """A state saved before ``invalid_tokens`` existed (four sums) loads with none counted."""
        sums = state.get("sums")
        if sums is not None and len(sums) == len(self._SUMS) - 1:
            state = {**state, "sums": [*sums, 0.0]}
        self._acc.load_state_dict(state)

    def compute(self, sync: bool = True, group=None) -> dict[str, float]:
        """``tokens``, ``invalid_tokens``, ``pruned_mass_mean``, ``pruned_mass_max``, ``size_mean``,
        ``boundary_frac`` (merged over ``group`` when ``sync``: every rank must call it)."""
        v = self._acc.merged(sync, group)
        n = v["tokens"]
        mean = (lambda x: x / n) if n > 0 else (lambda x: math.nan)
        return {
            f"{self.PREFIX}/tokens": n,
            f"{self.PREFIX}/invalid_tokens": v["invalid"],
            f"{self.PREFIX}/pruned_mass_mean": mean(v["pruned_mass"]),
            f"{self.PREFIX}/pruned_mass_max": v["pruned_mass_max"] if n > 0 else math.nan,
            f"{self.PREFIX}/size_mean": mean(v["size"]),
            f"{self.PREFIX}/boundary_frac": mean(v["boundary"]),
        }


def safe_vocab_metrics(
    result, mask: torch.Tensor, *, rollout_logprobs: torch.Tensor | None = None,
    full_logprobs: torch.Tensor | None = None,
) -> dict[str, float]:
    """``tim/safe_vocab/*`` metrics of one batch (``SafeVocabStats`` on it alone); NaN without a valid token.

    Args:
        result: trainer-side ``safe_vocab.SafeLogprobs`` ([N] tensors, or already reshaped to ``mask``'s shape);
            not annotated, since ``safe_vocab`` imports this module.
        mask: [B, T] (or [N]) response mask of valid tokens.
        rollout_logprobs: [B, T] engine log-probs (processed, i.e. renormalised over the engine's S). With it,
            ``tim/safe_vocab/kl_k3`` is the monitor's k3 of the safe trainer log-probs vs these, over the loss mask
            (boundary tokens excluded).
        full_logprobs: [B, T] the trainer's full-vocabulary log-probs; with ``rollout_logprobs`` adds
            ``tim/safe_vocab/kl_k3_full`` (k3 vs the full-vocabulary trainer) on the same tokens, side by side.
    """
    shape = mask.shape
    valid = mask.bool()
    in_safe = result.in_safe.reshape(shape)
    stats = SafeVocabStats()
    stats.update(valid, in_safe, result.pruned_mass, result.size)
    out = stats.compute(sync=False)
    del out[f"{SafeVocabStats.PREFIX}/tokens"]
    if rollout_logprobs is not None:
        loss_mask, _ = safe_loss_mask(valid, in_safe)
        safe = result.logprobs.detach().reshape(shape)
        out["tim/safe_vocab/kl_k3"] = mismatch_metrics(rollout_logprobs, safe, loss_mask)["tim/token/kl_k3"]
        if full_logprobs is not None:
            out["tim/safe_vocab/kl_k3_full"] = mismatch_metrics(
                rollout_logprobs, full_logprobs.detach().reshape(shape), loss_mask)["tim/token/kl_k3"]
    return out
