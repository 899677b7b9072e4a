"""LengthTriggeredLRDecay: trigger rule against a naive re-implementation, synthetic runs, exact resume."""

from __future__ import annotations

import io
import json
import math
import random
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tim_plugins.lr_control import LengthTriggeredLRDecay, LRDecayConfig

# ----------------------------------------------------------------------------- naive reference


def _finite(x):
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def reference_run(lengths, cfg: LRDecayConfig, extras=None):
    """The documented rule, written out directly (mode='step'). Returns (scales, fire_indices)."""
    extras = extras or {}
    names = ["length", *cfg.signals]
    margin = {"length": cfg.margin, "kl_k3": cfg.kl_k3_margin, "grad_norm": cfg.grad_norm_margin}
    floor = {"length": cfg.length_floor, "kl_k3": cfg.kl_k3_floor, "grad_norm": cfg.grad_norm_floor}
    rebase_n = cfg.rebaseline_steps or cfg.warmup_steps
    base = {n: None for n in names}
    warm = {n: [] for n in names}
    win = {n: [] for n in names}
    need = {n: cfg.warmup_steps for n in names}
    scale, streak, cool = 1.0, 0, 0
    scales, fires = [], []
    for i, x in enumerate(lengths):
        in_cool = cool > 0
        if in_cool:
            cool -= 1
        if not _finite(x) or x < 0:
            scales.append(scale)
            continue
        exceed = {}
        for n in names:
            v = x if n == "length" else extras[n][i]
            if not _finite(v):
                exceed[n] = False
                continue
            win[n] = (win[n] + [float(v)])[-cfg.window:]
            level = statistics.median(win[n])
            if base[n] is None:
                warm[n].append(float(v))
                exceed[n] = False
                if len(warm[n]) == need[n]:
                    base[n] = statistics.median(warm[n])
                    warm[n] = []
            else:
                exceed[n] = level > base[n] * (1 + margin[n]) and level > floor[n]
                if not exceed[n]:
                    base[n] = base[n] + cfg.baseline_ema * (level - base[n])
        if in_cool or base["length"] is None:
            streak = 0
        else:
            ex = [exceed[n] for n in cfg.signals]
            hit = (exceed["length"] or any(ex)) if cfg.combine == "any" else (exceed["length"] and all(ex))
            streak = streak + 1 if hit else 0
            if streak >= cfg.patience:
                fires.append(i)
                streak = 0
                scale = max(scale * cfg.decay_factor, cfg.min_lr_ratio)
                cool = cfg.cooldown
                for n in names:
                    base[n], warm[n], need[n] = None, [], rebase_n
        scales.append(scale)
    return scales, fires


def run(ctrl, lengths, extras=None, start=0):
    extras = extras or {}
    scales, fires = [], []
    for i, x in enumerate(lengths):
        kw = {k: v[i] for k, v in extras.items()}
        scales.append(ctrl.observe(start + i, x, **kw))
        if ctrl.metrics()["tim/lr/triggered"] == 1.0:
            fires.append(i)
    return scales, fires


def synthetic(seed, n, p_nan=0.0):
    """Piecewise series: noisy plateaus, ramps, 1-2 step spikes, NaN/None/inf gaps."""
    rng = random.Random(seed)
    out, level = [], rng.uniform(50, 800)
    while len(out) < n:
        kind = rng.choice(["flat", "flat", "ramp", "spike", "jump"])
        k = rng.randint(1, 25)
        for _ in range(k):
            if kind == "ramp":
                level *= 1 + rng.uniform(0.01, 0.08)
            out.append(level * (1 + rng.gauss(0, 0.05)))
        if kind == "spike":
            out[-1] *= rng.uniform(2, 5)
        if kind == "jump":
            level *= rng.uniform(0.7, 1.8)
    out = out[:n]
    for i in range(n):
        if rng.random() < p_nan:
            out[i] = rng.choice([math.nan, None, math.inf, -math.inf, -5.0])
    return out


def flat_then_ramp(seed=0, flat=80, ramp=60, level=400.0, growth=0.03, noise=0.05):
    rng = random.Random(seed)
    xs = [level * (1 + rng.gauss(0, noise)) for _ in range(flat)]
    xs += [level * (1 + growth) ** (i + 1) * (1 + rng.gauss(0, noise)) for i in range(ramp)]
    return xs


small_cfg = st.builds(
    LRDecayConfig,
    warmup_steps=st.integers(1, 12), window=st.integers(1, 6), margin=st.sampled_from([0.05, 0.1, 0.25, 0.5]),
    patience=st.integers(1, 4), decay_factor=st.sampled_from([0.3, 0.5, 0.9]),
    min_lr_ratio=st.sampled_from([0.05, 0.2, 1.0]), cooldown=st.integers(0, 10),
    baseline_ema=st.sampled_from([0.01, 0.1, 1.0]), rebaseline_steps=st.sampled_from([None, 1, 4]),
    length_floor=st.sampled_from([0.0, 300.0]),
)

# ----------------------------------------------------------------------------- behaviour


def test_flat_noisy_then_ramp_fires_after_ramp_only():
    xs = flat_then_ramp()
    ctrl = LengthTriggeredLRDecay()
    scales, fires = run(ctrl, xs)
    assert fires, "a 3%/step ramp (+25% in 8 steps) must trigger"
    assert all(f >= 80 for f in fires)
    # window median lags ~2 steps, +25% needs ~8 ramp steps, patience 3: first fire within 20 ramp steps
    assert 80 + 5 <= fires[0] <= 80 + 20
    assert scales[fires[0]] == 0.5 and scales[fires[0] - 1] == 1.0
    ref_scales, ref_fires = reference_run(xs, ctrl.config)
    assert scales == ref_scales and fires == ref_fires


def test_isolated_spikes_do_not_trigger():
    rng = random.Random(1)
    xs = [400 * (1 + rng.gauss(0, 0.05)) for _ in range(300)]
    for i in range(40, 300, 20):  # 1-step 4x spikes
        xs[i] *= 4
    for i in range(50, 290, 20):  # 2-step 3x bursts, 10 steps after each spike
        xs[i] *= 3
        xs[i + 1] *= 3
    ctrl = LengthTriggeredLRDecay()
    scales, fires = run(ctrl, xs)
    assert fires == [] and set(scales) == {1.0}
    # the same bursts lasting 3 steps do fire (window 5, median): the documented limit
    ys = [400.0] * 60 + [1600.0] * 3 + [400.0] * 20
    assert run(LengthTriggeredLRDecay(), ys)[1] == [64]  # window median high at 62, 63, 64


def test_nan_gaps_are_skipped_counted_and_neutral():
    xs = flat_then_ramp(seed=3)
    gapped, pos = [], []
    bad = [math.nan, None, math.inf, -math.inf, -1.0, "n/a", torch.tensor(math.nan)]
    for i, x in enumerate(xs):
        if i % 7 == 3:
            gapped.append(bad[i % len(bad)])
        pos.append(len(gapped))
        gapped.append(x)
    ctrl = LengthTriggeredLRDecay(cooldown=0)
    ref = LengthTriggeredLRDecay(cooldown=0)  # cooldown counts calls, so compare without it
    s_gap, f_gap = run(ctrl, gapped)
    s_ref, f_ref = run(ref, xs)
    assert ctrl.metrics()["tim/lr/skipped"] == len(gapped) - len(xs)
    assert [s_gap[p] for p in pos] == s_ref
    assert [pos[i] for i in f_ref] == f_gap and f_gap


def test_tensor_and_numpy_inputs_accepted():
    import numpy as np

    a, b = LengthTriggeredLRDecay(), LengthTriggeredLRDecay()
    xs = flat_then_ramp(seed=5)
    for i, x in enumerate(xs):
        v = torch.tensor(x, dtype=torch.float64) if i % 2 else np.float64(x)
        assert a.observe(i, v) == b.observe(i, x)


def test_never_triggers_during_warmup():
    xs = [100.0 * 1.5**i for i in range(30)]  # explodes from the first step
    ctrl = LengthTriggeredLRDecay(warmup_steps=20, patience=1)
    scales, fires = run(ctrl, xs)
    assert fires and fires[0] >= 20  # earliest possible: first step after the warm-up median
    assert fires[0] == 20  # 1.5^20 ≫ 1.25 × median(warm-up), patience 1
    mid = LengthTriggeredLRDecay(warmup_steps=20)
    for i in range(10):
        mid.observe(i, xs[i])
    assert math.isnan(mid.metrics()["tim/lr/baseline_length"])
    assert mid.metrics()["tim/lr/window_length"] == statistics.median(xs[5:10])


def test_cooldown_rebaseline_and_floor():
    xs = [100.0 * 1.06**i for i in range(400)]  # sustained exponential surge: fires again and again
    ctrl = LengthTriggeredLRDecay(warmup_steps=10, cooldown=25, rebaseline_steps=5)
    scales, fires = run(ctrl, xs)
    assert len(fires) >= 5
    assert all(b - a > 25 for a, b in zip(fires, fires[1:]))  # nothing fires within the cooldown
    assert min(scales) == 0.1 and scales[-1] == 0.1  # 1 → .5 → .25 → .125 → floor .1 (not .0625)
    assert sorted(set(scales), reverse=True) == [1.0, 0.5, 0.25, 0.125, 0.1]
    assert ctrl.trigger_count == len(fires) and ctrl.trigger_steps == fires
    assert (scales, fires) == reference_run(xs, ctrl.config)
    m = LengthTriggeredLRDecay(warmup_steps=10, cooldown=25, rebaseline_steps=5)
    for i in range(fires[0] + 1):
        m.observe(i, xs[i])
    met = m.metrics()
    assert met["tim/lr/triggered"] == 1.0 and met["tim/lr/cooldown_left"] == 25
    assert met["tim/lr/window_length"] > 1.25 * met["tim/lr/baseline_length"]  # what fired is visible
    m.observe(fires[0] + 1, xs[fires[0] + 1])
    assert m.metrics()["tim/lr/triggered"] == 0.0 and math.isnan(m.metrics()["tim/lr/baseline_length"])


@pytest.mark.parametrize("mode", ["linear", "cosine"])
def test_smooth_decay_modes(mode):
    xs = flat_then_ramp(ramp=200)
    ctrl = LengthTriggeredLRDecay(mode=mode, decay_steps=50, min_lr_ratio=0.2)
    scales, fires = run(ctrl, xs)
    step_fires = run(LengthTriggeredLRDecay(), xs)[1]
    assert fires == step_fires[:1]  # same detection; then detection stops
    f = fires[0]
    assert all(s == 1.0 for s in scales[:f])
    for i in range(f, len(xs)):
        frac = min(1.0, (i - f + 1) / 50)
        want = 1 + (0.2 - 1) * frac if mode == "linear" else 0.2 + 0.8 * (1 + math.cos(math.pi * frac)) / 2
        assert scales[i] == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert scales[-1] == pytest.approx(0.2, abs=1e-12) and ctrl.trigger_count == 1


def test_extra_signals_any_and_all():
    rng = random.Random(2)
    n = 120
    flat_len = [400 * (1 + rng.gauss(0, 0.03)) for _ in range(n)]
    k3_surge = [1e-3 * (1 + rng.gauss(0, 0.1)) if i < 60 else 1e-3 * 1.1 ** (i - 59) for i in range(n)]
    ramp_len = flat_then_ramp(seed=4, flat=60, ramp=60)
    cfgs = {"any": dict(signals=("kl_k3",), combine="any", kl_k3_floor=0.0),
            "all": dict(signals="kl_k3", combine="all", kl_k3_floor=0.0)}
    for name, kw in cfgs.items():
        ctrl = LengthTriggeredLRDecay(**kw)
        _, fires = run(ctrl, flat_len, {"tim/token/kl_k3": k3_surge})
        assert bool(fires) == (name == "any")
        assert (_, fires) == reference_run(flat_len, ctrl.config, {"kl_k3": k3_surge})
        ctrl = LengthTriggeredLRDecay(**kw)
        _, both = run(ctrl, ramp_len, {"kl_k3": k3_surge})
        assert both and (_, both) == reference_run(ramp_len, ctrl.config, {"kl_k3": k3_surge})
    # k3 below its floor never counts
    ctrl = LengthTriggeredLRDecay(signals=("kl_k3",), kl_k3_floor=1.0)
    assert run(ctrl, flat_len, {"k3": k3_surge})[1] == []
    # grad norm alias, missing values counted
    g = [1.0 if i < 60 else 1.2 ** (i - 59) for i in range(n)]
    g[10] = None
    ctrl = LengthTriggeredLRDecay(signals=("grad_norm",))
    _, fires = run(ctrl, flat_len, {"actor/grad_norm": g})
    assert fires and ctrl.metrics()["tim/lr/skipped_grad_norm"] == 1
    assert (_, fires) == reference_run(flat_len, ctrl.config, {"grad_norm": g})
    with pytest.raises(TypeError, match="bogus"):
        LengthTriggeredLRDecay().observe(0, 1.0, bogus=1.0)


def test_stale_steps_ignored():
    ctrl = LengthTriggeredLRDecay(warmup_steps=2, window=1, patience=1)
    for s, x in [(0, 10.0), (1, 10.0), (1, 1e6), (0, 1e6), (2, 10.0)]:
        ctrl.observe(s, x)
    m = ctrl.metrics()
    assert m["tim/lr/stale"] == 2 and m["tim/lr/trigger_count"] == 0 and ctrl.scale == 1.0


@settings(max_examples=150, deadline=None)
@given(cfg=small_cfg, seed=st.integers(0, 10**6), n=st.integers(1, 160))
def test_matches_reference(cfg, seed, n):
    xs = synthetic(seed, n, p_nan=0.1)
    assert run(LengthTriggeredLRDecay(cfg), xs) == reference_run(xs, cfg)


@settings(max_examples=120, deadline=None)
@given(cfg=small_cfg, mode=st.sampled_from(["step", "linear", "cosine"]), seed=st.integers(0, 10**6),
       n=st.integers(2, 160), cut_frac=st.floats(0, 1), extras=st.booleans())
def test_resume_is_bit_identical(cfg, mode, seed, n, cut_frac, extras):
    cfg.mode = mode
    if extras:
        cfg.signals = ("kl_k3", "grad_norm")
    xs = synthetic(seed, n, p_nan=0.1)
    ex = {"kl_k3": synthetic(seed + 1, n, 0.1), "grad_norm": synthetic(seed + 2, n, 0.1)} if extras else {}
    cut = int(cut_frac * n)
    full = LengthTriggeredLRDecay(cfg)
    traj_full = []
    for i in range(n):
        traj_full.append((full.observe(i, xs[i], **{k: v[i] for k, v in ex.items()}), full.metrics()))
    first = LengthTriggeredLRDecay(cfg)
    traj = []
    for i in range(cut):
        traj.append((first.observe(i, xs[i], **{k: v[i] for k, v in ex.items()}), first.metrics()))
    blob = json.dumps(first.state_dict(), allow_nan=False)  # strict JSON: no NaN/inf inside
    resumed = LengthTriggeredLRDecay(cfg)
    resumed.load_state_dict(json.loads(blob))
    for i in range(cut, n):
        traj.append((resumed.observe(i, xs[i], **{k: v[i] for k, v in ex.items()}), resumed.metrics()))

    def same(a, b):
        return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))

    assert len(traj) == len(traj_full)
    for (s1, m1), (s2, m2) in zip(traj, traj_full):
        assert s1 == s2  # bit-identical float
        assert m1.keys() == m2.keys() and all(same(m1[k], m2[k]) for k in m1)
    assert resumed.state_dict() == full.state_dict()


def test_state_survives_torch_save():
    xs = flat_then_ramp()
    a = LengthTriggeredLRDecay()
    run(a, xs[:100])
    buf = io.BytesIO()
    torch.save({"ctrl": a.state_dict()}, buf)
    buf.seek(0)
    b = LengthTriggeredLRDecay()
    b.load_state_dict(torch.load(buf, weights_only=True)["ctrl"])  # plain types load with weights_only
    assert run(a, xs[100:], start=100) == run(b, xs[100:], start=100)


def test_resume_with_other_options_warns():
    a = LengthTriggeredLRDecay()
    a.observe(0, 10.0)
    b = LengthTriggeredLRDecay(margin=0.5)
    with pytest.warns(UserWarning, match="margin: 0.25 -> 0.5"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({"version": 99})


def test_resume_with_a_smaller_window_uses_the_smaller_window():
    """A state saved with window=9 loaded by a controller with window=3: from the load on, the window level is the
    median of the last 3 values, as for a fresh window=3 controller fed the same signal (a surge of 1000 after
    100 shows in it within 2 steps), not a window that never shrinks."""
    xs = [100.0 * (1 + 0.01 * math.sin(i)) for i in range(100)] + [1000.0] * 20
    a = LengthTriggeredLRDecay(window=9, warmup_steps=5)
    run(a, xs[:20])
    b, fresh = LengthTriggeredLRDecay(window=3, warmup_steps=5), LengthTriggeredLRDecay(window=3, warmup_steps=5)
    with pytest.warns(UserWarning, match="window: 9 -> 3"):
        b.load_state_dict(a.state_dict())
    run(fresh, xs[:20])
    want = statistics.median(xs[17:20])
    assert b.metrics()["tim/lr/window_length"] == fresh.metrics()["tim/lr/window_length"] == want
    for i in range(20, len(xs)):
        b.observe(i, xs[i])
        fresh.observe(i, xs[i])
        want = statistics.median(xs[i - 2:i + 1])
        assert b.metrics()["tim/lr/window_length"] == fresh.metrics()["tim/lr/window_length"] == want, i
    assert b.state_dict()["trackers"]["length"]["window"] == xs[-3:]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(decay_factor=1.5), "decay_factor=1.5"),
        (dict(decay_factor=0.0), "decay_factor=0.0"),
        (dict(min_lr_ratio=0.0), "min_lr_ratio=0.0"),
        (dict(window=0), "window=0"),
        (dict(patience=2.5), "patience=2.5"),
        (dict(margin=-0.1), "margin=-0.1"),
        (dict(margin=math.nan), "margin=nan"),
        (dict(mode="exp"), "mode='exp'"),
        (dict(combine="most"), "combine='most'"),
        (dict(signals=("entropy",)), "'entropy'"),
        (dict(baseline_ema=0.0), "baseline_ema=0.0"),
        (dict(rebaseline_steps=0), "rebaseline_steps=0"),
        (dict(kl_k3_floor=-1.0), "kl_k3_floor=-1.0"),
    ],
)
def test_config_errors_quote_value(kw, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        LRDecayConfig(**kw)


def test_unknown_option_rejected():
    with pytest.raises(TypeError, match="warmup"):
        LengthTriggeredLRDecay(warmup=3)
