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

import functools
import math
from dataclasses import dataclass

import torch

from tim_plugins._mismatch_layout import INVALID_LOGPROB_THRESHOLD, PROB_BUCKET_EDGES
from tim_plugins.accumulate import Accumulated, Accumulator

__all__ = ["KEYINGS", "MAXES", "STATS", "SUMS", "Keying", "KeyedStats", "keyed_metrics", "lag_keys",
           "position_keys", "PROB_BLOCK", "turn_keys"]

# The per-bucket state: sums (the first is the count), then maxima; and each metric besides ``count`` with its
# field (a sum divided by the bucket's count, a maximum as it is).
SUMS = ("count", "abs_sum", "d_sum", "k3_sum")
MAXES = ("abs_max",)
STATS = {"abs_diff_mean": "abs_sum", "mean": "d_sum", "kl_k3": "k3_sum", "abs_diff_max": "abs_max"}


@functools.lru_cache(maxsize=64)
def _edges_on(edges: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The bucket edges as a tensor on ``device``, made once: a host-to-device copy per update would wait for the
    device every micro-batch."""
    return torch.tensor(edges, dtype=dtype, device=device)


@dataclass(frozen=True)
class Keying:
    """How keys map to buckets: ``edges`` are the lower bounds (the last bucket is open-ended; a key below the
    first edge goes to the first bucket). ``bucket_labels``: one per bucket (default, ``labels``: from integer
    edges, "4-7", "8+").
    ``report_empty``: a bucket with no token is reported (count 0, NaN statistics) rather than left out, for a
    short fixed bucketing whose series a dashboard keeps."""

    name: str
    edges: tuple[float, ...]
    bucket_labels: tuple[str, ...] | None = None
    report_empty: bool = False

    @property
    def labels(self) -> tuple[str, ...]:
        if self.bucket_labels is not None:
            return self.bucket_labels
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
        """Bucket index of each key (int64). Floating keys are compared in at least float32."""
        if keys.is_floating_point():
            keys = keys.to(torch.promote_types(keys.dtype, torch.float32))
        edges = _edges_on(self.edges[1:], keys.dtype, keys.device)
        return torch.bucketize(keys.contiguous(), edges, right=True)  # keys are often expanded views


def _prob_keying() -> Keying:
    lows, highs = PROB_BUCKET_EDGES[:-1], PROB_BUCKET_EDGES[1:]
    return Keying("prob", tuple(math.log(e) if e > 0 else -math.inf for e in lows),
                  tuple(f"{lo:g}-{hi:g}" for lo, hi in zip(lows, highs)), report_empty=True)


KEYINGS = {
    "prob": _prob_keying(),
    "position": Keying("position", (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)),
    "lag": Keying("lag", tuple(range(9))),
    "turn": Keying("turn", tuple(range(9))),
}


# The statistics the mismatch monitor's fused pass adds for ``KEYINGS["prob"]`` (its state fields ``bucket_count``,
# ``bucket_abs``), in the one pass it makes over the tokens anyway: the count and Σ|d| per bucket. The other fields
# would cost its Triton kernel registers per bucket; ``KeyedStats("prob")`` computes all of them.
PROB_BLOCK = ("count", "abs_sum")


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


def keyed_metrics(keying: Keying, values: dict[str, float], prefix: str = "tim") -> dict[str, float]:
    """The metrics of a merged state ``values`` ({"<label>/<field>": value}; the fields present, a subset of
    ``SUMS`` + ``MAXES`` that has ``count``) as ``<prefix>/by_<name>/<label>/<stat>``: every statistic whose field
    is there. Empty buckets are left out unless ``keying.report_empty`` (then count 0 and NaN)."""
    out, p = {}, f"{prefix}/by_{keying.name}"
    for label in keying.labels:
        n = values[f"{label}/count"]
        if n <= 0 and not keying.report_empty:  # the merged counts are the same on every rank
            continue
        out[f"{p}/{label}/count"] = n
        for stat, field in STATS.items():
            v = values.get(f"{label}/{field}")
            if v is not None:
                out[f"{p}/{label}/{stat}"] = math.nan if n <= 0 else v if field in MAXES else v / n
    return out


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
        keep = (mask != 0) & (d.abs() < math.inf) & (rollout > INVALID_LOGPROB_THRESHOLD) \
            & (train > INVALID_LOGPROB_THRESHOLD)
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
