"""The mismatch monitor against naive per-token reference formulas written here, token by token."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tim_plugins.metrics import (
    PROB_BUCKET_EDGES,
    MismatchMonitor,
    abs_diff_bin_edges,
    mismatch_metrics,
)

# Relative tolerance of the monitor's sums vs the float64 reference, by input dtype. The monitor computes in
# fp32 (half inputs are upcast exactly), so the table depends on the compute dtype, not the storage dtype.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5, torch.float64: 1e-10}
EPS32 = 2.0**-23  # float32's machine epsilon
# k3 and chi2 to a few float32 roundings at any |d|, fp32 noise included (see ``_mismatch_layout``): per token,
# and for a batch whose Σ(ρ − 1) cancels across tokens. Without the series, k3 is ~ε/|d| off (10⁶ε at 1e-7).
SMALL_D_RTOL = 4 * EPS32


def k3_f64(x: float) -> float:
    """e^x − 1 − x in float64 to ~1e-13 relative: the Taylor series to x⁵ below |x| = 1e-3 (the first term left
    out is < 3e-15 of the sum), expm1(x) − x from there (expm1's rounding, ~1.1e-16·|x|, is < 2.3e-13 of it)."""
    if abs(x) < 1e-3:
        return x * x * (1 / 2 + x * (1 / 6 + x * (1 / 24 + x / 120)))
    return math.expm1(x) - x


def reference(rollout, train, mask, is_weights=None, band=(0.5, 2.0)):
    """Naive reference: python loops over tokens in float64, straight from the metric table."""
    r = rollout.double().tolist()
    t = train.double().tolist()
    m = mask.bool().tolist()
    w = None if is_weights is None else is_weights.double().tolist()
    toks, invalid, seq_sums = [], 0, []
    ws = []
    for b in range(len(r)):
        s, any_valid = 0.0, False
        for j in range(len(r[b])):
            if not m[b][j]:
                continue
            rv, tv = r[b][j], t[b][j]
            if not (math.isfinite(rv) and math.isfinite(tv)) or rv <= -1e3 or tv <= -1e3:
                invalid += 1
                continue
            toks.append((rv, tv))
            s += tv - rv
            any_valid = True
            if w is not None and math.isfinite(w[b][j]):
                ws.append(w[b][j])
        if any_valid:
            seq_sums.append(s)
    out = {"tim/tokens": len(toks), "tim/invalid_tokens": invalid}
    if toks:
        d = [tv - rv for rv, tv in toks]
        rho = [math.exp(x) for x in d]
        rho_m1 = [math.expm1(x) for x in d]  # ρ − 1 to float64 rounding (exp(x) − 1 would cancel for ρ ≈ 1)
        n = len(d)
        out.update({
            "tim/token/abs_diff_mean": sum(abs(x) for x in d) / n,
            "tim/token/abs_diff_max": max(abs(x) for x in d),
            "tim/token/prob_abs_diff_mean": sum(abs(math.exp(tv) - math.exp(rv)) for rv, tv in toks) / n,
            "tim/token/prob_abs_diff_max": max(abs(math.exp(tv) - math.exp(rv)) for rv, tv in toks),
            "tim/token/kl_k1": sum(-x for x in d) / n,
            "tim/token/kl_k3": math.fsum(k3_f64(x) for x in d) / n,
            "tim/token/chi2": (2 * math.fsum(rho_m1) + math.fsum(x * x for x in rho_m1)) / n,  # E[ρ²] − 1
            "tim/token/ratio_mean": 1 + math.fsum(rho_m1) / n,
            "tim/token/ratio_min": min(rho),
            "tim/token/ratio_max": max(rho),
            "tim/token/ratio_outside_frac": sum(1 for x in rho if x < band[0] or x > band[1]) / n,
            "tim/seq/log_ratio_mean": sum(seq_sums) / len(seq_sums),
            "tim/seq/log_ratio_abs_max": max(abs(x) for x in seq_sums),
            "_abs_d": sorted(abs(x) for x in d),
        })
        for lo, hi in zip(PROB_BUCKET_EDGES[:-1], PROB_BUCKET_EDGES[1:]):
            last = hi == 1.0
            sel = [abs(tv - rv) for rv, tv in toks if lo <= math.exp(rv) and (math.exp(rv) < hi or last)]
            key = f"tim/by_prob/{lo:g}-{hi:g}"
            out[f"{key}/count"] = len(sel)
            if sel:
                out[f"{key}/abs_diff_mean"] = sum(sel) / len(sel)
    if ws:
        out["tim/is/weight_mean"] = sum(ws) / len(ws)
        out["tim/is/weight_min"] = min(ws)
        out["tim/is/weight_max"] = max(ws)
        out["tim/is/masked_frac"] = sum(1 for x in ws if x == 0) / len(ws)
        out["tim/is/ess"] = sum(ws) ** 2 / (len(ws) * sum(x * x for x in ws))
    return out


def assert_matches(got, ref, rtol=1e-5, atol=1e-7):
    for key, want in ref.items():
        if key.startswith("_"):
            continue
        assert key in got, key
        assert got[key] == pytest.approx(want, rel=rtol, abs=atol), (key, got[key], want)


def make_batch(B, T, V=383, seed=0, noise=0.05, dtype=torch.float32, mask_p=0.8):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 3
    tokens = torch.randint(0, V, (B, T), generator=g)
    rollout = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    perturbed = logits + noise * torch.randn(B, T, V, generator=g)
    train = torch.log_softmax(perturbed, -1).gather(-1, tokens[..., None])[..., 0]
    mask = torch.rand(B, T, generator=g) < mask_p
    return rollout.to(dtype), train.to(dtype), mask


def small_d_tokens(dtype=torch.float32, seed=0):
    """(rollout, train) 1-d tensors of ``dtype``, a token per d = train − rollout: |d| log-spaced from 1e-7 to 1
    (six a decade), then 1.001, 1.5 and 3 past the series' bound, both signs. The rollout log-prob is 2..16 times
    |d|, so that half-precision inputs still resolve d; the reference reads d from the values as stored."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    size = torch.cat([torch.logspace(-7, 0, 43, dtype=f64), torch.tensor([1.001, 1.5, 3.0], dtype=f64)])
    target = torch.cat([size, -size])
    rollout = (-size.repeat(2) * (2 + 14 * torch.rand(target.shape, generator=g, dtype=torch.float64))).to(dtype)
    train = (rollout.double() + target).to(dtype)
    keep = train != rollout
    return rollout[keep], train[keep]


def assert_k3_and_chi2_per_token(new_monitor, rollout, train, device="cpu"):
    """Each token alone in a fresh monitor (``new_monitor()``), as 32 copies in one row (so that vectorised code
    runs, and the float32 sum of 32 equal terms is exact): kl_k3 and chi2 are then that token's k3 and
    ρ² − 1 = expm1(2d), within SMALL_D_RTOL of float64 (d exact: the difference of two stored values)."""
    worst = []
    for rv, tv in zip(rollout.tolist(), train.tolist()):
        got = new_monitor().update(torch.full((1, 32), rv, dtype=rollout.dtype, device=device),
                                   torch.full((1, 32), tv, dtype=train.dtype, device=device)).compute()
        x = tv - rv
        for key, want in (("tim/token/kl_k3", k3_f64(x)), ("tim/token/chi2", math.expm1(2 * x))):
            worst.append((abs(got[key] - want) / abs(want), key, x, got[key], want))
    worst.sort(reverse=True)
    assert len(worst) >= 160 and worst[0][0] <= SMALL_D_RTOL, worst[:5]


def cancelling_batch(noise: float, B=4, T=128, seed=0):
    """float32 log-probs r with a recomputation's noise: t = r + a few float32 ulps of r (``noise`` 0), or
    r + N(0, ``noise``²) rounded to float32. Tokens come in mirrored pairs, (r, t) then (t, r), so Σd = 0 exactly
    and Σ(ρ − 1) = Σ over pairs of e^d + e^−d − 2 ≈ d² is what is left of it: the sum cancels across tokens, as it
    does on policy (E[ρ − 1] = 0), here exactly."""
    g = torch.Generator().manual_seed(seed)
    r = -0.05 - 8 * torch.rand(B, T // 2, generator=g)
    if noise == 0:
        steps = torch.randint(1, 4, r.shape, generator=g) * torch.where(torch.rand(r.shape, generator=g) < 0.5, -1, 1)
        t = r + steps * (torch.nextafter(r, torch.zeros(())) - r).abs()
    else:
        t = (r.double() + noise * torch.randn(r.shape, generator=g, dtype=torch.float64)).float()
    rollout = torch.stack([r, t], -1).reshape(B, T)
    train = torch.stack([t, r], -1).reshape(B, T)
    return rollout, train, torch.ones(B, T, dtype=torch.bool)


def assert_k3_and_chi2_of_cancelling_batches(new_monitor, device="cpu"):
    """``cancelling_batch`` at fp32 noise and at 1e-5, 1e-3: kl_k3, chi2 and the ratio mean within SMALL_D_RTOL of
    the reference (the sums add a rounding or two to the per-token terms')."""
    for noise in (0.0, 1e-5, 1e-3):
        r, t, m = cancelling_batch(noise)
        got = new_monitor().update(r.to(device), t.to(device), m.to(device)).compute()
        want = reference(r, t, m)
        assert got["tim/token/kl_k1"] == 0.0  # Σd = 0: the pairs cancel exactly
        for key in ("tim/token/kl_k3", "tim/token/chi2", "tim/token/ratio_mean"):
            err = abs(got[key] - want[key]) / abs(want[key])
            assert err <= SMALL_D_RTOL, (noise, key, got[key], want[key], err / EPS32)


def extreme_tokens(dtype=torch.float32):
    """(rollout, train) pairs of ``dtype``, valid by the monitor's rule (finite, above -1e3), where p_rollout = e^r
    underflows to 0 or is a denormal while ρ − 1 = expm1(d) overflows, both orders, near the placeholder threshold,
    both probabilities denormal, and ordinary and tiny d."""
    far = {torch.float32: [-110.0, -95.0], torch.float64: [-800.0, -720.0]}[dtype]  # e^r 0, denormal; d > log(max)
    pairs = [(r, -0.5) for r in far] + [(-0.5, far[0]), (-999.0, -1e-3), (-1e-3, -999.0), (-200.0, -100.0),
                                        (-2.0, -2.0 + 2.0**-20), (-0.7, -1.3)]
    return torch.tensor(pairs, dtype=dtype).unbind(-1)


def assert_prob_abs_diff_per_token(new_monitor, dtype=torch.float32, device="cpu"):
    """Each ``extreme_tokens`` pair alone in a fresh monitor, as 32 copies in one row: prob_abs_diff_mean and _max
    are |e^t − e^r| in float64 (from the stored values) to a few roundings of the compute dtype (absolutely at
    denormals, whose precision is absolute); float64 inputs to 1e-9, the reference's own cancellation at d ≈ 1e-6."""
    eps, tiny = (4 * EPS32, 1e-44) if dtype != torch.float64 else (1e-9, 1e-320)
    rollout, train = extreme_tokens(dtype)
    for rv, tv in zip(rollout.tolist(), train.tolist()):
        got = new_monitor().update(torch.full((1, 32), rv, dtype=dtype, device=device),
                                   torch.full((1, 32), tv, dtype=dtype, device=device)).compute()
        want = abs(math.exp(tv) - math.exp(rv))
        for key in ("tim/token/prob_abs_diff_mean", "tim/token/prob_abs_diff_max"):
            assert got[key] == pytest.approx(want, rel=eps, abs=tiny), (key, rv, tv, got[key], want)


def assert_ratio_extremes_of_tail_tokens(new_monitor, device="cpu"):
    """One batch whose smallest d is far in the tail (ρ from 0.6 down to 1e-26) next to ordinary tokens: ratio_min
    is exp(min d) and ratio_max exp(max d), each to float32 rounding of float64 (d exact: the difference of two
    stored float32 values), not 1 − (1 − ρ), which cancels to 0 below ρ ≈ 6e-8."""
    for d_min in (-0.5, -9.0, -17.0, -25.0, -60.0):
        r = torch.tensor([[-0.25, -1.5, -3.0, -0.75]], device=device)
        t = torch.tensor([[-0.25 + d_min, -1.25, -3.5, -0.5]], device=device)
        got = new_monitor().update(r, t).compute()
        d = (t.double() - r.double()).cpu()
        assert got["tim/token/ratio_min"] == pytest.approx(math.exp(d.min()), rel=4 * EPS32), (d_min, got)
        assert got["tim/token/ratio_max"] == pytest.approx(math.exp(d.max()), rel=4 * EPS32), (d_min, got)


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_ratio_extremes_of_tail_tokens(path):
    if path == "compiled":
        pytest.importorskip("torch._inductor")
    assert_ratio_extremes_of_tail_tokens(lambda: MismatchMonitor(compile=path == "compiled"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (7, 129)])
def test_matches_reference(dtype, shape):
    rollout, train, mask = make_batch(*shape, dtype=dtype)
    mask[0] = False  # a fully masked row must not count as a sequence
    got = mismatch_metrics(rollout, train, mask, compile=False)
    # The reference sees the same (rounded) half-precision values the monitor sees.
    ref = reference(rollout, train, mask)
    assert_matches(got, ref, rtol=RTOL[dtype])
    assert got["tim/seq/count"] == sum(1 for row in mask.tolist() if any(row))


def test_invalid_inputs_are_counted_not_raised():
    rollout, train, mask = make_batch(4, 9)
    mask[:] = True
    rollout[0, 0] = float("nan")
    train[0, 1] = float("inf")
    rollout[1, 2] = -float("inf")
    rollout[1, 3] = -9999.0  # placeholder for "no log-prob reported"
    train[2, 4] = -1e3  # at the threshold: invalid
    mask[3, 5] = False
    rollout[3, 5] = float("nan")  # masked out: neither valid nor invalid
    got = mismatch_metrics(rollout, train, mask)
    assert got["tim/invalid_tokens"] == 5
    assert got["tim/tokens"] == 4 * 9 - 6
    assert_matches(got, reference(rollout, train, mask))
    assert all(math.isfinite(v) for k, v in got.items() if "by_prob" not in k)


def test_fully_masked_batch_reports_zero_tokens_and_nan_stats():
    rollout, train, mask = make_batch(2, 5)
    got = mismatch_metrics(rollout, train, torch.zeros_like(mask))
    assert got["tim/tokens"] == 0 and got["tim/seq/count"] == 0
    assert math.isnan(got["tim/token/kl_k3"]) and math.isnan(got["tim/token/abs_diff_max"])
    assert math.isnan(got["tim/seq/log_ratio_abs_max"])


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0,)])
def test_an_empty_batch_with_is_weights_is_no_token_not_an_error(path, shape):
    """A micro-batch with no row or no position (a data-parallel rank's empty share) and the correction's weights:
    the same as an empty batch without them, no token, NaN statistics, no tim/is/* key (no weight seen), and
    a monitor that went on to a real batch reads that batch alone."""
    empty = torch.zeros(shape)
    got = mismatch_metrics(empty, empty, is_weights=empty, compile=path == "compiled")
    plain = mismatch_metrics(empty, empty, compile=False)
    assert got.keys() == plain.keys()
    assert all(got[k] == v or (math.isnan(got[k]) and math.isnan(v)) for k, v in plain.items())
    assert got["tim/tokens"] == 0 and math.isnan(got["tim/token/kl_k3"]) and not any(k.startswith("tim/is/") for k in got)
    rollout, train, mask = make_batch(3, 7)
    w = torch.rand(3, 7) * 2
    monitor = MismatchMonitor(compile=path == "compiled")
    monitor.update(empty, empty, is_weights=empty)
    monitor.update(rollout, train, mask, is_weights=w)
    assert_matches(monitor.compute(sync=False), reference(rollout, train, mask, w))


def test_identical_inputs_are_exactly_zero():
    rollout, _, mask = make_batch(3, 11)
    got = mismatch_metrics(rollout, rollout.clone(), mask)
    for key in ("tim/token/kl_k3", "tim/token/kl_k1", "tim/token/abs_diff_max", "tim/token/chi2",
                "tim/token/abs_diff_p99", "tim/seq/log_ratio_abs_max"):
        assert got[key] == 0.0, key
    assert got["tim/token/ratio_min"] == got["tim/token/ratio_max"] == 1.0


def test_is_weights_stats():
    rollout, train, mask = make_batch(5, 13)
    w = torch.rand(5, 13) * 3
    w[w < 0.5] = 0.0  # tokens the correction masked
    w[0, 0] = float("nan")
    got = mismatch_metrics(rollout, train, mask, is_weights=w)
    assert_matches(got, reference(rollout, train, mask, w))
    assert got["tim/is/masked_frac"] > 0


@pytest.mark.parametrize("band", [(0.9, 1.1), (0.5, 2.0)])
def test_ratio_band(band):
    rollout, train, mask = make_batch(4, 31, noise=0.5)
    got = mismatch_metrics(rollout, train, mask, ratio_band=band)
    ref = reference(rollout, train, mask, band=band)
    assert got["tim/token/ratio_outside_frac"] == pytest.approx(ref["tim/token/ratio_outside_frac"], abs=1e-12)
    assert got["tim/token/ratio_outside_frac"] > 0


@pytest.mark.parametrize("q,key", [(0.99, "tim/token/abs_diff_p99"), (0.999, "tim/token/abs_diff_p999")])
def test_quantiles_within_histogram_resolution(q, key):
    rollout, train, mask = make_batch(16, 257, noise=0.2)
    got = mismatch_metrics(rollout, train, mask)
    ref = reference(rollout, train, mask)["_abs_d"]
    exact = ref[max(0, math.ceil(q * len(ref)) - 1)]  # the q-quantile as the smallest x with F(x) >= q
    step = 10 ** (1 / 32)  # one bin: the reported value is the bin's upper edge (capped at the max)
    assert exact <= got[key] * (1 + 1e-6)
    assert got[key] <= exact * step * (1 + 1e-6)


def test_monitor_accumulates_micro_batches_exactly():
    parts = [make_batch(3, t, seed=i) for i, t in enumerate((5, 9, 14))]
    mon = MismatchMonitor()
    for r, t, m in parts:
        mon.update(r, t, m)
    # The same tokens in one padded batch give the same statistics (sequences are rows in both).
    T = 14
    pad = lambda x, fill: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=fill)
    r_all = torch.cat([pad(r, 0.0) for r, _, _ in parts])
    t_all = torch.cat([pad(t, 0.0) for _, t, _ in parts])
    m_all = torch.cat([pad(m, False) for _, _, m in parts])
    whole = mismatch_metrics(r_all, t_all, m_all)
    merged = mon.compute()
    assert merged.keys() == whole.keys()
    for k in whole:
        assert merged[k] == pytest.approx(whole[k], rel=1e-6, nan_ok=True), k
    mon.reset()
    assert mon.compute()["tim/tokens"] == 0


def test_state_dict_round_trip():
    r, t, m = make_batch(4, 10)
    a = MismatchMonitor().update(r, t, m)
    b = MismatchMonitor()
    b.load_state_dict(a.state_dict())
    b.update(r, t, m)
    a.update(r, t, m)
    assert a.compute() == b.compute()


def test_histograms_count_every_valid_token():
    r, t, m = make_batch(6, 40, noise=0.3)
    mon = MismatchMonitor().update(r, t, m)
    h = mon.histograms()
    n = mon.compute()["tim/tokens"]
    counts, edges = h["abs_diff"]
    assert counts.sum() == n and len(edges) == len(counts) + 1 and np.all(np.diff(edges) > 0)
    ref = np.array(reference(r, t, m)["_abs_d"])
    want, _ = np.histogram(np.clip(ref, 0, edges[-1]), bins=edges)
    # Bin assignment is by floor(32·log10|d|); only values within float rounding of an edge may move.
    assert np.abs(counts - want).sum() <= 2
    rc, re = h["ratio"]
    assert rc.sum() == n and len(re) == len(rc) + 1 and np.all(np.diff(re) >= 0)
    rho = np.exp(np.array([tv - rv for rv, tv in zip(r[m].double().tolist(), t[m].double().tolist())]))
    want_r, _ = np.histogram(np.clip(rho, re[0], re[-1]), bins=re)
    assert np.abs(rc - want_r).sum() <= 2


def test_cpu_cell_counts_are_exact_beyond_float32_and_drop_the_last_cell():
    from tim_plugins._mismatch_pass import cell_counts

    n_cells = 1001  # odd, and the value n_cells itself is the dropped (non-response) cell
    g = torch.Generator().manual_seed(0)
    want = torch.randint(0, 40, (n_cells + 1,), generator=g)
    want[7] = 2**24 + 3  # more than float32 counts exactly: one busy cell, as masked-out tokens make
    want[n_cells] = 12_345
    want[11] = 0
    cell = torch.repeat_interleave(torch.arange(n_cells + 1), want)
    cell = cell[torch.randperm(cell.numel(), generator=g)]
    got = cell_counts(cell, n_cells)
    assert got.dtype == torch.float64 and got.shape == (n_cells,)
    assert torch.equal(got, want[:n_cells].double())
    assert torch.equal(cell_counts(cell[:0], n_cells), torch.zeros(n_cells, dtype=torch.float64))


def test_bin_edges_are_log_spaced_at_documented_resolution():
    e = abs_diff_bin_edges()
    assert e[0].item() == pytest.approx(1e-8) and e[-1].item() == pytest.approx(1e3)
    ratios = (e[1:] / e[:-1]).numpy()
    assert np.allclose(ratios, 10 ** (1 / 32))
    # the torch-free copy the host-side derivation reads (the monitor's quantiles are these edges): the same bits
    from tim_plugins._mismatch_layout import abs_diff_bin_edge_values

    assert list(abs_diff_bin_edge_values()) == e.tolist()


@pytest.mark.parametrize(
    "bad",
    [
        lambda r, t, m: (r, t[:, :-1], m),
        lambda r, t, m: (r, t, m[:, :-1]),
        lambda r, t, m: (r[None], t[None], m[None]),
    ],
)
def test_shape_errors_quote_shapes(bad):
    r, t, m = make_batch(2, 6)
    with pytest.raises(ValueError, match=r"\(2, [56]\)|\(1, 2, 6\)"):
        mismatch_metrics(*bad(r, t, m))


def test_config_errors_quote_value():
    with pytest.raises(ValueError, match=r"ratio_band=\(2\.0, 0\.5\)"):
        MismatchMonitor(ratio_band=(2.0, 0.5))


def test_compiled_pass_equals_eager():
    pytest.importorskip("torch._inductor")
    r, t, m = make_batch(8, 33, noise=0.1)
    eager = mismatch_metrics(r, t, m, compile=False)
    mon = MismatchMonitor(compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = mon.update(r, t, m).compute()
    # our own compiled pass failing is a failure, not a skip (the monitor falls back to eager for users)
    assert not mon._compile_failed, [str(w.message) for w in caught]
    for k in eager:
        assert compiled[k] == pytest.approx(eager[k], rel=1e-5, abs=1e-7, nan_ok=True), k
    # A new sequence length must not break or change semantics (dynamic shapes).
    r2, t2, m2 = make_batch(8, 47, seed=3)
    assert mon.reset() is None
    got = mon.update(r2, t2, m2).compute()
    assert got["tim/token/kl_k3"] == pytest.approx(reference(r2, t2, m2)["tim/token/kl_k3"], rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_k3_and_chi2_per_token_to_float32_rounding(path, dtype):
    """|d| from 1e-7 to 3, both signs: k3 = ρ − 1 − d without float32 cancellation (the series below |d| = 1),
    chi2 = ρ² − 1, each token against float64."""
    if path == "compiled":
        pytest.importorskip("torch._inductor")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            probe = MismatchMonitor(compile=True).update(torch.zeros(1, 1, dtype=dtype),
                                                         torch.zeros(1, 1, dtype=dtype))
        assert not probe._compile_failed, [str(w.message) for w in caught]  # our own compiled pass: no skip
    assert_k3_and_chi2_per_token(lambda: MismatchMonitor(compile=path == "compiled"), *small_d_tokens(dtype))


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_k3_and_chi2_when_the_ratios_cancel_across_tokens(path):
    assert_k3_and_chi2_of_cancelling_batches(lambda: MismatchMonitor(compile=path == "compiled"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_prob_abs_diff_of_extreme_valid_tokens(path, dtype):
    """|p_train − p_rollout| of one valid token whose e^r underflows while ρ − 1 overflows is |e^t − e^r|, not
    0 · inf = NaN (which would poison the window's mean and max)."""
    if path == "compiled":
        pytest.importorskip("torch._inductor")
    assert_prob_abs_diff_per_token(lambda: MismatchMonitor(compile=path == "compiled"), dtype)


def test_float64_inputs_keep_float64_accuracy():
    """float64 inputs are computed in float64: k3 and chi2 per token within 1e-12 (the series only below 0.1)."""
    r, t = small_d_tokens(torch.float64)
    for rv, tv in zip(r.tolist(), t.tolist()):
        got = mismatch_metrics(torch.tensor([[rv]], dtype=torch.float64), torch.tensor([[tv]], dtype=torch.float64))
        x = tv - rv
        assert got["tim/token/kl_k3"] == pytest.approx(k3_f64(x), rel=1e-12, abs=0), x
        assert got["tim/token/chi2"] == pytest.approx(math.expm1(2 * x), rel=1e-12, abs=0), x


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 5),
    T=st.integers(1, 23),
    seed=st.integers(0, 10_000),
    noise=st.floats(0.0, 2.0),
    mask_p=st.floats(0.0, 1.0),
)
def test_property_matches_reference(B, T, seed, noise, mask_p):
    r, t, m = make_batch(B, T, V=31, seed=seed, noise=noise, mask_p=mask_p)
    got = mismatch_metrics(r, t, m)
    ref = reference(r, t, m)
    assert_matches(got, ref, rtol=1e-5, atol=1e-6)
    # Invariants that hold for any data: k3 >= 0, chi2 >= -tiny, min <= mean <= max.
    if got["tim/tokens"] > 0:
        assert got["tim/token/kl_k3"] >= -1e-7
        assert got["tim/token/ratio_min"] <= got["tim/token/ratio_mean"] * (1 + 1e-6)
        assert got["tim/token/ratio_mean"] <= got["tim/token/ratio_max"] * (1 + 1e-6)
        assert got["tim/token/abs_diff_p99"] <= got["tim/token/abs_diff_max"]
