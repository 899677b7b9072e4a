"""Statistics by a per-token key (``tim_plugins.by_key``) against references written here: per bucket, the count,
mean |d|, mean d, k3 and max |d| of the tokens whose key falls in it (a plain Python loop over tokens, float64);
exact merging over micro-batches; empty buckets left out; property test over random keys and masks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tim_plugins.by_key import UNKNOWN_LAG, KEYINGS, KeyedStats, Keying, lag_after, lag_keys, policy_lag, position_keys


def _reference(rollout, train, mask, keys, keying: Keying) -> dict[str, float]:
    buckets: dict[str, list[float]] = {}
    for r, t, m, k in zip(rollout.flatten().tolist(), train.flatten().tolist(), mask.flatten().tolist(),
                          keys.flatten().tolist()):
        if not m:
            continue
        # the bucket by its definition: the last lower edge <= k
        i = max(j for j, lo in enumerate(keying.edges) if lo <= k) if k >= keying.edges[0] else 0
        buckets.setdefault(keying.labels[i], []).append(t - r)
    out = {}
    for label, ds in buckets.items():
        p = f"tim/by_{keying.name}/{label}"
        out[f"{p}/count"] = float(len(ds))
        out[f"{p}/abs_diff_mean"] = sum(abs(d) for d in ds) / len(ds)
        out[f"{p}/mean"] = sum(ds) / len(ds)
        out[f"{p}/kl_k3"] = sum(math.exp(d) - 1 - d for d in ds) / len(ds)
        out[f"{p}/abs_diff_max"] = max(abs(d) for d in ds)
    return out


def _batch(seed: int, b: int, t: int):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    train = rollout + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.7
    return rollout, train, mask


def _check(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_labels_of_the_position_buckets():
    assert KEYINGS["position"].labels[:5] == ("0", "1", "2-3", "4-7", "8-15")
    assert KEYINGS["position"].labels[-1] == "1024+" and KEYINGS["lag"].labels[-1] == "8+"


def test_by_position_matches_the_loop():
    rollout, train, mask = _batch(0, 6, 40)
    keys = position_keys(mask)
    stats = KeyedStats("position")
    stats.update(rollout, train, mask, keys)
    _check(stats.compute(sync=False), _reference(rollout, train, mask, keys, KEYINGS["position"]))


def test_by_lag_and_merging_micro_batches():
    parts = [_batch(seed, 4, 9) for seed in (1, 2, 3)]
    versions = [torch.tensor([5, 5, 4, 2]), torch.tensor([5, 3, 3, 5]), torch.tensor([1, 5, 5, 5])]
    whole, split = KeyedStats("lag"), KeyedStats("lag")
    for (r, t, m), v in zip(parts, versions):
        split.update(r, t, m, lag_keys(5, v, m.shape))
    cat = [torch.cat([p[i] for p in parts]) for i in range(3)]
    keys = lag_keys(5, torch.cat(versions), cat[2].shape)
    whole.update(*cat, keys)
    a, b = whole.compute(sync=False), split.compute(sync=False)
    _check(b, a)
    _check(a, _reference(*cat, keys, KEYINGS["lag"]))
    assert set(k.split("/")[2] for k in a) == {"0", "1", "2", "3", "4"}  # lags present; the others left out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), t=st.integers(1, 30), turns=st.integers(1, 12))
def test_by_turn_property(seed, b, t, turns):
    rollout, train, mask = _batch(seed, b, t)
    g = torch.Generator().manual_seed(seed + 1)
    keys = torch.randint(0, turns, (b, t), generator=g)
    stats = KeyedStats("turn")
    stats.update(rollout, train, mask, keys)
    got = stats.compute(sync=False)
    _check(got, _reference(rollout, train, mask, keys, KEYINGS["turn"]))
    assert sum(v for k, v in got.items() if k.endswith("/count")) == float(mask.sum())


def test_non_finite_tokens_and_empty():
    rollout, train, mask = _batch(4, 2, 5)
    train[0, 0], mask[0, 0] = float("nan"), True
    stats = KeyedStats("position")
    stats.update(rollout, train, torch.zeros_like(mask), position_keys(mask))
    assert stats.compute(sync=False) == {}
    stats.update(rollout, train, mask, position_keys(mask))
    got = stats.compute(sync=False)
    assert sum(v for k, v in got.items() if k.endswith("/count")) == float(mask.sum()) - 1


def test_labels_of_the_probability_buckets_are_the_monitors():
    from tim_plugins.metrics import PROB_BUCKET_EDGES

    want = tuple(f"{lo:g}-{hi:g}" for lo, hi in zip(PROB_BUCKET_EDGES[:-1], PROB_BUCKET_EDGES[1:]))
    assert KEYINGS["prob"].labels == want == ("0-0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", "0.9-1")


def _prob_reference(rollout, train, mask, dtype) -> dict[str, float]:
    """by_prob by its definition: p = e^rollout in [lo, hi) (the last bucket closed at 1), with log lo and log hi
    rounded as the inputs' precision (at least float32) rounds them; placeholders (<= -1e3) and non-finite tokens
    left out; every bucket reported."""
    out = {}
    at = torch.promote_types(dtype, torch.float32)

    def log(e):
        return torch.tensor(math.log(e), dtype=at).item()

    edges = (0.0, 0.01, 0.1, 0.5, 0.9, 1.0)
    valid = mask.bool() & torch.isfinite(train - rollout) & (rollout > -1e3) & (train > -1e3)
    for lo, hi in zip(edges[:-1], edges[1:]):
        ds = [t - r for r, t, v in zip(rollout.flatten().tolist(), train.flatten().tolist(), valid.flatten().tolist())
              if v and (lo == 0 or r >= log(lo)) and (hi == 1 or r < log(hi))]
        p = f"tim/by_prob/{lo:g}-{hi:g}"
        out[f"{p}/count"] = float(len(ds))
        out[f"{p}/abs_diff_mean"] = sum(abs(d) for d in ds) / len(ds) if ds else math.nan
        out[f"{p}/mean"] = sum(ds) / len(ds) if ds else math.nan
        out[f"{p}/kl_k3"] = sum(math.expm1(d) - d for d in ds) / len(ds) if ds else math.nan
        out[f"{p}/abs_diff_max"] = max(abs(d) for d in ds) if ds else math.nan
    return out


def _check_nan(got: dict, want: dict, rel: float) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=rel, abs=1e-15), key


# The monitor's fused pass sums |d| in float32 per lane (float64 inputs: float64); relative error of the mean.
PROB_REL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 4), t=st.integers(1, 37))
def test_by_prob_is_one_bucketing_for_the_monitor_and_the_generic_accumulator(dtype, seed, b, t):
    """The monitor's tim/by_prob (its fused pass adds the count and Σ|d| per bucket) and KeyedStats("prob") (every
    statistic) agree with the definition and with each other: bucket edges hit exactly, placeholders, non-finite
    log-probs and fully masked rows included, every bucket reported, the counts adding up to tim/tokens."""
    from tim_plugins.metrics import mismatch_metrics

    g = torch.Generator().manual_seed(seed)
    rollout = torch.log(torch.rand(b, t, generator=g, dtype=torch.float64).clamp_min(1e-4))
    train = rollout + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.8
    if b > 1:
        mask[0] = False  # a fully masked row
    last = rollout[-1]  # counted tokens: on an edge (in the inputs' dtype once converted), a placeholder, a NaN
    for i, value in enumerate((math.log(0.5), -9999.0, math.nan)[:t]):
        last[i], mask[-1, i] = value, True
    rollout, train = rollout.to(dtype), train.to(dtype)
    want = _prob_reference(rollout.double(), train.double(), mask, dtype)
    stats = KeyedStats("prob")
    stats.update(rollout, train, mask, rollout)
    _check_nan(stats.compute(sync=False), want, 1e-12)
    monitor = {k: v for k, v in mismatch_metrics(rollout, train, mask, compile=False).items()
               if k.startswith("tim/by_prob/")}
    _check_nan(monitor, {k: v for k, v in want.items() if k.endswith(("/count", "/abs_diff_mean"))}, PROB_REL[dtype])
    tokens = mismatch_metrics(rollout, train, mask, compile=False)["tim/tokens"]
    assert sum(v for k, v in monitor.items() if k.endswith("/count")) == tokens


def test_placeholders_are_invalid_as_in_the_monitor():
    rollout, train, mask = _batch(5, 3, 8)
    rollout[0, 1], train[1, 2], mask[:] = -9999.0, -1e4, True
    stats = KeyedStats("position")
    stats.update(rollout, train, mask, position_keys(mask))
    got = stats.compute(sync=False)
    assert sum(v for k, v in got.items() if k.endswith("/count")) == mask.numel() - 2


def test_update_has_no_data_dependent_shape():
    """An update runs on the meta device, which has no values: nothing in it depends on the data (no boolean
    indexing), so on a GPU it never waits for the device."""
    stats = KeyedStats("position")
    r = torch.zeros(3, 7, device="meta")
    stats.update(r, r, torch.ones(3, 7, dtype=torch.bool, device="meta"), position_keys(r))
    prob = KeyedStats("prob")
    prob.update(r, r, torch.ones(3, 7, dtype=torch.bool, device="meta"), r)
    assert stats._acc.state.device.type == "meta" and prob._acc.state.device.type == "meta"


def test_prefix_and_report_empty():
    rollout, train, mask = _batch(6, 2, 3)
    stats = KeyedStats("prob", prefix="tim/staleness")
    stats.update(rollout, train, torch.zeros_like(mask), rollout)
    got = stats.compute(sync=False)
    assert set(got) == {f"tim/staleness/by_prob/{label}/{s}" for label in KEYINGS["prob"].labels
                        for s in ("count", "abs_diff_mean", "mean", "kl_k3", "abs_diff_max")}
    assert all(v == 0 for k, v in got.items() if k.endswith("/count"))
    assert all(math.isnan(v) for k, v in got.items() if not k.endswith("/count"))


def test_policy_lag_is_one_rule_for_ints_and_tensors():
    """The lag both adapters count: (now − sampled_at, at least 0) × steps per version, unknown where the sampling
    version is; later passes add their optimizer steps. Reference: the rule written out per element."""
    def naive(sampled, now, per):
        return UNKNOWN_LAG if sampled is None or sampled < 0 else max(now - sampled, 0) * per

    cases = [None, -1, 0, 3, 7, 9]  # 9: sampled after "now" (a sample fetched ahead): lag 0, not negative
    for per in (1, 3):
        for sampled in cases:
            assert policy_lag(sampled, 7, steps_per_version=per) == naive(sampled, 7, per)
        known = [c for c in cases if c is not None]
        out = policy_lag(torch.tensor(known), 7, steps_per_version=per)
        assert out.dtype == torch.long and out.tolist() == [naive(c, 7, per) for c in known]
    lag = policy_lag(torch.tensor([[-1, 0], [2, 5]]), 5)
    assert lag.tolist() == [[UNKNOWN_LAG, 5], [3, 0]]
    assert lag_after(lag, 2).tolist() == [[UNKNOWN_LAG, 7], [5, 2]]
    assert lag_keys(5, torch.tensor([5, 2]), (2, 3)).tolist() == [[0, 0, 0], [3, 3, 3]]
