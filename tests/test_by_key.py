"""Statistics by a per-token key (``tim_plugins.by_key``) against references written here: per bucket, the count,
mean |d|, mean d, k3 and max |d| of the tokens whose key falls in it (a plain Python loop over tokens, float64);
exact merging over micro-batches; empty buckets left out; property test over random keys and masks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tim_plugins.by_key import KEYINGS, KeyedStats, Keying, lag_keys, position_keys


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
