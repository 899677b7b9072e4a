"""Mismatch statistics by a per-token integer key: where in the rollout (response position), how stale (policy lag),
which turn. The adapters only supply the keys; the statistics, their names and their exact merge live here.

Per key bucket, over the tokens of that bucket (d = log p_train − log p_rollout, ρ = e^d):
``count``, ``abs_diff_mean`` (mean |d|), ``mean`` (mean d), ``kl_k3`` (mean ρ − 1 − d), ``abs_diff_max``. Every
one is a sum or a maximum, kept in one `tim_plugins.accumulate.Accumulator`, so micro-batches and ranks merge
exactly. A bucket with no token (after the merge) is left out of the metrics.

Bucketings (``KEYINGS``; metric keys ``tim/by_<name>/<label>/<stat>``):

- ``position``: response position t (0-based), log-spaced: 0, 1, 2-3, 4-7, ..., 512-1023, 1024+;
- ``lag``: policy lag in optimizer steps (trainer version − the version that sampled), 0 ... 7, 8+;
- ``turn``: turn index of a multi-turn rollout, 0 ... 7, 8+.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tim_plugins.accumulate import Accumulated, Accumulator

__all__ = ["KEYINGS", "Keying", "KeyedStats", "lag_keys", "position_keys", "turn_keys"]

_STATS = ("count", "abs_sum", "d_sum", "k3_sum")


@dataclass(frozen=True)
class Keying:
    """How integer keys map to buckets: ``edges`` are the lower bounds (the last bucket is open-ended)."""

    name: str
    edges: tuple[int, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        out = []
        for lo, hi in zip(self.edges, self.edges[1:] + (None,)):
            if hi is None:
                out.append(f"{lo}+")
            elif hi - lo == 1:
                out.append(f"{lo}")
            else:
                out.append(f"{lo}-{hi - 1}")
        return tuple(out)

    def bucket(self, keys: torch.Tensor) -> torch.Tensor:
        """Bucket index of each key (keys below the first edge go to the first bucket)."""
        edges = torch.tensor(self.edges[1:], dtype=keys.dtype, device=keys.device)
        return torch.bucketize(keys, edges, right=True)


KEYINGS = {
    "position": Keying("position", (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)),
    "lag": Keying("lag", tuple(range(9))),
    "turn": Keying("turn", tuple(range(9))),
}


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


def lag_keys(trainer_version: int, sample_version: torch.Tensor, shape) -> torch.Tensor:
    """[B, T] policy lag of every token from its row's sampling version ([B])."""
    lag = (int(trainer_version) - sample_version.long()).clamp(min=0)
    return lag.view(-1, 1).expand(shape)


class KeyedStats(Accumulated):
    """Mismatch statistics by a per-token key (``keying``: one of `KEYINGS` or your own `Keying`)."""

    def __init__(self, keying: Keying | str) -> None:
        self.keying = KEYINGS[keying] if isinstance(keying, str) else keying
        labels = self.keying.labels
        self._acc = Accumulator([f"{label}/{s}" for label in labels for s in _STATS],
                                [f"{label}/abs_max" for label in labels])

    def update(self, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor) -> None:
        """[B, T] log-probs on each side, the tokens to count and each token's integer key. Non-finite tokens are
        left out (the monitor counts them as invalid)."""
        d = train.detach().double() - rollout.detach().double()
        keep = mask.bool() & torch.isfinite(d)
        d, bucket = d[keep], self.keying.bucket(keys[keep].long())
        n = len(self.keying.edges)
        zeros = torch.zeros(n, dtype=torch.float64, device=d.device)

        def per_bucket(values: torch.Tensor) -> torch.Tensor:
            return zeros.index_add(0, bucket, values)

        ad = d.abs()
        sums = torch.stack([per_bucket(torch.ones_like(d)), per_bucket(ad), per_bucket(d),
                            per_bucket(torch.expm1(d) - d)], dim=1)  # [n, 4]
        maxes = torch.full((n,), -math.inf, dtype=torch.float64, device=d.device).scatter_reduce(
            0, bucket, ad, reduce="amax", include_self=True)
        self._acc.add(sums.reshape(-1), maxes)

    def compute(self, sync: bool = True, group=None) -> dict[str, float]:
        v = self._acc.merged(sync=sync, group=group)
        out, p = {}, f"tim/by_{self.keying.name}"
        for label in self.keying.labels:
            n = v[f"{label}/count"]
            if n <= 0:  # an empty bucket is left out (the merged counts are the same on every rank)
                continue
            out[f"{p}/{label}/count"] = n
            for key, field in (("abs_diff_mean", "abs_sum"), ("mean", "d_sum"), ("kl_k3", "k3_sum")):
                out[f"{p}/{label}/{key}"] = v[f"{label}/{field}"] / n
            out[f"{p}/{label}/abs_diff_max"] = v[f"{label}/abs_max"]
        return out
