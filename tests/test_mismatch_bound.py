"""The (1 − p) bound the metrics and reports state, checked on what the product reports.

If every logit moves by at most ε (|δ_b| <= ε), then for every token a

    Δ log p_a = δ_a − log Σ_b p_b e^{δ_b} = −log(p_a + (1 − p_a) e^{x}),
    x = log E_{b≠a}[e^{δ_b}] − δ_a ∈ [−2ε, 2ε]

so, exactly (not only to first order), |Δ log p_a| <= (e^{2ε} − 1)(1 − p_a) (= 2ε(1 − p_a) + O(ε²)). The
reports draw |Δ log p| against 1 − p with a c·(1 − p) envelope (``report/figures.py``) from two product binnings:
``MismatchMonitor``'s ``by_prob`` buckets of the sampled tokens' p and ``VocabProfile``'s 1 − p bins of the whole
vocabulary. Both must respect the bound per bin (a token binned by the wrong probability breaks it), match a
naive float64 binning written here, and reach the bound where the math says it is tight.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tim_plugins.distribution import VocabProfile
from tim_plugins.metrics import mismatch_metrics

TOL = 1e-12  # float64 rounding of log_softmax differences and of the binned means
# The monitor's buckets of p as documented by its metric keys (tim/by_prob/<lo>-<hi>/...), [lo, hi).
P_BUCKETS = ((0.0, 0.01), (0.01, 0.1), (0.1, 0.5), (0.5, 0.9), (0.9, 1.0))
# VocabProfile's 1 − p bins as its docstring states them: log-spaced over 1e-8 … 1, 4 per decade.
ONE_MINUS_P_EDGES = [10.0 ** (-8 + k / 4) for k in range(33)]


def _logprobs(z: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rollout, train) float64 log-probs: the train side's logits moved by delta."""
    return torch.log_softmax(z, -1), torch.log_softmax(z + delta, -1)


def _monitor(lp: torch.Tensor, lq: torch.Tensor) -> dict[str, float]:
    # Every vocabulary entry as one "sampled token": rows are sequences, entries their tokens.
    return mismatch_metrics(lp, lq, compile=False)


def _profile(lp: torch.Tensor, lq: torch.Tensor) -> dict[str, list[float]]:
    prof = VocabProfile()
    prof.update(lp, lq)
    return prof.curves(min_count=1)["one_minus_p"]


def _upper_edge(centre: float) -> float:
    """The upper 1 − p edge of the VocabProfile bin whose geometric centre is ``centre``."""
    return min(e for e in ONE_MINUS_P_EDGES if e > centre)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 4), v=st.integers(2, 300), seed=st.integers(0, 2**31 - 1), scale=st.floats(0.0, 20.0),
    eps=st.floats(1e-6, 3.0), kind=st.sampled_from(["uniform", "sign", "one_hot", "bf16_like"]),
)
def test_binned_mismatch_respects_the_one_minus_p_bound(rows, v, seed, scale, eps, kind):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, v, generator=gen, dtype=torch.float64) * scale
    if kind == "uniform":
        delta = (torch.rand(rows, v, generator=gen, dtype=torch.float64) * 2 - 1) * eps
    elif kind == "sign":  # extreme points of the ε-box: the worst cases live here
        delta = torch.where(torch.rand(rows, v, generator=gen) < 0.5, -1.0, 1.0).double() * eps
    elif kind == "one_hot":  # one token per row moves by ε, the rest by −ε
        delta = torch.full((rows, v), -eps, dtype=torch.float64)
        delta[torch.arange(rows), torch.randint(0, v, (rows,), generator=gen)] = eps
    else:  # rounding-like error: relative to |z|, clipped to ε
        delta = (z.abs() * 2.0**-8 * (torch.rand(rows, v, generator=gen, dtype=torch.float64) * 2 - 1)).clamp(-eps, eps)
    c = math.expm1(2 * eps)
    lp, lq = _logprobs(z, delta)

    m = _monitor(lp, lq)
    assert m["tim/tokens"] == rows * v
    assert sum(m[f"tim/by_prob/{lo:g}-{hi:g}/count"] for lo, hi in P_BUCKETS) == rows * v
    assert m["tim/token/abs_diff_max"] <= c + TOL
    for lo, hi in P_BUCKETS:
        mean = m[f"tim/by_prob/{lo:g}-{hi:g}/abs_diff_mean"]
        if not math.isnan(mean):  # every token of [lo, hi) has 1 − p <= 1 − lo
            assert mean <= c * (1 - lo) + TOL, (lo, hi, mean, c * (1 - lo))

    prof = _profile(lp, lq)
    assert sum(prof["count"]) == rows * v
    for centre, mx, mean in zip(prof["centre"], prof["max"], prof["mean"]):
        bound = c * _upper_edge(centre) + TOL
        assert mean <= mx + TOL and mx <= bound, (centre, mx, bound)


def _fixed_batch():
    """Rows from flat to peaked (so every p bucket and many 1 − p bins are populated: token 0 leads by up to 30
    nats, 1 − p down to ~1e-11), logits moved by <= 0.05."""
    gen = torch.Generator().manual_seed(7)
    spread = torch.linspace(0.5, 9.0, 48, dtype=torch.float64)[:, None]
    z = torch.randn(48, 257, generator=gen, dtype=torch.float64) * spread
    z[:, 0] += torch.linspace(0.0, 30.0, 48, dtype=torch.float64)
    delta = (torch.rand(48, 257, generator=gen, dtype=torch.float64) * 2 - 1) * 0.05
    return _logprobs(z, delta)


def test_monitor_buckets_match_a_naive_binning():
    lp, lq = _fixed_batch()
    p, d = lp.exp().flatten(), (lq - lp).abs().flatten()
    edges = torch.tensor([lo for lo, _ in P_BUCKETS[1:]], dtype=torch.float64)
    # Precondition of comparing bucket by bucket: no token so close to an edge that rounding picks its bucket.
    if not bool(((p[:, None] - edges).abs() > 1e-9).all()):
        raise AssertionError("fixed batch has a token on a bucket edge; pick another seed")
    m = _monitor(lp, lq)
    for lo, hi in P_BUCKETS:
        sel = (p >= lo) & (p < hi) if hi < 1.0 else p >= lo
        assert int(sel.sum()) > 0, (lo, hi)  # the batch reaches every bucket
        assert m[f"tim/by_prob/{lo:g}-{hi:g}/count"] == int(sel.sum())
        assert m[f"tim/by_prob/{lo:g}-{hi:g}/abs_diff_mean"] == pytest.approx(float(d[sel].mean()), rel=1e-12)
    assert m["tim/token/abs_diff_max"] == float(d.max())


def test_vocab_profile_bins_match_a_naive_binning():
    lp, lq = _fixed_batch()
    q, d = (1.0 - lp.exp()).flatten(), (lq - lp).abs().flatten()
    edges = torch.tensor(ONE_MINUS_P_EDGES[:-1], dtype=torch.float64)  # 1 − p = 1 belongs to the last bin anyway
    if not bool(((q[:, None] / edges - 1).abs() > 1e-6).all()):
        raise AssertionError("fixed batch has a token on a bin edge; pick another seed")
    prof = _profile(lp, lq)
    want = {}
    for k in range(len(ONE_MINUS_P_EDGES) - 1):
        lo, hi = ONE_MINUS_P_EDGES[k], ONE_MINUS_P_EDGES[k + 1]
        # The first bin also holds 1 − p below 1e-8 (p rounds to 1), the last one 1 − p = 1.
        sel = ((q >= lo) | (k == 0)) & ((q < hi) | (k == len(ONE_MINUS_P_EDGES) - 2))
        if sel.any():
            want[math.sqrt(lo * hi)] = (int(sel.sum()), float(d[sel].mean()), float(d[sel].max()))
    assert len(want) >= 10  # the batch spreads over many bins
    assert prof["centre"] == pytest.approx(sorted(want), rel=1e-12)
    for centre, count, mean, mx in zip(prof["centre"], prof["count"], prof["mean"], prof["max"]):
        ref = want[min(want, key=lambda c: abs(c - centre))]
        assert (count, mx) == (ref[0], ref[2]) and mean == pytest.approx(ref[1], rel=1e-12)


def test_reported_mismatch_reaches_the_bound_where_it_is_tight():
    """Token 0 (p ≈ 0.6) rises by ε, the rest fall by ε: its |Δ log p| is the bound to first order, and the
    product reports it in the right bin; the bound cannot be lowered by a constant factor."""
    eps = 1e-4
    z = torch.tensor([[2.0, 0.0, -1.0, 0.5]], dtype=torch.float64)
    lp, lq = _logprobs(z, torch.tensor([[eps, -eps, -eps, -eps]], dtype=torch.float64))
    p0 = math.exp(float(lp[0, 0]))
    first_order = 2 * eps * (1 - p0)
    m = _monitor(lp[:, :1], lq[:, :1])
    assert 0.9998 < m["tim/by_prob/0.5-0.9/abs_diff_mean"] / first_order <= math.expm1(2 * eps) / (2 * eps)
    prof = _profile(lp[:, :1], lq[:, :1])
    assert prof["count"] == [1] and _upper_edge(prof["centre"][0]) > 1 - p0
    assert 0.9998 < prof["max"][0] / first_order <= math.expm1(2 * eps) / (2 * eps)
