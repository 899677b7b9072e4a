"""IS corrections against per-element Python formulas, empty kept sets, NaN inputs, and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tim_plugins.corrections import (
    CORRECTION_MODES,
    CorrectionConfig,
    apply_correction,
    geo_rs,
    icepop,
    masked_mean,
    seq_mis,
    seq_tis,
    token_mis,
    token_tis,
)

MODES = [m for m in CORRECTION_MODES]


def _exp(x):
    return math.exp(x) if x < 700 else math.inf


def naive(mode, train, rollout, mask, cfg: CorrectionConfig):
    """Per-element Python version of the documented formulas. Inputs: nested lists. → (weights, keep)."""
    B, T = len(train), len(train[0])
    W = [[0.0] * T for _ in range(B)]
    K = [[False] * T for _ in range(B)]
    for b in range(B):
        valid, d = [], []
        for t in range(T):
            x, y = train[b][t], rollout[b][t]
            ok = bool(mask[b][t]) and math.isfinite(x) and math.isfinite(y) and x > -1e3 and y > -1e3
            valid.append(ok)
            d.append(x - y if ok else 0.0)
        in_mask = [bool(mask[b][t]) for t in range(T)]
        row_ok = all(valid[t] or not in_mask[t] for t in range(T))
        S = sum(d[t] for t in range(T) if valid[t])
        n = sum(valid)
        for t in range(T):
            if not valid[t]:
                continue
            rho = _exp(min(d[t], cfg.log_ratio_clamp))
            if mode == "none":
                W[b][t], K[b][t] = 1.0, True
            elif mode == "token_tis":
                W[b][t], K[b][t] = min(rho, cfg.token_clip), True
            elif mode == "token_mis":
                if rho <= cfg.token_clip:
                    W[b][t], K[b][t] = rho, True
            elif mode == "icepop":
                lo, hi = cfg.icepop_band
                if lo <= rho <= hi:
                    W[b][t], K[b][t] = rho, True
            elif mode == "seq_tis":
                if row_ok:
                    W[b][t], K[b][t] = min(_exp(S), cfg.seq_clip), True
            elif mode == "seq_mis":
                # Decided as documented, S <= log C: exact where exp(S) would round (S = 1e-80 > log 1 = 0 is
                # rejected although exp(S) == 1.0 in float64).
                if row_ok and S <= math.log(cfg.seq_clip):
                    W[b][t], K[b][t] = _exp(S), True
            elif mode == "geo_rs":
                lo, hi = cfg.geo_band
                if row_ok and lo <= _exp(S / n) <= hi:
                    W[b][t], K[b][t] = 1.0, True
    return W, K


def _check_against_naive(mode, train, rollout, mask, cfg, rtol):
    res = apply_correction(CorrectionConfig(**{**cfg.__dict__, "mode": mode}), train, rollout, mask)
    W, K = naive(mode, train.double().tolist(), rollout.double().tolist(), mask.tolist(), cfg)
    assert res.mask.dtype == torch.bool and res.mask.tolist() == K
    torch.testing.assert_close(res.weights.double(), torch.tensor(W, dtype=torch.float64), rtol=rtol, atol=0.0)
    return res


finite_lp = st.floats(-12.0, 0.0, allow_nan=False)
special_lp = st.sampled_from([math.nan, math.inf, -math.inf, -1e4, 0.0, -1e-9])
lp = st.one_of(finite_lp, finite_lp, finite_lp, special_lp)


@st.composite
def batches(draw, max_b=4, max_t=9):
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    train = draw(st.lists(st.lists(lp, min_size=T, max_size=T), min_size=B, max_size=B))
    # rollout close to train for most tokens so that thresholds cut in the middle of the distribution
    noise = draw(st.lists(st.lists(st.floats(-1.5, 1.5), min_size=T, max_size=T), min_size=B, max_size=B))
    rollout = [[x + e if math.isfinite(x) else -2.0 for x, e in zip(rt, rn)] for rt, rn in zip(train, noise)]
    if draw(st.booleans()):
        rollout[0][0] = draw(special_lp)
    mask = draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B))
    return (torch.tensor(train, dtype=torch.float64), torch.tensor(rollout, dtype=torch.float64),
            torch.tensor(mask))


configs = st.builds(
    CorrectionConfig,
    token_clip=st.sampled_from([0.5, 1.0, 1.5, 2.0, 5.0]),
    seq_clip=st.sampled_from([0.1, 1.0, 2.0, 10.0]),
    icepop_band=st.sampled_from([(0.5, 5.0), (0.8, 1.25), (0.0, 2.0)]),
    geo_band=st.sampled_from([(0.99, 1.01), (0.5, 2.0), (1.0, 1.0)]),
)


@settings(max_examples=60, deadline=None)
@given(data=batches(), cfg=configs)
def test_every_mode_matches_naive_formula(data, cfg):
    train, rollout, mask = data
    for mode in MODES:
        res = _check_against_naive(mode, train, rollout, mask, cfg, rtol=1e-12)
        w, m = res.weights, res.mask
        # properties: finite, detached, zero off-mask, new mask ⊆ mask, counts consistent
        assert torch.isfinite(w).all() and not w.requires_grad
        assert not (m & ~mask).any() and (w[~m] == 0).all() and (w >= 0).all()
        assert res.kept_tokens.item() == m.sum().item() and res.input_tokens.item() == mask.sum().item()
        if mode in ("token_tis", "token_mis"):
            assert (w <= cfg.token_clip).all()
        elif mode in ("seq_tis", "seq_mis"):
            assert (w <= cfg.seq_clip * (1 + 1e-12)).all()
            # one weight per row
            for b in range(w.shape[0]):
                assert w[b][m[b]].unique().numel() <= 1
        elif mode == "icepop":
            lo, hi = cfg.icepop_band
            assert ((w[m] >= lo) & (w[m] <= hi)).all()
        elif mode in ("geo_rs", "none"):
            assert (w[m] == 1).all()


@settings(max_examples=40, deadline=None)
@given(data=batches(), c1=st.floats(0.2, 4.0), c2=st.floats(0.2, 4.0))
def test_masks_are_monotone_in_thresholds(data, c1, c2):
    """A looser threshold never removes a token; every new mask is a subset of the input mask."""
    train, rollout, mask = data
    lo_c, hi_c = sorted((c1, c2))
    narrow_band, wide_band = (1 / (1 + lo_c), 1 + lo_c), (1 / (1 + hi_c), 1 + hi_c)  # nested bands around 1
    pairs = [
        (token_mis(train, rollout, mask, clip=lo_c)[1], token_mis(train, rollout, mask, clip=hi_c)[1]),
        (seq_mis(train, rollout, mask, clip=lo_c)[1], seq_mis(train, rollout, mask, clip=hi_c)[1]),
        (icepop(train, rollout, mask, band=narrow_band)[1], icepop(train, rollout, mask, band=wide_band)[1]),
        (geo_rs(train, rollout, mask, band=narrow_band)[1], geo_rs(train, rollout, mask, band=wide_band)[1]),
    ]
    for narrow, wide in pairs:
        assert not (narrow & ~wide).any() and not (wide & ~mask).any()


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-6), (torch.float16, 2e-6)])
def test_low_precision_inputs(dtype, rtol):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 37  # odd sizes
    train = (-torch.rand(B, T, generator=g) * 6).to(dtype)
    rollout = (train.float() + torch.randn(B, T, generator=g) * 0.3).to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[2] = False
    cfg = CorrectionConfig(seq_clip=50.0, geo_band=(0.8, 1.25))
    tr, ro = train.double().tolist(), rollout.double().tolist()
    for mode in MODES:
        res = apply_correction(CorrectionConfig(**{**cfg.__dict__, "mode": mode}), train, rollout, mask)
        assert res.weights.dtype == torch.float32
        W, K = naive(mode, tr, ro, mask.tolist(), cfg)
        W = torch.tensor(W, dtype=torch.float64)
        K = torch.tensor(K)
        # decisions: equal except where ρ sits within float32 rounding of a threshold
        assert (res.mask != K).float().mean().item() <= 0.01
        both = res.mask & K
        torch.testing.assert_close(res.weights.double()[both], W[both], rtol=rtol * T, atol=0.0)


def test_fully_masked_rows_and_all_rejected_give_no_nan():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0], [-0.1, -0.2, -0.3]], requires_grad=True)
    rollout = torch.tensor([[-2.0, -3.0, -1.5], [-1.0, -1.0, -1.0], [-0.1, -0.2, -0.3]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0]])
    # seq_mis with C = 1.5: row 0 has ρ_seq = e^3 > C → rejected; row 2 has ρ_seq = 1 → kept
    res = apply_correction("seq_mis", train, rollout, mask, seq_clip=1.5)
    assert res.mask.tolist() == [[False] * 3, [False] * 3, [True, True, False]]
    m = res.metrics()
    assert m["tim/correction/seq_rejected_frac"] == pytest.approx(0.5)  # of the 2 non-empty rows
    assert m["tim/correction/kept_frac"] == pytest.approx(2 / 5)
    # now reject everything
    res = apply_correction("seq_mis", train, rollout, mask, seq_clip=0.5)
    assert not res.mask.any() and (res.weights == 0).all() and bool(res.empty)
    per_token_loss = -train * 3.0
    loss = masked_mean(res.weights * per_token_loss, res.mask)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(train.grad).all() and (train.grad == 0).all()
    m = res.metrics()
    assert m["tim/correction/kept_frac"] == 0.0 and m["tim/correction/seq_rejected_frac"] == 1.0
    assert m["tim/correction/empty"] == 1.0
    # a naive mean over the kept set is the NaN this guards against
    assert math.isnan(((res.weights * per_token_loss)[res.mask]).mean().item())
    # empty input mask: every mode returns zeros, fractions undefined (NaN), never 0/0 in the weights
    empty = torch.zeros_like(mask)
    for mode in MODES:
        r = apply_correction(mode, train, rollout, empty)
        assert not r.mask.any() and (r.weights == 0).all() and torch.isfinite(r.weights).all()
        assert math.isnan(r.metrics()["tim/correction/kept_frac"]) and r.metrics()["tim/correction/empty"] == 1.0


def test_nan_and_placeholder_inputs():
    train = torch.tensor([[-1.0, math.nan, -0.5, -2.0], [-1.0, -1.0, -1.0, -1.0], [-0.3, -0.2, -0.1, -0.4]])
    rollout = torch.tensor([[-1.1, -1.0, -0.6, -1e4], [-1.1, -1.1, -1.1, math.nan], [-0.3, -0.2, -0.1, -math.inf]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    # row 1's NaN is off-mask: it must change nothing
    tis = apply_correction("token_tis", train, rollout, mask)
    assert tis.mask.tolist() == [[True, False, True, False], [True, True, True, False], [True, True, True, False]]
    assert tis.invalid_tokens.item() == 3
    for mode in ("seq_tis", "seq_mis", "geo_rs"):
        r = apply_correction(mode, train, rollout, mask, seq_clip=10.0, geo_band=(0.5, 2.0))
        assert r.mask.tolist()[0] == [False] * 4 and r.mask.tolist()[2] == [False] * 4  # unknown ρ_seq
        assert r.mask.tolist()[1] == [True, True, True, False]
        assert torch.isfinite(r.weights).all()
    clean = apply_correction("seq_tis", train[1:2], rollout[1:2].nan_to_num(-1.1), mask[1:2], seq_clip=10.0)
    r = apply_correction("seq_tis", train, rollout, mask, seq_clip=10.0)
    assert torch.equal(r.weights[1], clean.weights[0])
    assert r.weights[1, 0].item() == pytest.approx(math.exp(0.3), rel=1e-6)


def test_long_sequences_do_not_overflow():
    T = 10_000
    train = torch.full((3, T), -1.0)
    # d per token: row 0 +0.5 (S = +5000, ρ_seq = e^5000), row 1 0 (S = 0), row 2 −0.5 (S = −5000)
    rollout = torch.stack([torch.full((T,), -1.5), torch.full((T,), -1.0), torch.full((T,), -0.5)])
    mask = torch.ones(3, T, dtype=torch.bool)
    tis = seq_tis(train, rollout, mask, clip=2.0)[0]
    assert tis[0, 0].item() == 2.0 and tis[1, 0].item() == 1.0 and tis[2, 0].item() == 0.0  # e^-5000 → 0
    w, keep = seq_mis(train, rollout, mask, clip=2.0)
    assert keep.tolist() == [[False] * T, [True] * T, [True] * T] and torch.isfinite(w).all()
    w, keep = geo_rs(train, rollout, mask, band=(0.99, 1.01))
    assert keep[:, 0].tolist() == [False, True, False]
    w, keep = token_mis(train + 100, rollout, mask, clip=2.0)  # d = 100.5: clamp keeps exp finite
    assert not keep[0].any() and torch.isfinite(w).all()
    assert token_tis(train + 100, rollout, mask, clip=2.0)[0][0, 0].item() == 2.0


def test_composite_modes_multiply_and_intersect():
    g = torch.Generator().manual_seed(3)
    train = -torch.rand(5, 11, generator=g) * 3
    rollout = train + torch.randn(5, 11, generator=g) * 0.05
    mask = torch.rand(5, 11, generator=g) > 0.1
    w1, m1 = geo_rs(train, rollout, mask, band=(0.98, 1.02))
    w2, m2 = token_tis(train, rollout, mask, clip=1.05)
    r = apply_correction("geo_rs+token_tis", train, rollout, mask, geo_band=(0.98, 1.02), token_clip=1.05)
    assert torch.equal(r.mask, m1 & m2)
    assert torch.equal(r.weights, torch.where(m1 & m2, w1 * w2, torch.zeros(())))
    assert 0 < r.kept_tokens.item() < mask.sum().item()


def test_weights_are_detached():
    train = torch.randn(2, 5, requires_grad=True)
    rollout = train.detach() + 0.1
    for mode in MODES:
        r = apply_correction(mode, train, rollout, torch.ones(2, 5))
        assert not r.weights.requires_grad


def test_masked_mean_matches_naive():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, generator=g, dtype=torch.float64)
    m = torch.rand(4, 7, generator=g) > 0.5
    m[1] = False
    x[~m] = math.nan  # garbage off-mask must not leak
    flat = [v for row, mr in zip(x.tolist(), m.tolist()) for v, k in zip(row, mr) if k]
    assert masked_mean(x, m).item() == pytest.approx(sum(flat) / len(flat), rel=1e-12)
    rows = masked_mean(x, m, dim=-1).tolist()
    for b in range(4):
        vals = [v for v, k in zip(x[b].tolist(), m[b].tolist()) if k]
        assert rows[b] == (pytest.approx(sum(vals) / len(vals), rel=1e-12) if vals else 0.0)
    v = torch.tensor([math.nan, 2.0, math.inf], requires_grad=True)
    out = masked_mean(v, torch.tensor([False, True, False]))
    out.backward()
    assert out.item() == 2.0 and v.grad.tolist() == [0.0, 1.0, 0.0]
    v.grad = None
    out = masked_mean(v, torch.zeros(3, dtype=torch.bool))  # empty: 0, zero gradient, no 0/0
    out.backward()
    assert out.item() == 0.0 and v.grad.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(mode="tis"), "'tis'"),
        (dict(mode="none+token_tis"), "none"),
        (dict(mode="token_tis+token_tis"), "twice"),
        (dict(token_clip=0.0), "token_clip=0.0"),
        (dict(seq_clip=math.inf), "seq_clip=inf"),
        (dict(icepop_band=(5.0, 0.5)), r"icepop_band=\(5.0, 0.5\)"),
        (dict(geo_band=(1.1, 1.2)), r"geo_band=\(1.1, 1.2\)"),
        (dict(log_ratio_clamp=100.0), "log_ratio_clamp=100.0"),
        (dict(token_clip=1e9), "token_clip=1000000000.0"),
    ],
)
def test_config_errors_quote_value(kw, match):
    with pytest.raises(ValueError, match=match):
        CorrectionConfig(**kw)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        token_tis(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
