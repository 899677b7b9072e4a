"""The named causes (``tim_plugins.causes``) through the per-step pipeline: each rule against a naive re-statement
of it in the test, the probe's warn / raise / stop on a named cause, the registry feeding the fixes, checkpoints."""

from __future__ import annotations

import logging
import math
import statistics

import pytest
import torch

from tim_plugins.causes import (CAUSE_KEYS, CAUSES, Cause, CauseConfig, FloorHistory, cause_fix, causes_markdown,
                                confident_disagreements, summarize_names)
from tim_plugins.parity.findings import ParityError
from tim_plugins.parity.probe import ParityProbeConfig
from tim_plugins.pipeline import StepPipeline, pipeline_config
from tim_plugins.weight_sync import SyncReport


def _naive_confident(rollout, train, mask, p=0.5, gap=2.0):
    """(disagreeing, confident, forced), token by token: a token the engine gave p = 1 exactly (log-prob 0) is forced,
    never confident; a token with a non-finite or placeholder (<= -1e3) log-prob on either side is not counted."""
    dis = conf = forced = 0
    for r, t, m in zip(rollout.flatten().tolist(), train.flatten().tolist(), mask.flatten().tolist()):
        if not m or not (math.isfinite(r) and math.isfinite(t)) or r <= -1e3 or t <= -1e3:
            continue
        if r >= 0.0:  # p = 1, or a rounding above it
            forced += t < r - gap
        elif math.exp(r) >= p or r >= math.log(p):
            conf += 1
            if t < r - gap:
                dis += 1
    return dis, conf, forced


@pytest.mark.parametrize("seed", range(4))
def test_confident_disagreements_match_the_rule_token_by_token(seed):
    g = torch.Generator().manual_seed(seed)
    rollout = torch.log_softmax(torch.randn(5, 37, 11, generator=g) * 3, -1)[..., 0]
    train = rollout + torch.randn(rollout.shape, generator=g) * 2
    train[0, :3] = -math.inf
    rollout[1, 2] = math.nan
    rollout[2, ::3] = 0.0  # one-token distributions at the sampler: forced, whatever the trainer says
    rollout[3, 0] = -0.0
    rollout[3, 1:3] = torch.tensor([1e-7, 2e-6])  # a log_softmax's rounding above 0: p = 1, not confident
    train[3, 1:3] = torch.tensor([-5.0, -0.5])
    # trainer placeholders ("not reported") under a confident and a forced engine token, and at the threshold
    rollout[4, :3] = torch.tensor([-0.01, 0.0, -0.02])
    train[4, :3] = torch.tensor([-9999.0, -1e4, -1e3])
    mask = torch.rand(rollout.shape, generator=g) > 0.2
    mask[4, :3] = True
    mask[3, 1:3] = True
    dis, conf, forced = confident_disagreements(rollout, train, mask)
    assert (int(dis), int(conf), int(forced)) == _naive_confident(rollout, train, mask)
    assert int(conf) > 0 and int(dis) > 0 and int(forced) > 0


def test_floor_history_is_the_trailing_median_rule():
    # each condition alone: 0.05 and 0.06 are > 4x the median but within min_gap of it; 0.15 is min_gap above the
    # median (0.05) but only 3x it; 0.2 and 0.3 are both
    values = [0.01, 0.012, 0.011, 0.2, 0.013, 0.05, 0.06, math.nan, 0.3, 0.15]
    floor = FloorHistory(window=3, factor=4.0, min_gap=0.05)
    kept, jumps = [], []
    for v in values:
        ratio, jumped = floor.judge(v)
        if not math.isfinite(v):
            assert (math.isnan(ratio), jumped) == (True, False)
            continue
        if not kept:
            assert math.isnan(ratio) and not jumped
            kept.append(v)
            continue
        median = statistics.median(kept[-3:])
        assert ratio == pytest.approx(v / median)
        assert jumped == (v / median > 4 and v - median > 0.05)
        if not jumped:
            kept.append(v)
        else:
            jumps.append(v)
    assert floor.values == kept[-3:] and jumps == [0.2, 0.3]


def _pipeline(**causes):
    return StepPipeline(pipeline_config(causes=CauseConfig(**causes), probe=None), framework="trl")


def _batch(n=64, T=8, confident=0, seed=0, noise=1e-3):
    """Lag-0 log-probs: the engine's (some confident), the trainer's with rounding-sized noise and ``confident``
    tokens the engine gave p >= 0.5 scored 3 nats lower."""
    g = torch.Generator().manual_seed(seed)
    rollout = torch.log(torch.rand(n, T, generator=g) * 0.98 + 0.01)
    train = rollout + noise * torch.randn(n, T, generator=g)
    idx = (rollout >= math.log(0.5)).flatten().nonzero().flatten()[:confident]
    train.view(-1)[idx] = rollout.view(-1)[idx] - 3.0
    return rollout, train, torch.ones(n, T, dtype=torch.bool)


def test_a_healthy_stream_names_nothing():
    pipe = _pipeline()
    for step in range(1, 30):
        pipe.measure(*_batch(seed=step, noise=0.01 * (1 + 0.2 * math.sin(step))))
        out = pipe.compute(step, sync=False)[0]
        assert out["tim/cause/named"] == 0 and out["tim/cause/confident_disagreements"] == 0
        assert math.isnan(out["tim/cause/sync_bad_tensors"]) and math.isnan(out["tim/cause/sync_checked_tensors"])
    assert pipe.causes.named == []
    assert set(CAUSE_KEYS) <= set(out)


def test_confident_disagreements_name_engine_stale_from_the_threshold_on(caplog):
    pipe = _pipeline(confident_min_tokens=3)
    pipe.measure(*_batch(confident=2))
    out = pipe.compute(1, sync=False)[0]
    assert out["tim/cause/confident_disagreements"] == 2 and out["tim/cause/named"] == 0
    rollout, train, mask = _batch(confident=3, seed=1)  # at the threshold: named
    pipe.measure(rollout, train, mask)
    with caplog.at_level(logging.WARNING, logger="tim_plugins.causes"):
        out = pipe.compute(2, sync=False)[0]
    assert out["tim/cause/confident_disagreements"] == _naive_confident(rollout, train, mask)[0] == 3
    assert out["tim/cause/named"] == 1
    (cause,) = pipe.causes.named
    assert cause.code == "engine-stale" and cause.step == 2 and cause.evidence["confident_disagreements"] == 3
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("tim-plugins cause [engine-stale] at step 2: 3 of ") and "Fix (TRL): " in line


def test_forced_tokens_name_sampler_forced_and_not_engine_stale(caplog):
    """A sampler that left one token (structured outputs, a grammar, a logits processor) reports log p = 0 there;
    the trainer scores the unconstrained model. Those tokens are the constraint's: ``sampler-constrained`` is named, and
    ``engine-stale`` only counts the confident tokens the engine did not force (none disagree here)."""
    rollout, train, mask = _batch(seed=3)
    forced = torch.zeros_like(mask)
    forced[:, 2] = True  # every row's third token was forced
    rollout[forced] = 0.0
    train[forced] = -4.0 - 0.01 * torch.arange(int(forced.sum()), dtype=train.dtype)
    pipe = _pipeline()
    pipe.measure(rollout, train, mask)
    with caplog.at_level(logging.WARNING, logger="tim_plugins.causes"):
        out = pipe.compute(1, sync=False)[0]
    dis, conf, n_forced = _naive_confident(rollout, train, mask)
    assert (dis, n_forced) == (0, 64) and conf > 0
    assert out["tim/cause/confident_disagreements"] == 0 and out["tim/cause/named"] == 1
    (cause,) = pipe.causes.named
    assert cause.code == "sampler-constrained" and cause.evidence["forced_disagreements"] == 64
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("tim-plugins cause [sampler-constrained] at step 1: 64 lag-0 tokens the engine gave p = 1 (its sampler ")
    assert "vllm_structured_outputs_regex" in line
    # the same gap on tokens the engine did not force (p_rollout just below 1) is a stale engine's
    unforced = rollout.clone()
    unforced[forced] = -1e-4
    pipe = _pipeline()
    pipe.measure(unforced, train, mask)
    pipe.compute(1, sync=False)
    assert [c.code for c in pipe.causes.named] == ["engine-stale"]
    # forced tokens beside unforced confident disagreements: the stale engine explains both, one cause
    both = rollout.clone()
    both[:32, 2] = -1e-4
    pipe = _pipeline()
    pipe.measure(both, train, mask)
    out = pipe.compute(1, sync=False)[0]
    assert [c.code for c in pipe.causes.named] == ["engine-stale"] and out["tim/cause/confident_disagreements"] == 32


def test_with_the_audits_sampler_processing_confident_disagreements_name_the_constraint():
    """Structured outputs, custom processors, penalties (the audit's sampler-penalties-unmatched) leave a few tokens
    at a position: confident tokens then disagree without other weights, so they count for the constraint."""
    rollout, train, mask = _batch(confident=5, seed=1)
    pipe = _pipeline()
    pipe.audited(["sampler-penalties-unmatched", "dtype-mismatch"])
    pipe.measure(rollout, train, mask)
    out = pipe.compute(1, sync=False)[0]
    dis, conf, forced = _naive_confident(rollout, train, mask)
    assert (dis, forced) == (5, 0) and out["tim/cause/confident_disagreements"] == 5
    (cause,) = pipe.causes.named
    assert cause.code == "sampler-constrained" and cause.evidence["confident_disagreements"] == 5
    assert cause.message == (f"5 of {conf} lag-0 tokens the engine gave p >= 0.5 under the sampler processing the parity "
                             f"audit found (sampler-penalties-unmatched) are scored > 2 nats lower by the trainer")
    # one disagreement is below confident_min_tokens (2): nothing
    rollout, train, mask = _batch(confident=1, seed=1)
    pipe = _pipeline()
    pipe.audited(["sampler-penalties-unmatched"])
    pipe.measure(rollout, train, mask)
    assert pipe.compute(1, sync=False)[0]["tim/cause/named"] == 0


def test_a_jump_of_the_lag0_floor_is_named():
    pipe, floors, logged = _pipeline(), [], {}
    for step, noise in enumerate([0.01, 0.011, 0.012, 0.3, 0.012], start=1):
        pipe.measure(*_batch(seed=step, noise=noise))
        out = pipe.compute(step, sync=False)[0]
        logged[step] = out["tim/cause/floor_jump"]
        floors.append(out["tim/token/abs_diff_mean"])
        assert (out["tim/cause/named"] == 1) == (step == 4), step
    assert [c.code for c in pipe.causes.named] == ["floor-jump"]
    # the reference: the window's mean |Δ| over the median of the windows before it (the jumped one left out)
    assert logged[4] == pytest.approx(floors[3] / statistics.median(floors[:3])) == pipe.causes.named[0].evidence[
        "ratio"]
    assert logged[5] == pytest.approx(floors[4] / statistics.median(floors[:3]))


# The lag-0 floor (mean |Δ log p|) of a fault-free TRL run by hand, vLLM colocate with min_p=0.05, toy model, 6 steps
# (every tensor equal at every sync): the kept mass's bias, which moves with each batch (the same through
# GRPOTrainer.train() with TRL's own generation: tests/test_trl_callback.py)
MIN_P_FLOORS = [0.0132, 0.0712, 0.0145, 0.0867, 0.0251, 0.125]


@pytest.mark.parametrize("audit", [["sampler-truncation-unmatched"], ["sampler-penalties-unmatched"], []])
def test_the_floor_of_a_sampler_the_trainer_does_not_match_is_no_jump(audit):
    """Where the parity audit found sampler processing the trainer does not apply, the lag-0 floor is that
    processing's bias (every ratio reads the kept mass, or the penalties), not the stacks' numerics: its moves from
    batch to batch name no floor-jump. Without such a finding the same floors name it where the rule, recomputed
    here from the floors, says so."""
    pipe, kept, jumps, ratios = _pipeline(), [], [], {}
    pipe.audited(audit)
    rollout, _, mask = _batch()
    for step, floor in enumerate(MIN_P_FLOORS, start=1):
        pipe.measure(rollout, rollout - floor, mask)  # every token's ratio is the kept mass e^-floor
        out = pipe.compute(step, sync=False)[0]
        assert out["tim/token/abs_diff_mean"] == pytest.approx(floor, rel=1e-5)
        if kept:
            median = statistics.median(kept[-8:])
            ratios[step] = out["tim/cause/floor_jump"]
            assert ratios[step] == pytest.approx(floor / median, rel=1e-5)  # still reported
            if floor > 4 * median and floor - median > 0.05:
                jumps.append(step)
                continue
        kept.append(floor)
    named = [(c.step, c.code) for c in pipe.causes.named if c.code == "floor-jump"]
    assert jumps == [2, 4, 6]  # the rule on these floors, without the audit's finding
    assert named == ([] if audit else [(s, "floor-jump") for s in jumps])
    if audit == ["sampler-truncation-unmatched"]:  # the bias is named for what it is where ρ is below 0.98
        assert sorted({c.step for c in pipe.causes.named if c.code == "truncation"}) == [
            s for s, f in enumerate(MIN_P_FLOORS, start=1) if math.exp(-f) < 0.98]


def test_staleness_is_named_when_it_explains_an_unhealthy_log_ratio():
    pipe = _pipeline()
    rollout, train, mask = _batch()
    pipe.measure(rollout, train, mask)
    current = train + 0.3 * torch.randn(train.shape, generator=torch.Generator().manual_seed(5))
    pipe.loss_pass(rollout, train, current, mask)
    out = pipe.compute(1, sync=False)[0]
    assert out["tim/split/staleness_var_share"] > 0.5 and out["tim/staleness/token/kl_k3"] > 1e-3
    assert [c.code for c in pipe.causes.named] == ["staleness"]
    # the same split with a small staleness: healthy, nothing named
    pipe.measure(rollout, train, mask)
    pipe.loss_pass(rollout, train, train + 1e-3, mask)
    assert pipe.compute(2, sync=False)[0]["tim/cause/named"] == 0
    # ordinary PPO reuse: the whole variance, k3 above the mismatch limit 1e-3 but below staleness_k3 (0.015)
    pipe.measure(rollout, train, mask)
    current = train + 0.1 * torch.randn(train.shape, generator=torch.Generator().manual_seed(6))
    pipe.loss_pass(rollout, train, current, mask)
    out = pipe.compute(3, sync=False)[0]
    d = (current - train).double()
    assert out["tim/staleness/token/kl_k3"] == pytest.approx(float((torch.expm1(d) - d).mean()), rel=1e-5)
    assert out["tim/split/staleness_var_share"] > 0.5 and 1e-3 < out["tim/staleness/token/kl_k3"] < 0.015
    assert out["tim/cause/named"] == 0
    assert [c.code for c in pipe.causes.named] == ["staleness"]  # step 1's only
    # a staleness k3 far above staleness_k3 that explains little of the variance (the lag-0 mismatch dominates):
    # not named. Reference: the shares by the naive formula Var(current - train) / Var(current - rollout)
    pipe = _pipeline()
    g = torch.Generator().manual_seed(8)
    train = rollout + 0.5 * torch.randn(rollout.shape, generator=g)
    current = train + 0.2 * torch.randn(train.shape, generator=g)
    pipe.measure(rollout, train, mask)
    pipe.loss_pass(rollout, train, current, mask)
    out = pipe.compute(1, sync=False)[0]
    s, d = (current - train).double(), (current - rollout).double()
    share = float(s.var(correction=0) / d.var(correction=0))
    assert out["tim/split/staleness_var_share"] == pytest.approx(share, rel=1e-5) and share < 0.3
    assert out["tim/staleness/token/kl_k3"] == pytest.approx(float((torch.expm1(s) - s).mean()), rel=1e-5)
    assert out["tim/staleness/token/kl_k3"] > 0.015 and out["tim/cause/named"] == 0 and pipe.causes.named == []


@pytest.mark.parametrize("fresh_passes", [0, 1, 9])
def test_the_exact_split_judges_the_reused_tokens_whatever_the_fresh_ones_in_the_window(fresh_passes):
    """A logging window that holds a batch's first pass (lag 0, staleness exactly 0) beside its reused pass (lag 1):
    TRL's num_iterations=2 with logging_steps >= 2 (its default is 10). The rule reads the reused tokens alone, so
    the same reused pass is named whatever the fresh tokens around it; the pooled figures it no longer reads fall
    below the rule with them. Reference: the naive k3 and Var(s) / Var(d) over the reused tokens."""
    g = torch.Generator().manual_seed(21)
    rollout, train, mask = _batch()
    train = rollout + 0.02 * torch.randn(rollout.shape, generator=g)
    current = train + 0.2 * torch.randn(train.shape, generator=g)  # k3 ~0.02: above staleness_k3 (0.015)
    s, d = (current - train).double(), (current - rollout).double()
    pipe = _pipeline()
    for _ in range(fresh_passes):
        pipe.measure(rollout, train, mask)
        pipe.loss_pass(rollout, train, train, mask, lag=torch.zeros(mask.shape, dtype=torch.long))
    pipe.measure(rollout, train, mask)
    pipe.loss_pass(rollout, train, current, mask, lag=torch.ones(mask.shape, dtype=torch.long))
    out = pipe.compute(1, sync=False)[0]
    k3, share = _naive_k3(s), float(s.var(correction=0) / d.var(correction=0))
    assert out["tim/split/reused_tokens"] == mask.sum()
    assert out["tim/split/reused_staleness_kl_k3"] == pytest.approx(k3, rel=1e-5) and k3 > 0.015
    assert out["tim/split/reused_staleness_var_share"] == pytest.approx(share, rel=1e-5) and share > 0.5
    assert out["tim/staleness/token/kl_k3"] == pytest.approx(k3 / (fresh_passes + 1), rel=1e-5)  # pooled
    assert [c.code for c in pipe.causes.named] == ["staleness"]
    (cause,) = pipe.causes.named
    assert f"of the {int(mask.sum())} tokens trained after an optimizer step" in cause.message
    assert cause.evidence["staleness_k3"] == pytest.approx(k3, rel=1e-5)
    # a window of first passes alone: nothing reused, nothing named
    pipe.measure(rollout, train, mask)
    pipe.loss_pass(rollout, train, train, mask, lag=torch.zeros(mask.shape, dtype=torch.long))
    out = pipe.compute(2, sync=False)[0]
    assert out["tim/split/reused_tokens"] == 0.0 and out["tim/cause/named"] == 0.0


def _naive_k3(d: torch.Tensor) -> float:
    d = d.double()
    return float((torch.expm1(d) - d).mean())


@pytest.mark.parametrize("floor_noise, stale_noise, named", [
    (1e-3, 0.3, True),  # stale k3 ~0.045 over a ~5e-7 floor: the move is the whole of it
    (1e-3, 0.1, False),  # stale k3 ~0.005: ordinary PPO reuse (staleness_k3 0.015)
    (0.5, 0.7, False),  # a floor of ~0.16 (the mismatch) under a stale k3 of ~0.27: a move above staleness_k3
    # but a third of the stale tokens' k3
])
def test_an_asynchronous_trainers_staleness_is_named_by_lag(floor_noise, stale_noise, named):
    """No π_old at each sample's weights (``measure_lagged`` / ``loss_pass_lagged``): the rule reads the window's
    statistics by lag. Reference: k3 by its definition over each lag's tokens, the stale tokens' (lag >= 1) pooled,
    less the lag-0 floor, against staleness_k3 and staleness_share."""
    g = torch.Generator().manual_seed(11)
    rollout, _, mask = _batch(n=60)
    lag = torch.tensor([0] * 20 + [1] * 24 + [3] * 16).view(-1, 1).expand(mask.shape)
    d = torch.where(lag == 0, floor_noise, stale_noise) * torch.randn(rollout.shape, generator=g)
    current = rollout + d
    pipe = _pipeline()
    pipe.measure_lagged(rollout, current, mask, lag[:, 0])
    pipe.loss_pass_lagged(rollout, current, mask, lag[:, 0])
    out = pipe.compute(1, sync=False)[0]
    floor, stale = _naive_k3(d[lag == 0]), _naive_k3(d[lag >= 1])
    part = stale - floor
    assert out["tim/by_lag/0/kl_k3"] == pytest.approx(floor, rel=1e-4, abs=1e-9)
    assert (part > 0.015 and part >= 0.5 * stale) == named, (floor, stale)
    if floor_noise == 0.5:  # the share decides here, not staleness_k3
        assert part > 0.015 and part < 0.5 * stale, (floor, stale)
    assert out["tim/cause/named"] == float(named)
    if named:
        (cause,) = pipe.causes.named
        assert cause.code == "staleness" and "1 to 3 optimizer steps" in cause.message
        assert cause.evidence["stale_tokens"] == 40 * 8
        assert cause.evidence["stale_k3"] == pytest.approx(stale, rel=1e-4)
        assert cause.evidence["staleness_k3"] == pytest.approx(part, rel=1e-4)
    # a window without lag-0 tokens (every lag one higher): judged against the last floor a window measured ...
    older = lag[:, 0] + 1
    pipe.measure_lagged(rollout, current, mask, older)
    pipe.loss_pass_lagged(rollout, current, mask, older)
    out = pipe.compute(2, sync=False)[0]
    assert not out.get("tim/by_lag/0/count")
    stale = _naive_k3(d)
    assert out["tim/cause/named"] == float(stale - floor > 0.015 and stale - floor >= 0.5 * stale)
    # ... and not judged before any window measured one
    pipe = _pipeline()
    pipe.measure_lagged(rollout, current, mask, older)
    pipe.loss_pass_lagged(rollout, current, mask, older)
    assert pipe.compute(1, sync=False)[0]["tim/cause/named"] == 0.0


def test_the_exact_split_decides_where_there_is_one_not_the_lags():
    """A synchronous trainer's loss passes carry the exact split, which decides: a reused batch whose later pass
    moved further along the mismatch (s = m / 2, so d = 1.5 m at lag 2) reads as staleness by lag (k3 2.25x the
    lag-0 floor) but the split finds a staleness part of under a tenth of the variance: not named."""
    g = torch.Generator().manual_seed(12)
    rollout, _, mask = _batch()
    m = 0.3 * torch.randn(rollout.shape, generator=g)
    train, current = rollout + m, rollout + 1.5 * m
    pipe = _pipeline()
    pipe.measure(rollout, train, mask)
    pipe.loss_pass(rollout, train, train, mask, lag=torch.zeros_like(mask, dtype=torch.long))
    pipe.loss_pass(rollout, train, current, mask, lag=torch.full(mask.shape, 2))
    out = pipe.compute(1, sync=False)[0]
    floor, stale = _naive_k3(m), _naive_k3(1.5 * m)
    assert out["tim/by_lag/2/kl_k3"] == pytest.approx(stale, rel=1e-4)
    assert stale - floor > 0.015 and stale - floor >= 0.5 * stale  # the rule by lag would name it
    # the split over both passes' tokens by its naive formula, Var(current - train) / Var(current - rollout)
    s_all, d_all = torch.cat([torch.zeros_like(m), 0.5 * m]).double(), torch.cat([m, 1.5 * m]).double()
    share = float(s_all.var(correction=0) / d_all.var(correction=0))
    assert out["tim/split/staleness_var_share"] == pytest.approx(share, rel=1e-4) and share < 0.1
    assert out["tim/cause/named"] == 0.0 and pipe.causes.named == []


def test_truncation_needs_the_audits_finding_and_the_kept_mass_bias():
    rollout, train, mask = _batch()
    kept = math.log(0.85)
    # the bias (truncation_bias 0.02) on both sides: a kept mass of 0.97 is named, one of 0.99 is not
    for audit, shift, named in (([], kept, False), (["sampler-truncation-unmatched"], kept, True),
                                (["sampler-truncation-unmatched"], 0.0, False),
                                (["sampler-truncation-unmatched"], math.log(0.97), True),
                                (["sampler-truncation-unmatched"], math.log(0.99), False)):
        pipe = _pipeline()
        pipe.audited(audit)
        pipe.measure(rollout, rollout + shift, mask)
        pipe.compute(1, sync=False)
        assert ([c.code for c in pipe.causes.named] == ["truncation"]) == named, (audit, shift)
        if named:  # the evidence: the mean ρ, e^shift on every token
            assert pipe.causes.named[0].evidence["ratio_mean"] == pytest.approx(math.exp(shift), rel=1e-6)


def test_a_truncation_the_trainer_does_not_apply_is_no_stale_engine():
    """The sampler truncates (top-k / top-p), the trainer does not (the audit's sampler-truncation-unmatched): the
    engine's log-probs are renormalised over the kept tokens, so where the kept mass is below e^-2 a confident token
    sits more than 2 nats above the trainer's on the same weights. Named: truncation alone, not engine-stale nor
    sampler-constrained; the confident-token count is still reported. Without the audit's finding the same tokens
    name engine-stale (nothing else explains them)."""
    rollout, _, mask = _batch(confident=5, seed=1)
    kept = math.log(0.08)  # every position keeps 8 % of the mass
    for audit, want in ((["sampler-truncation-unmatched"], ["truncation"]), ([], ["engine-stale"])):
        pipe = _pipeline()
        pipe.audited(audit)
        train = rollout + kept
        pipe.measure(rollout, train, mask)
        out = pipe.compute(1, sync=False)[0]
        dis, _, forced = _naive_confident(rollout, train, mask)
        assert dis >= 5 and out["tim/cause/confident_disagreements"] == dis
        assert [c.code for c in pipe.causes.named] == want, audit


def _report(step=3, bad=("model.layers.1.q.weight",)):
    report = SyncReport(step, 1, statuses={"a": "ok", **{n: "stale" for n in bad}})
    report.causes = [Cause("sync-tensors-stale", step, "stale", tensors=bad)]
    return report


def test_a_sync_cause_is_logged_at_once_and_counted_in_the_next_window(caplog):
    pipe = _pipeline()
    with caplog.at_level(logging.WARNING, logger="tim_plugins.causes"):
        pipe.sync_checked(_report())
        assert len(caplog.records) == 1 and "[sync-tensors-stale] at step 3" in caplog.records[0].getMessage()
        pipe.measure(*_batch())
        out = pipe.compute(4, sync=False)[0]
    assert len(caplog.records) == 1  # not twice
    assert out["tim/cause/named"] == 1 and out["tim/cause/sync_bad_tensors"] == 1
    assert out["tim/cause/sync_checked_tensors"] == 2
    pipe.measure(*_batch())
    out = pipe.compute(5, sync=False)[0]
    assert out["tim/cause/named"] == 0 and math.isnan(out["tim/cause/sync_bad_tensors"])


def test_the_same_fault_on_two_replicas_is_named_once_and_different_ones_apart(tmp_path):
    """Two replicas' sync reports with the same cause (both rollout servers skipped the same layer): one row in the
    window's causes and in causes.jsonl, as one console line; a replica missing other tensors is a row of its own."""
    import json

    from tim_plugins.dump import DumpConfig

    pipe = StepPipeline(pipeline_config(causes=CauseConfig(), probe=None,
                                        dump=DumpConfig(out_dir=str(tmp_path), sample_rate=1.0)), framework="verl")
    pipe.sync_checked(_report())
    pipe.sync_checked(_report())
    pipe.measure(*_batch())
    out = pipe.compute(4, sync=False)[0]
    assert out["tim/cause/named"] == 1
    pipe.sync_checked(_report(step=4))
    pipe.sync_checked(_report(step=4, bad=("model.layers.0.q.weight",)))
    pipe.measure(*_batch())
    pipe.compute(5, sync=False)
    rows = [json.loads(line) for line in (tmp_path / "causes.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tensors"], r["window"]) for r in rows] == [
        (3, ["model.layers.1.q.weight"], 4), (4, ["model.layers.1.q.weight"], 5), (4, ["model.layers.0.q.weight"], 5)]


def test_a_lasting_sync_fault_is_logged_at_every_sync_and_the_memory_of_logged_causes_is_bounded(caplog):
    """A fault that lasts: each faulty sync's cause is logged once (its step is in the message), the tracker
    remembers the last LOGGED_KEPT of them, not one entry per faulty sync of the run."""
    from tim_plugins.causes import LOGGED_KEPT

    pipe = _pipeline()
    n = LOGGED_KEPT + 50
    with caplog.at_level(logging.WARNING, logger="tim_plugins.causes"):
        for step in range(n):
            for _ in range(2):  # the same cause again: not logged twice
                report = _report(step=step)
                report.causes = [Cause("sync-tensors-stale", step, f"at the weight sync after optimizer step {step}",
                                       tensors=("model.layers.1.q.weight",))]
                pipe.sync_checked(report)
    assert [r.getMessage().split("] at step ")[1].split(":")[0] for r in caplog.records] == [str(s) for s in range(n)]
    assert len(pipe.causes._logged) == LOGGED_KEPT


@pytest.mark.parametrize("action", ["warn", "raise", "stop"])
def test_a_named_cause_trips_the_probe(action):
    # limits no healthy batch reaches: only the cause can trip
    probe = ParityProbeConfig(kl_k3_max=None, seq_log_ratio_abs_max=1e9, action=action)
    pipe = StepPipeline(pipeline_config(probe=probe))
    pipe.measure(*_batch())
    assert not pipe.compute(1, sync=False)[1].tripped
    pipe.sync_checked(_report())
    pipe.measure(*_batch())
    if action == "raise":
        with pytest.raises(ParityError, match="tim/cause/named"):
            pipe.compute(2, sync=False)
        return
    decision = pipe.compute(2, sync=False)[1]
    assert decision.tripped and [t.key for t in decision.trips] == ["tim/cause/named"]
    assert decision.stop == (action == "stop")


def test_causes_off():
    pipe = StepPipeline(pipeline_config(causes=None))
    assert pipe.causes is None
    pipe.sync_checked(_report())  # nothing to do, no error
    pipe.measure(*_batch(confident=9))
    assert not any(k.startswith("tim/cause/") for k in pipe.compute(1, sync=False)[0])
    assert StepPipeline(pipeline_config(monitor=False)).causes is None  # the stream rules read the monitor


def test_state_dict_roundtrip():
    """The floor's windows and the causes named are carried; the parity audit's codes are not: they are the resumed
    attempt's own audit's (verl sets them before its checkpoint is loaded, TRL after)."""
    pipe = _pipeline()
    pipe.audited(["sampler-penalties-unmatched"])
    for step in (1, 2):
        pipe.measure(*_batch(seed=step, confident=3 * (step - 1)))
        pipe.compute(step, sync=False)
    assert pipe.causes.named and len(pipe.causes.floor.values) == 2
    again = _pipeline()
    again.audited(["sampler-truncation-unmatched"])
    again.load_state_dict(pipe.state_dict())
    assert again.causes.floor.values == pipe.causes.floor.values
    assert [c.to_dict() for c in again.causes.named] == [c.to_dict() for c in pipe.causes.named]
    assert again.causes.tally == pipe.causes.tally
    assert again.causes.audit_codes == {"sampler-truncation-unmatched"}


def test_a_cause_named_in_every_window_keeps_the_checkpoint_bounded(monkeypatch):
    """A cause that persists is named in every window: the tracker keeps the last NAMED_KEPT of them (what its
    checkpoint carries), every window still counts it."""
    import tim_plugins.causes as causes

    monkeypatch.setattr(causes, "NAMED_KEPT", 5)
    pipe = _pipeline()
    for step in range(1, 13):
        pipe.sync_checked(_report(step))
        assert pipe.compute(step, sync=False)[0]["tim/cause/named"] == 1.0
    assert [c.step for c in pipe.causes.named] == [8, 9, 10, 11, 12]
    assert len(pipe.state_dict()["causes"]["named"]) == 5


@pytest.mark.parametrize("framework", ["trl", "verl"])
def test_registry_every_cause_has_the_frameworks_words_and_a_documented_rule(framework):
    import importlib

    words = importlib.import_module(f"tim_plugins.integrations.{framework}.fixes").CAUSE_FIXES
    assert set(words) == set(CAUSES)
    for code in CAUSES:
        assert cause_fix(code, framework) == words[code]
        assert cause_fix(code, None)  # the core's words
    text = causes_markdown()
    assert all(f"**`{code}`**" in text for code in CAUSES)
    with pytest.raises(ValueError, match="unknown cause code"):
        Cause("nope", 1, "x")


def test_summarize_names():
    names = [f"model.layers.1.{k}.weight" for k in "qkv"] + ["model.norm.weight"]
    assert summarize_names(names) == "model.layers.1.* (3 tensors), model.norm.weight"
    assert summarize_names([f"t{i}" for i in range(9)], limit=3) == "t0, t1, t2 (+6 more)"


@pytest.mark.parametrize("bad", [{"confident_p": 1.0}, {"confident_gap": 0}, {"confident_min_tokens": 0},
                                 {"floor_jump_factor": 1.0}, {"floor_jump_min": -1}, {"floor_jump_min": 0.0},
                                 {"floor_window": True},
                                 {"staleness_share": 0}, {"truncation_bias": 1}])
def test_config_rules(bad):
    with pytest.raises(ValueError, match=f"CauseConfig.{next(iter(bad))}="):
        CauseConfig(**bad)


def test_docs_list_every_cause_from_the_registry():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "causes.md").read_text()
    codes = doc.split("<!-- codes: tim_plugins.causes.causes_markdown() -->\n")[1].split("\n<!-- /codes -->")[0]
    assert codes == causes_markdown(), "docs/causes.md: paste tim_plugins.causes.causes_markdown() between the markers"


def test_the_run_closes_with_one_line_per_cause_named_its_steps_and_fix():
    """Each cause's own line is printed once, at its first step; the lines that close the run (``summary_lines``)
    give every code named, in the order first named, with the windows and first and last steps it was named at, its
    first message and its fix. The tally holds the whole run (``named`` keeps the last NAMED_KEPT causes) and rides
    in the tracker's state (a resumed TRL run closes with the attempt's causes); a state saved without a tally
    rebuilds it from the causes it kept."""
    from tim_plugins.causes import NAMED_KEPT, CauseTracker

    tracker = CauseTracker(framework="verl")
    assert tracker.summary_lines() == []
    stale = [s for s in range(3, NAMED_KEPT + 40)]  # more windows than `named` keeps
    for step in stale:
        tracker._keep([Cause("staleness", step, f"share {step}")])
    tracker._keep([Cause("sync-noop", 1, "none of the 27 checked tensors changed"), Cause("sync-noop", 1, "again")])
    want = [
        "tim-plugins: this run named [sync-noop] at step 1 (first: none of the 27 checked tensors changed). Fix "
        f"(verl): {cause_fix('sync-noop', 'verl')}",
        f"tim-plugins: this run named [staleness] in {len(stale)} windows, steps 3 to {stale[-1]} (first: share 3). "
        f"Fix (verl): {cause_fix('staleness', 'verl')}",
    ]
    assert tracker.summary_lines() == want and len(tracker.named) == NAMED_KEPT
    resumed = CauseTracker(framework="verl")
    resumed.load_state_dict(tracker.state_dict())
    assert resumed.summary_lines() == want
    old = tracker.state_dict()
    del old["tally"]
    resumed = CauseTracker(framework="verl")
    resumed.load_state_dict(old)  # only the kept causes: the staleness windows before them are not known
    kept = [s for s in stale if s > stale[-1] - NAMED_KEPT + 2]
    assert resumed.summary_lines() == [want[0], (
        f"tim-plugins: this run named [staleness] in {len(kept)} windows, steps {kept[0]} to {stale[-1]} (first: "
        f"share {kept[0]}). Fix (verl): {cause_fix('staleness', 'verl')}")]


def test_a_sync_cause_is_written_at_the_sync_so_the_sync_after_the_last_step_reaches_the_report(tmp_path):
    """verl syncs after every step, the last one too (and the step the probe stops at): no window closes after that
    sync, so its cause is written beside the dump when the sync is checked, with the window that would name it
    (the step after its own), and the window that does close later writes it no second time. Reference: the rows
    as written, one per cause, against the causes the console named."""
    import json

    from tim_plugins.dump import DumpConfig
    from tim_plugins.report.causes import read_causes

    pipe = StepPipeline(pipeline_config(causes=CauseConfig(), probe=None,
                                        dump=DumpConfig(out_dir=str(tmp_path), sample_rate=1.0)), framework="verl")
    log = tmp_path / "causes.jsonl"
    pipe.sync_checked(_report(step=3))
    assert [(r["code"], r["step"], r["window"]) for r in map(json.loads, log.read_text().splitlines())] == [
        ("sync-tensors-stale", 3, 4)]
    pipe.measure(*_batch(confident=5, seed=1))  # the window also names a stream rule's cause
    out, _, _ = pipe.compute(4, sync=False)
    assert out["tim/cause/named"] == 2
    pipe.sync_checked(_report(step=4))  # the last step's sync: no window after it
    rows = read_causes(tmp_path)
    assert [(r["code"], r["step"], r["window"]) for r in rows] == [
        ("sync-tensors-stale", 3, 4), ("engine-stale", 4, 4), ("sync-tensors-stale", 4, 5)]
    assert sorted((c.code, c.step) for c in pipe.causes.named) == [("engine-stale", 4), ("sync-tensors-stale", 3)]


def test_a_window_of_a_few_lag0_tokens_is_neither_judged_nor_kept_by_the_floor_rule():
    """A healthy floor (~0.01 nats) then a window of 8 lag-0 tokens, one of them a tail token 1 nat off (mean 0.13:
    13x the median, 0.12 above it): not judged, not kept; the same mean over the configured minimum is judged. The
    reference: the rule as docs/causes.md states it, computed here."""
    c = CauseConfig()
    assert c.floor_min_tokens == 16
    pipe = _pipeline()
    for step in range(1, 5):
        pipe.measure(*_batch(seed=step, noise=0.01))
        out = pipe.compute(step, sync=False)[0]
        assert out["tim/cause/named"] == 0
    kept = list(pipe.causes.floor.values)
    g = torch.Generator().manual_seed(9)
    for n, named in ((8, False), (c.floor_min_tokens, True)):
        rollout = torch.log(torch.rand(1, n, generator=g) * 0.9 + 0.05)
        train = rollout + 0.01
        train[0, 0] = rollout[0, 0] - 1.0  # one tail token 1 nat off
        pipe.measure(rollout, train, torch.ones(1, n, dtype=torch.bool))
        out = pipe.compute(10 + n, sync=False)[0]
        floor = out["tim/token/abs_diff_mean"]
        median = statistics.median(kept[-c.floor_window:])
        assert out["tim/tokens"] == n and floor > c.floor_jump_factor * median and floor - median > c.floor_jump_min
        assert ("floor-jump" in {x.code for x in pipe.causes.named if x.step == 10 + n}) is named
        assert math.isnan(out["tim/cause/floor_jump"]) is not named
        assert pipe.causes.floor.values == kept  # neither window entered the trailing median
