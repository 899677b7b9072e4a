"""The staleness / mismatch split (``tim_plugins.staleness``) against float64 references written here: synthetic
batches with a known staleness and mismatch, recovered per token, in their means, in Var(d) and in each term's share
of it; exact merging over micro-batches; exactly zero staleness where nothing is reused; empty sets give NaN."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tim_plugins.pipeline import PipelineConfig, StepPipeline
from tim_plugins.staleness import SplitStats, split_parts


def _batch(seed: int, b: int = 5, t: int = 7, stale: float = 0.05, mismatch: float = 0.02, corr: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    m = mismatch * torch.randn(b, t, generator=g, dtype=torch.float64)
    s = stale * torch.randn(b, t, generator=g, dtype=torch.float64) + corr * m
    old = rollout + m
    current = old + s
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[0] = False  # a fully masked row
    return rollout.float(), old.float(), current.float(), mask


def _reference(rollout, old, current, mask) -> dict[str, float]:
    keep = mask.numpy()
    s = (current.double() - old.double()).numpy()[keep]
    m = (old.double() - rollout.double()).numpy()[keep]
    d = s + m
    var_d = np.var(d)
    cov = np.mean((s - s.mean()) * (m - m.mean()))
    return {"tokens": float(keep.sum()), "staleness_mean": s.mean(), "mismatch_mean": m.mean(),
            "total_mean": d.mean(), "total_var": var_d, "staleness_var_share": np.var(s) / var_d,
            "mismatch_var_share": np.var(m) / var_d, "cov_share": 2 * cov / var_d}


@pytest.mark.parametrize("corr", [0.0, 0.7, -0.5])
def test_split_recovers_known_parts(corr):
    rollout, old, current, mask = _batch(0, b=64, t=64, corr=corr)
    s, m = split_parts(rollout, old, current)
    # per token: the parts add up to the total log-ratio (float64 of float32 inputs: exact to rounding)
    torch.testing.assert_close(s + m, current.double() - rollout.double(), rtol=0, atol=1e-12)
    stats = SplitStats()
    stats.update(rollout, old, current, mask)
    got = stats.compute(sync=False)
    want = _reference(rollout, old, current, mask)
    for key, value in want.items():
        assert got[f"tim/split/{key}"] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    shares = [got[f"tim/split/{k}"] for k in ("staleness_var_share", "mismatch_var_share", "cov_share")]
    assert sum(shares) == pytest.approx(1.0, abs=1e-12)
    if corr == 0.0:  # independent parts: the covariance term is small, staleness (sd 0.05) dominates (sd 0.02)
        assert shares[0] > 0.8 and abs(shares[2]) < 0.05


def test_placeholder_and_non_finite_log_probs_are_left_out():
    """A placeholder log-prob (<= -1e3, e.g. -9999 for "not reported") on any of the three sides is left out like a
    non-finite one, as the monitor leaves it out: the split is the reference's over the tokens whose three log-probs
    are finite and above -1e3 (one kept placeholder would make the mismatch explain all of Var(d))."""
    rollout, old, current, mask = _batch(10, b=64, t=64)
    rollout[1, 0], old[2, 1], current[3, 2], rollout[4, 3] = -9999.0, -1e4, -1e3, -1e3 - 0.5
    rollout[5, 4], old[6, 5], current[7, 6] = math.nan, math.inf, -math.inf
    mask[1:8, :7] = True
    stats = SplitStats()
    stats.update(rollout, old, current, mask)
    got = stats.compute(sync=False)
    ok = mask.clone()
    for x in (rollout, old, current):
        ok &= torch.isfinite(x) & (x > -1e3)
    assert int(mask.sum()) - int(ok.sum()) == 7
    for key, value in _reference(rollout, old, current, ok).items():
        assert got[f"tim/split/{key}"] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_merging_micro_batches_is_exact():
    parts = [_batch(seed) for seed in (1, 2, 3)]
    whole, split = SplitStats(), SplitStats()
    for p in parts:
        split.update(*p)
    cat = [torch.cat([p[i] for p in parts]) for i in range(4)]
    whole.update(*cat)
    a, b = whole.compute(sync=False), split.compute(sync=False)
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-15), key


def test_state_dict_round_trip():
    stats = SplitStats()
    stats.update(*_batch(4))
    again = SplitStats()
    again.load_state_dict(stats.state_dict())
    assert again.compute(sync=False) == stats.compute(sync=False)


def test_nothing_reused_means_zero_staleness_exactly():
    rollout, old, _, mask = _batch(5)
    pipe = StepPipeline(PipelineConfig(staleness=True, compile=False))
    pipe.measure(rollout, old, mask)
    pipe.loss_pass(rollout, old, old, mask)  # on-policy: the loss pass's log-probs are π_old
    out, _, _ = pipe.compute(1, sync=False)
    assert out["tim/split/staleness_mean"] == 0.0 and out["tim/split/staleness_var_share"] == 0.0
    assert out["tim/split/cov_share"] == 0.0 and out["tim/split/mismatch_var_share"] == 1.0
    assert out["tim/staleness/token/kl_k3"] == 0.0 and out["tim/staleness/token/abs_diff_max"] == 0.0
    assert out["tim/staleness/tokens"] == out["tim/tokens"] == float(mask.sum())
    # the mismatch part is what the monitor measures
    assert out["tim/split/mismatch_mean"] == pytest.approx(
        float((old.double() - rollout.double())[mask].mean()), rel=1e-12)


def test_staleness_statistics_are_the_monitors_on_old_vs_current():
    rollout, old, current, mask = _batch(6, stale=0.3)
    pipe = StepPipeline(PipelineConfig(staleness=True, compile=False))
    pipe.loss_pass(rollout, old, current, mask)
    out, _, _ = pipe.compute(1, sync=False)
    s = (current.double() - old.double())[mask]
    # k3 = E[ρ − 1 − s] with ρ = e^s = π_θ/π_old (the monitor's formula written out), the ratio band (0.5, 2) on ρ
    assert out["tim/staleness/token/kl_k3"] == pytest.approx(float((torch.exp(s) - 1 - s).mean()), rel=1e-6)
    assert out["tim/staleness/token/abs_diff_max"] == pytest.approx(float(s.abs().max()), rel=1e-6)
    outside = float(((s < math.log(0.5)) | (s > math.log(2.0))).double().mean())
    assert out["tim/staleness/token/ratio_outside_frac"] == pytest.approx(outside, abs=1e-12)


def test_empty_and_off():
    stats = SplitStats()
    stats.update(*_batch(7)[:3], torch.zeros(5, 7, dtype=torch.bool))
    out = stats.compute(sync=False)
    assert out["tim/split/tokens"] == 0.0 and math.isnan(out["tim/split/staleness_var_share"])
    off = StepPipeline(PipelineConfig(compile=False))  # staleness off by default: loss_pass does nothing
    off.loss_pass(*_batch(8))
    assert not any(k.startswith(("tim/split", "tim/staleness")) for k in off.compute(1, sync=False)[0])


def test_shape_mismatch_is_counted_not_raised():
    rollout, old, current, mask = _batch(9)
    pipe = StepPipeline(PipelineConfig(staleness=True, compile=False))
    pipe.loss_pass(rollout, old, current[:, :-1], mask)
    assert pipe.diag == {"shape_mismatch": 1.0}


def _naive_reused(rollout, old, current, mask, lag) -> tuple[float, float, float]:
    """(tokens, Var(s) / Var(d), mean of exp(s) - 1 - s) over the tokens of ``mask`` with lag >= 1, in float64."""
    keep = (mask & (lag >= 1)).numpy()
    s = (current.double() - old.double()).numpy()[keep]
    d = (current.double() - rollout.double()).numpy()[keep]
    if not len(s):
        return 0.0, math.nan, math.nan
    return float(len(s)), float(np.var(s) / np.var(d)), float(np.mean(np.expm1(s) - s))


def test_the_reused_split_is_the_split_of_the_tokens_trained_after_an_update():
    """``ReusedSplit``: the tokens a pass trains at lag >= 1 alone, against the naive formulas over them; the fresh
    tokens of the same window (a batch's first pass: s = 0) change nothing; merged over passes exactly; NaN and 0
    tokens without a reused one."""
    from tim_plugins.staleness import REUSED_KEYS, ReusedSplit

    fresh = _batch(1, stale=0.0, mismatch=0.2)
    fresh = (fresh[0], fresh[1], fresh[1], fresh[3])  # π_θ is π_old: the first pass over a batch
    reused = _batch(2, stale=0.3, mismatch=0.2, corr=0.2)
    lags = (torch.zeros(5, 7, dtype=torch.long), torch.tensor([1, 1, 2, 2, 3]).view(-1, 1).expand(5, 7))
    stats, alone = ReusedSplit(), ReusedSplit()
    for batch, lag in zip((fresh, reused), lags):
        stats.update(*batch, lag)
    alone.update(*reused, lags[1])
    got, want = stats.compute(sync=False), _naive_reused(*reused, lags[1])
    assert list(got) == list(REUSED_KEYS)
    assert got[REUSED_KEYS[0]] == want[0] == int(reused[3].sum())
    assert got[REUSED_KEYS[1]] == pytest.approx(want[1], rel=1e-9) and 0.5 < want[1] < 0.9
    assert got[REUSED_KEYS[2]] == pytest.approx(want[2], rel=1e-9)
    assert got == alone.compute(sync=False)
    # the pooled split of the same passes is diluted by the fresh tokens
    pooled = SplitStats()
    for batch in (fresh, reused):
        pooled.update(*batch)
    assert pooled.compute(sync=False)["tim/split/staleness_var_share"] < want[1] - 0.05
    empty = ReusedSplit()
    empty.update(*fresh, lags[0])
    out = empty.compute(sync=False)
    assert out[REUSED_KEYS[0]] == 0.0 and math.isnan(out[REUSED_KEYS[1]]) and math.isnan(out[REUSED_KEYS[2]])
    restored = ReusedSplit()
    restored.load_state_dict(stats.state_dict())
    assert restored.compute(sync=False) == got
