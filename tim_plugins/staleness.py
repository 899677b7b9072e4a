"""Mismatch or staleness: the log-ratio a loss pass sees, split into its two causes where the trainer reuses a batch.

Per token, with π_old the trainer's log-probs at the rollout's weights (the monitor's measurement point) and π_θ the
trainer's log-probs in the loss pass (after 0, 1, 2, ... optimizer steps on the same batch):

    d = log π_θ − log π_rollout = (log π_θ − log π_old) + (log π_old − log π_rollout) = s + m

- staleness ``s``: the policy moved since the sample was drawn (fewer reuse steps: TRL ``num_iterations``,
  ``steps_per_generation``; verl ``ppo_epochs``, mini-batches; asynchronous trainers' ``max_staleness``);
- mismatch ``m``: the same weights scored by two stacks (the parity fixes).

``Var(d) = Var(s) + Var(m) + 2 Cov(s, m)``: `SplitStats` keeps the six sums these need (exactly mergeable over
micro-batches and ranks) and reports the share of ``Var(d)`` each term explains. Where nothing is reused π_θ = π_old
in every pass, so ``s`` is exactly 0 (the adapters pass the same tensor) and the mismatch explains everything.
The staleness part's own statistics (k3, |s| quantiles, the ratio band: exp(s) is the PPO ratio) come from a
`tim_plugins.metrics.MismatchMonitor` with the prefix ``tim/staleness`` fed (π_old, π_θ).
"""

from __future__ import annotations

import math

import torch

from tim_plugins._mismatch_layout import valid_logprob_pair
from tim_plugins.accumulate import Accumulated, Accumulator

__all__ = ["REUSED_KEYS", "ReusedSplit", "SPLIT_PREFIX", "STALENESS_KEYS", "SplitStats", "split_parts",
           "split_terms", "staleness_metrics"]

SPLIT_PREFIX = "tim/split"
# The staleness part's statistics logged (the monitor's, prefix tim/staleness): the token count, k3, |s| mean,
# maximum and quantiles, the ratio band (exp(s) is the PPO ratio).
STALENESS_KEYS = tuple(f"tim/staleness/{k}" for k in (
    "tokens", "token/kl_k3", "token/abs_diff_mean", "token/abs_diff_max", "token/abs_diff_p99",
    "token/abs_diff_p999", "token/ratio_outside_frac"))


# The split over the reused tokens (``ReusedSplit``): what the staleness rule judges.
REUSED_KEYS = tuple(f"{SPLIT_PREFIX}/reused_{k}" for k in ("tokens", "staleness_var_share", "staleness_kl_k3"))


def staleness_metrics(monitor_metrics: dict[str, float]) -> dict[str, float]:
    """The `STALENESS_KEYS` of a ``tim/staleness`` monitor's ``compute()``."""
    return {k: monitor_metrics[k] for k in STALENESS_KEYS}


def split_parts(rollout: torch.Tensor, old: torch.Tensor, current: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(staleness, mismatch) per token, in float64: ``current − old`` and ``old − rollout``."""
    old = old.detach().double()
    return current.detach().double() - old, old - rollout.detach().double()


def split_terms(rollout: torch.Tensor, old: torch.Tensor, current: torch.Tensor, mask: torch.Tensor):
    """(s, m, keep) of one loss pass: ``split_parts`` in float64, zero where not kept; ``keep`` the tokens of ``mask``
    whose log-probs are valid on every side (non-finite or placeholder ones left out, as the monitor leaves them)."""
    s, m = split_parts(rollout, old, current)
    keep = mask.bool() & valid_logprob_pair(rollout, old, m) & valid_logprob_pair(old, current, s)
    # zeros where not kept rather than boolean indexing: no host read of the count per micro-batch
    return torch.where(keep, s, 0.0), torch.where(keep, m, 0.0), keep


def _moments(s: torch.Tensor, m: torch.Tensor, keep: torch.Tensor) -> tuple:
    """SplitStats' sums (n, Σs, Σm, Σs², Σm², Σsm) of terms already zero where not kept."""
    return keep.sum(), s.sum(), m.sum(), (s * s).sum(), (m * m).sum(), (s * m).sum()


class SplitStats(Accumulated):
    """Sums of s, m, s², m², s·m over the loss-pass tokens (float64), merged exactly over ranks."""

    _SUMS = ("n", "s", "m", "ss", "mm", "sm")

    def __init__(self) -> None:
        self._acc = Accumulator(self._SUMS)

    def update(self, rollout: torch.Tensor, old: torch.Tensor, current: torch.Tensor, mask: torch.Tensor) -> None:
        """One loss pass: [B, T] rollout, π_old and π_θ log-probs of the sampled tokens, [B, T] tokens it trains.
        Tokens with an invalid log-prob on any side (non-finite, a placeholder) are left out, as the monitor leaves
        them out."""
        self.add_terms(*split_terms(rollout, old, current, mask))

    def add_terms(self, s: torch.Tensor, m: torch.Tensor, keep: torch.Tensor) -> None:
        """One loss pass's ``split_terms`` (computed once for every statistic of the split)."""
        self._acc.add(_moments(s, m, keep))

    @staticmethod
    def _shares(v: dict) -> tuple:
        """(n, mean s, mean m, Var(d), (staleness, mismatch, covariance) shares of Var(d)) of merged sums ``v``."""
        n, nan = v["n"], math.nan
        if n <= 0:
            return 0.0, nan, nan, nan, (nan, nan, nan)
        ms, mm = v["s"] / n, v["m"] / n
        var_s = max(v["ss"] / n - ms * ms, 0.0)
        var_m = max(v["mm"] / n - mm * mm, 0.0)
        cov = v["sm"] / n - ms * mm
        total = var_s + var_m + 2.0 * cov
        return n, ms, mm, total, ((var_s / total, var_m / total, 2.0 * cov / total) if total > 0 else (nan, nan, nan))

    def compute(self, sync: bool = True, group=None) -> dict[str, float]:
        """``tim/split/*``: token count, the mean of each part and of the total, Var(d), and each term's share of it
        (staleness_var_share + mismatch_var_share + cov_share = 1). NaN where there is no token or no variance."""
        n, ms, mm, total, shares = self._shares(self._acc.merged(sync=sync, group=group))
        p = SPLIT_PREFIX
        return {f"{p}/tokens": n, f"{p}/staleness_mean": ms, f"{p}/mismatch_mean": mm, f"{p}/total_mean": ms + mm,
                f"{p}/total_var": total, f"{p}/staleness_var_share": shares[0],
                f"{p}/mismatch_var_share": shares[1], f"{p}/cov_share": shares[2]}


class ReusedSplit(SplitStats):
    """The split over the reused tokens alone: those a loss pass trains after at least one optimizer step since their
    rollout (policy lag >= 1), and the staleness part's k3 there (``ρ − 1 − s`` with ρ = exp(s), the monitor's
    estimator). What the staleness rule judges: the tokens of a batch's first pass, or of a generation that no step
    separates from its loss pass, have s = 0 and would dilute both figures by the share of fresh tokens in the
    logging window (``REUSED_KEYS``)."""

    _SUMS = SplitStats._SUMS + ("k3",)

    def update(self, rollout: torch.Tensor, old: torch.Tensor, current: torch.Tensor, mask: torch.Tensor,
               lag: torch.Tensor) -> None:
        """``SplitStats.update`` over the tokens of ``mask`` whose ``lag`` ([B, T] optimizer steps) is >= 1."""
        self.add_terms(*split_terms(rollout, old, current, mask), lag)

    def add_terms(self, s: torch.Tensor, m: torch.Tensor, keep: torch.Tensor, lag: torch.Tensor) -> None:
        keep = keep & (lag >= 1)
        s, m = torch.where(keep, s, 0.0), torch.where(keep, m, 0.0)
        self._acc.add((*_moments(s, m, keep), (torch.expm1(s) - s).sum()))  # 0 where not kept (s = 0 there)

    def compute(self, sync: bool = True, group=None) -> dict[str, float]:
        """``REUSED_KEYS``: the reused tokens' count, the staleness part's share of their Var(d), its k3 over them
        (NaN without a reused token)."""
        v = self._acc.merged(sync=sync, group=group)
        n, _, _, _, shares = self._shares(v)
        return dict(zip(REUSED_KEYS, (n, shares[0], v["k3"] / n if n > 0 else math.nan)))
