"""Mismatch statistics by a per-token key: how likely the token was (probability bucket), where in the rollout
(response position), how stale (policy lag), which turn. The adapters only supply the keys; the bucketings, the
statistics, their names and their exact merge live here.

Per key bucket, over the valid tokens of that bucket (d = log p_train − log p_rollout, ρ = e^d):
``count``, ``abs_diff_mean`` (mean |d|), ``mean`` (mean d), ``kl_k3`` (mean ρ − 1 − d), ``abs_diff_max``. Every
one is a sum or a maximum (``SUMS``, ``MAXES``), kept in one `tim_plugins.accumulate.Accumulator`, so
micro-batches and ranks merge exactly; `keyed_metrics` alone turns them into metrics. A token is valid as the
mismatch monitor counts it (finite, neither log-prob a placeholder <= -1e3), so the counts of a bucketing add up
to ``tim/tokens`` over the same tokens. An update reads no value back to the host (no boolean indexing), so it
never waits for the device.

Bucketings (``KEYINGS``; metric keys ``tim/by_<name>/<label>/<stat>``):

- ``prob``: the rollout's probability of the sampled token, p = e^(rollout log-prob), in [0, 0.01), [0.01, 0.1),
  [0.1, 0.5), [0.5, 0.9), [0.9, 1] (the key is the log-prob); the mismatch monitor's ``tim/by_prob``, whose
  count and Σ|d| its fused pass adds in the same layout (``PROB_BLOCK``);
- ``position``: response position t (0-based), log-spaced: 0, 1, 2-3, 4-7, ..., 512-1023, 1024+;
- ``lag``: policy lag in optimizer steps (trainer version − the version that sampled), 0 ... 7, 8+;
- ``turn``: turn index of a multi-turn rollout, 0 ... 7, 8+.
"""

from __future__ import annotations

import math

import torch

from tim_plugins._keyings import KEYINGS, MAXES, PROB_BLOCK, STATS, SUMS, Keying, keyed_metrics
from tim_plugins._mismatch_layout import valid_logprob_pair
from tim_plugins.accumulate import Accumulated, Accumulator

__all__ = ["KEYINGS", "MAXES", "STATS", "SUMS", "UNKNOWN_LAG", "Keying", "KeyedStats", "keyed_metrics", "lag_after",
           "lag_keys", "policy_lag", "position_keys", "PROB_BLOCK", "turn_keys"]

def position_keys(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] response position of every token (0-based column index of a response-aligned batch)."""
    return torch.arange(mask.shape[1], device=mask.device).expand_as(mask)


def turn_keys(model_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] turn of every token of multi-turn completions from ``model_mask`` ([B, T], 1 where the model generated
    the token, 0 where the environment or a tool wrote it: TRL's ``tool_mask``): the number of environment segments
    before the token, so the model's first turn is 0, its answer after the first tool result 1, and so on."""
    env = ~model_mask.bool()
    before = torch.nn.functional.pad(env[:, :-1], (1, 0), value=False)
    starts = env & ~before  # the first token of each environment segment
    return starts.long().cumsum(dim=1)


# The policy lag of a token: the optimizer steps between the weights that sampled it and the weights that score it.
# Lag 0 is the mismatch floor (same weights, two stacks); a token whose sampling weights are unknown is counted, never
# keyed (UNKNOWN_LAG). Both adapters count it with these two functions: TRL in optimizer steps (each row's step, an
# asynchronous sample's sync step), verl per weight version (a global step of its asynchronous modes, several
# optimizer steps), plus the optimizer steps its actor took since the version began.
UNKNOWN_LAG = -1


def policy_lag(sampled_at, now: int, *, steps_per_version: int = 1):
    """The policy lag, in optimizer steps, of tokens sampled by the weights of version ``sampled_at`` and scored by
    those of version ``now``: (now − sampled_at, at least 0) × ``steps_per_version``; ``UNKNOWN_LAG`` where
    ``sampled_at`` is unknown (None or negative). ``sampled_at``: an int or None, or a tensor (elementwise, no host
    read)."""
    if isinstance(sampled_at, torch.Tensor):
        sampled = sampled_at.long()
        return torch.where(sampled >= 0, (int(now) - sampled).clamp(min=0) * steps_per_version, UNKNOWN_LAG)
    if sampled_at is None or sampled_at < 0:
        return UNKNOWN_LAG
    return max(int(now) - int(sampled_at), 0) * steps_per_version


def lag_after(lag: torch.Tensor, steps: int) -> torch.Tensor:
    """``lag`` (``policy_lag``'s, in optimizer steps) ``steps`` optimizer steps later; unknown stays unknown."""
    return torch.where(lag >= 0, lag + int(steps), UNKNOWN_LAG)


def lag_keys(trainer_version: int, sample_version: torch.Tensor, shape) -> torch.Tensor:
    """[B, T] policy lag of every token from its row's sampling version ([B])."""
    return policy_lag(sample_version, trainer_version).view(-1, 1).expand(shape)


class KeyedStats(Accumulated):
    """Mismatch statistics by a per-token key (``keying``: one of `KEYINGS` or your own `Keying`); metric keys
    under ``prefix``."""

    def __init__(self, keying: Keying | str, prefix: str = "tim") -> None:
        self.keying = KEYINGS[keying] if isinstance(keying, str) else keying
        self.prefix = prefix
        labels = self.keying.labels
        self._acc = Accumulator([f"{label}/{s}" for label in labels for s in SUMS],
                                [f"{label}/{m}" for label in labels for m in MAXES])

    def update(self, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor) -> None:
        """[B, T] log-probs on each side, the tokens to count and each token's key. Invalid tokens (non-finite, a
        placeholder log-prob) are left out (the monitor counts them as invalid)."""
        rollout, train = rollout.detach().double(), train.detach().double()
        d = train - rollout
        keep = (mask != 0) & valid_logprob_pair(rollout, train, d)
        n = len(self.keying.edges)
        # Every token is added (no data-dependent shape): a left-out one to an extra bucket n, dropped below.
        bucket = torch.where(keep, self.keying.bucket(keys), n).reshape(-1)
        d = torch.where(keep, d, 0.0).reshape(-1)
        ad = d.abs()
        values = torch.stack([torch.ones_like(d), ad, d, torch.expm1(d) - d], dim=1)  # [N, SUMS]
        sums = torch.zeros(n + 1, len(SUMS), dtype=torch.float64, device=d.device).index_add_(0, bucket, values)
        maxes = torch.full((n + 1,), -math.inf, dtype=torch.float64, device=d.device).scatter_reduce_(
            0, bucket, ad, reduce="amax", include_self=True)
        self._acc.add(sums[:n].reshape(-1), maxes[:n])

    def compute(self, sync: bool = True, group=None) -> dict[str, float]:
        return keyed_metrics(self.keying, self._acc.merged(sync=sync, group=group), self.prefix)
