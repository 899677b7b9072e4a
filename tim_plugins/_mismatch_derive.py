"""The mismatch monitor's metrics from its state, without torch: every metric's formula, in one place.

``MismatchMonitor.compute`` derives its metrics here from the state it reads back to the host, and so does the
report from the state it accumulates over a dump's rows (``tim_plugins.report``), which needs no torch.
``tim_plugins.metrics`` re-exports ``_derive``.
"""

from __future__ import annotations

import functools
import math

from tim_plugins._keyings import KEYINGS, PROB_BLOCK, keyed_metrics
from tim_plugins._mismatch_layout import abs_diff_bin_edge_values

__all__ = ["_derive"]

_BIN_EDGES = list(abs_diff_bin_edge_values())


@functools.lru_cache(maxsize=8)
def _metric_keys(prefix: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``_derive``'s keys in its value order, and the IS keys."""
    token = ("abs_diff_mean", "abs_diff_max", "prob_abs_diff_mean", "prob_abs_diff_max", "kl_k1", "kl_k3", "chi2",
             "ratio_mean", "ratio_min", "ratio_max", "ratio_outside_frac", "abs_diff_p99", "abs_diff_p999")
    keys = [f"{prefix}/tokens", f"{prefix}/invalid_tokens", *(f"{prefix}/token/{k}" for k in token),
            f"{prefix}/seq/count", f"{prefix}/seq/log_ratio_mean", f"{prefix}/seq/log_ratio_abs_max"]
    is_keys = tuple(f"{prefix}/is/{k}" for k in ("weight_mean", "weight_min", "weight_max", "masked_frac", "ess"))
    return tuple(keys), is_keys


def _exp(x: float) -> float:
    """e^x in float64, inf past its range (math.exp raises there)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _derive(s: dict, prefix: str) -> dict[str, float]:
    """The metric dict of an (unpacked, host) state: every metric's formula, in one place."""
    nan, n = math.nan, s["tokens"]
    if n > 0:
        inv_n = 1.0 / n
        abs_d_max = s["abs_d_max"] if s["abs_d_max"] != -math.inf else nan
        token = [
            s["abs_d"] * inv_n, abs_d_max,
            s["abs_p"] * inv_n, s["abs_p_max"] if s["abs_p_max"] != -math.inf else nan,
            s["neg_d"] * inv_n, s["k3"] * inv_n,
            (2.0 * s["rho_m1"] + s["rho_m1_sq"]) * inv_n,  # chi2 = E[ρ²] − 1 = 2 E[ρ − 1] + E[(ρ − 1)²]
            1.0 + s["rho_m1"] * inv_n, _exp(-s["neg_d_min"]) if s["neg_d_min"] != -math.inf else nan,
            1.0 + s["rho_m1_max"] if s["rho_m1_max"] != -math.inf else nan,
            s["outside"] * inv_n,
            *_hist_quantiles(_fold_signed(s["hist"]), (0.99, 0.999), abs_d_max),
        ]
    else:
        token = [nan] * 13
    seqs = s["seqs"]
    seq = [seqs, s["seq_log_ratio"] / seqs, s["seq_abs_max"]] if seqs > 0 else [seqs, nan, nan]
    keys, is_keys = _metric_keys(prefix)
    out = dict(zip(keys, [n, s["invalid"], *token, *seq]))
    out.update(keyed_metrics(KEYINGS["prob"], _prob_values(s), prefix))
    is_n, is_w, is_w2 = s["is_tokens"], s["is_w"], s["is_w2"]
    if is_n > 0:
        out.update(zip(is_keys, (
            is_w / is_n, -s["neg_is_w_min"], s["is_w_max"], s["is_masked"] / is_n,
            is_w * is_w / (is_n * is_w2) if is_w2 > 0 else 0.0,  # Kish ESS, normalised: (Σw)² / (N Σw²)
        )))
    return out


def _prob_values(s: dict) -> dict[str, float]:
    """The state's probability block (``bucket_count``, ``bucket_abs``) as ``by_key``'s per-bucket fields."""
    fields = dict(zip(PROB_BLOCK, (s["bucket_count"].tolist(), s["bucket_abs"].tolist())))
    return {f"{label}/{f}": v[i] for i, label in enumerate(KEYINGS["prob"].labels) for f, v in fields.items()}


def _fold_signed(hist):
    """Signed d histogram (numpy) → |d| histogram (bin 0 is |d| < E_0, the last bin |d| >= E_K)."""
    centre = (len(hist) - 1) // 2
    folded = hist[centre:].copy()  # bin i >= 1 holds +d of |d| bin i; add the mirrored −d bin
    folded[1:] += hist[:centre][::-1]
    return folded


def _hist_quantiles(abs_counts, qs: tuple[float, ...], exact_max: float) -> list[float]:
    """For each q: the upper edge of the bin holding the q-quantile of |d|, capped at the exact max; 0.0 if it
    lies below the histogram's resolution (1e-8)."""
    cum = abs_counts.cumsum()
    total = float(cum[-1]) if cum.size else 0.0
    if total <= 0:
        return [math.nan] * len(qs)
    found = cum.searchsorted([q * total for q in qs], side="left").tolist()  # first bin with cum >= q·N
    return [0.0 if i == 0 else min(_BIN_EDGES[i] if i < len(_BIN_EDGES) else math.inf, exact_max) for i in found]
