"""The bucketings of ``tim_plugins.by_key`` and the metrics of their merged state, without torch.

``by_key`` documents the bucketings and computes their statistics (torch); what names them and turns a merged state
into metrics lives here, so that the metrics of a state read back on the host (``_mismatch_derive``, the report of a
dump) need no torch. ``by_key`` re-exports every name.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tim_plugins._mismatch_layout import PROB_BUCKET_EDGES

if TYPE_CHECKING:
    import torch

__all__ = ["KEYINGS", "MAXES", "PROB_BLOCK", "STATS", "SUMS", "Keying", "keyed_metrics"]

# The per-bucket state: sums (the first is the count), then maxima; and each metric besides ``count`` with its
# field (a sum divided by the bucket's count, a maximum as it is).
SUMS = ("count", "abs_sum", "d_sum", "k3_sum")
MAXES = ("abs_max",)
STATS = {"abs_diff_mean": "abs_sum", "mean": "d_sum", "kl_k3": "k3_sum", "abs_diff_max": "abs_max"}


@functools.lru_cache(maxsize=64)
def _edges_on(edges: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The bucket edges as a tensor on ``device``, made once: a host-to-device copy per update would wait for the
    device every micro-batch."""
    import torch

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
        import torch

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
