"""Mismatch or staleness through verl's own engine (#39): a global step whose batch trains twice (two optimizer steps
on the same rollout, as ``ppo_epochs=2`` or two mini-batches do), driven as ``TrainingWorker`` drives it
(infer_batch for the old log-probs, train_batch per optimizer step, lr_scheduler_step at the end of the step).

Reference, independent of tim's accumulators: verl's own tensors at each loss call (the log-probs verl hands its
``ppo_loss``, the ``old_log_probs`` and ``rollout_log_probs`` of the micro-batch), recorded by a loss function that
wraps verl's, and the split computed from them with naive float64 formulas in the test."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("verl")

import harness as H  # noqa: E402
import torch  # noqa: E402

from tim_plugins.integrations.verl.config import TIMVerlConfig  # noqa: E402
from naive_turns import turns_naive  # noqa: E402

VOCAB = 383
# float64 sums over float32 log-probs on both sides: the same values summed in another order
REL = 1e-9


def _train(engine, td, old, loss_fn, *, passes: int):
    """``passes`` optimizer steps on the same batch, then the scheduler step that ends verl's global step."""
    from verl.utils import tensordict_utils as tu

    td = td.copy()
    td["old_log_probs"] = H.response_nested(old, td) if td["response_mask"].is_nested else old
    tu.assign_non_tensor(td, use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         max_token_len_per_gpu=4096, use_fused_kernels=False, calculate_entropy=False,
                         global_batch_size=td.batch_size[0])
    with engine.train_mode():
        for _ in range(passes):
            engine.train_batch(td, loss_function=loss_fn)
        engine.lr_scheduler_step()


def _recording_loss(calls: list):
    """verl's ppo_loss (FSDP's actor config), recording each call's (current, old, rollout, mask)."""
    from verl.workers.config import FSDPActorConfig

    return H.recording_ppo_loss(FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                                                ppo_mini_batch_size=4, use_dynamic_bsz=False), calls)


def _recording_lag_loss(calls: list, lags: list):
    """``_recording_loss`` that also records each call's samples' lags (the driver's ``LAG_FIELD``)."""
    from tim_plugins.integrations.verl.config import LAG_FIELD

    record = _recording_loss(calls)

    def loss(*, model_output, data, dp_group=None):
        lags.append(data[LAG_FIELD].clone())
        return record(model_output=model_output, data=data, dp_group=dp_group)

    return loss


def _assert_by_lag(metrics: dict, want: dict) -> None:
    """``tim/by_lag/<lag>/*`` holds exactly the lags of ``want`` ({lag: [log-ratio rows]}): each one's token count
    and naive k3."""
    assert {k for k in metrics if k.startswith("tim/by_lag/") and k.endswith("/count")} == {
        f"tim/by_lag/{lag}/count" for lag in want}
    for lag, parts in want.items():
        d = torch.cat(parts)
        assert metrics[f"tim/by_lag/{lag}/count"] == d.numel()
        assert metrics[f"tim/by_lag/{lag}/kl_k3"] == pytest.approx(_k3(d), rel=1e-6)


def _k3(d: torch.Tensor) -> float:
    return float((torch.expm1(d) - d).mean())


def test_the_split_of_a_reused_batch_against_verls_own_tensors(toy_model_path):
    H.init_dist(port=29577)
    engine = H.build_engine(toy_model_path, lr=1e-2)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
    # the rollout disagrees with the actor by ~0.05 nats (an injected mismatch); the update moves the policy
    td, raw = H.make_batch(VOCAB, response=6, seed=3, rollout_noise=0.05)
    old = H.old_log_probs_padded(H.infer(engine, td), td)
    rollout = raw["rollout_log_probs"].double()
    engine.tim_pop_metrics()  # the old-log-prob pass's measurement
    calls: list = []
    _train(engine, td, old, _recording_loss(calls), passes=2)
    got = engine.tim_pop_metrics()

    # two micro-batches per optimizer step (micro_batch_size_per_gpu=2, 4 rows): passes 0-1 at lag 0, 2-3 at lag 1
    assert len(calls) == 4
    s_parts, m_parts, lag1 = [], [], []
    for i, (current, old_mb, rollout_mb, mask) in enumerate(calls):
        lag = i // 2
        pi_old = current if lag == 0 else old_mb  # no update since the rollout: pi_theta is pi_old
        s, m = (current - pi_old)[mask], (pi_old - rollout_mb)[mask]
        s_parts.append(s)
        m_parts.append(m)
        if lag == 1:
            lag1.append((current - rollout_mb)[mask])
    s, m = torch.cat(s_parts), torch.cat(m_parts)
    n = s.numel()
    assert got["tim/split/tokens"] == n == 2 * int(raw["response_mask"].sum())
    assert got["tim/split/staleness_mean"] == pytest.approx(float(s.mean()), rel=REL)
    assert got["tim/split/mismatch_mean"] == pytest.approx(float(m.mean()), rel=REL)
    var_s, var_m = float(s.var(unbiased=False)), float(m.var(unbiased=False))
    cov = float(((s - s.mean()) * (m - m.mean())).mean())
    total = var_s + var_m + 2 * cov
    assert got["tim/split/total_var"] == pytest.approx(float((s + m).var(unbiased=False)), rel=1e-6)
    assert got["tim/split/staleness_var_share"] == pytest.approx(var_s / total, rel=1e-6)
    assert got["tim/split/mismatch_var_share"] == pytest.approx(var_m / total, rel=1e-6)
    assert got["tim/split/cov_share"] == pytest.approx(2 * cov / total, rel=1e-5, abs=1e-9)
    # the staleness part's own statistics: zero by construction at lag 0, the update's move at lag 1
    assert got["tim/staleness/tokens"] == n
    assert got["tim/staleness/token/kl_k3"] == pytest.approx(_k3(s), rel=1e-6)
    assert got["tim/staleness/token/abs_diff_max"] == pytest.approx(float(s.abs().max()), rel=1e-6)
    assert float(s[: n // 2].abs().max()) == 0.0 and float(s[n // 2:].abs().max()) > 1e-4  # it moved
    # by lag: the whole log-ratio current - rollout; lag 0 is the mismatch floor (the rollout vs pi_old)
    d0 = torch.cat(m_parts[:2])
    d1 = torch.cat(lag1)
    assert got["tim/by_lag/0/count"] == d0.numel() and got["tim/by_lag/1/count"] == d1.numel()
    assert got["tim/by_lag/0/kl_k3"] == pytest.approx(_k3(d0), rel=1e-6)
    assert got["tim/by_lag/1/kl_k3"] == pytest.approx(_k3(d1), rel=1e-6)
    assert "tim/by_lag/2/count" not in got
    # the mismatch part is the measured one: pi_old against the rollout over the same tokens
    m_old = (old.double() - rollout)[raw["response_mask"].bool()]
    assert float(m_old.mean()) == pytest.approx(float(torch.cat(m_parts[:2]).mean()), rel=1e-6)


def test_a_batch_trained_once_has_a_staleness_part_of_exactly_zero(toy_model_path):
    H.init_dist(port=29578)
    engine = H.build_engine(toy_model_path, lr=1e-2)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
    for step in range(2):  # the lag restarts at every global step
        td, raw = H.make_batch(VOCAB, response=6, seed=20 + step)
        old = H.old_log_probs_padded(H.infer(engine, td), td)
        engine.tim_pop_metrics()
        calls: list = []
        _train(engine, td, old, _recording_loss(calls), passes=1)
        got = engine.tim_pop_metrics()
        n = int(raw["response_mask"].sum())
        assert got["tim/staleness/tokens"] == n and got["tim/split/tokens"] == n
        for key in ("tim/staleness/token/kl_k3", "tim/staleness/token/abs_diff_max", "tim/split/staleness_mean",
                    "tim/split/staleness_var_share", "tim/split/cov_share"):
            assert got[key] == 0.0, (step, key)
        assert got["tim/split/mismatch_var_share"] == 1.0
        assert got["tim/by_lag/0/count"] == n and "tim/by_lag/1/count" not in got
        assert not math.isnan(got["tim/split/mismatch_mean"])


@pytest.mark.parametrize("passes,lr,port", [(2, 1e-4, 29591), (2, 1e-5, 29592), (1, 1e-4, 29593)])
def test_staleness_is_named_in_the_step_its_loss_passes_end_and_the_probe_acts_on_it(toy_model_path, passes, lr,
                                                                                      port):
    """verl closes the step's window at the old-log-prob pass, before its loss passes: the staleness rule runs when
    they end (lr_scheduler_step), counts in the step's ``tim/cause/named`` and reaches the driver's decision. A
    rollout at the trainer's numbers (1e-4 nats apart): a reused batch's staleness part is the whole log-ratio's
    variance (naive float64 split of verl's own tensors); the rule reads the second pass's tokens (lag 1: the first
    pass's staleness is 0 and would halve the k3), named where their k3 is above CauseConfig.staleness_k3 (lr 1e-4:
    ~0.17), not where it is ordinary PPO reuse (lr 1e-5: ~0.002, above the mismatch limit 1e-3); a batch trained once
    has none."""
    from tim_plugins.causes import CauseConfig

    H.init_dist(port=port)
    engine = H.build_engine(toy_model_path, lr=lr)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True},
                                                  "probe": {"kl_k3": 1e9, "action": "stop"}}))
    td, raw = H.make_batch(VOCAB, response=6, seed=7)
    trained = H.old_log_probs_padded(H.infer(engine, td), td)  # the actor's own log-probs of these tokens
    engine.tim_pop_metrics(), engine.tim_pop_decision()  # that pass measured the batch's random rollout
    noise = 1e-4 * torch.randn(trained.shape, generator=torch.Generator().manual_seed(1))
    rollout = (trained + noise).to(raw["rollout_log_probs"].dtype)
    td["rollout_log_probs"] = H.response_nested(rollout, td) if td["response_mask"].is_nested else rollout
    old = H.old_log_probs_padded(H.infer(engine, td), td)
    before = len(engine._tim_pipeline.causes.named)
    calls: list = []
    _train(engine, td, old, _recording_loss(calls), passes=passes)
    got, decision = engine.tim_pop_metrics(), engine.tim_pop_decision()
    s = torch.cat([(cur - (cur if i < 2 else old_mb))[mask] for i, (cur, old_mb, _, mask) in enumerate(calls)])
    m = torch.cat([((cur if i < 2 else old_mb) - roll)[mask] for i, (cur, old_mb, roll, mask) in enumerate(calls)])
    share, k3 = float(s.var(unbiased=False)) / float((s + m).var(unbiased=False)), _k3(s)
    assert got["tim/split/staleness_var_share"] == pytest.approx(share, rel=1e-6, abs=1e-12)
    assert got["tim/staleness/token/kl_k3"] == pytest.approx(k3, rel=1e-6, abs=1e-12)
    # the reused tokens alone: the second pass's micro-batches (lag 1)
    sr = torch.cat([(cur - old_mb)[mask] for cur, old_mb, _, mask in calls[2:]] + [s[:0]])
    mr = torch.cat([(old_mb - roll)[mask] for _, old_mb, roll, mask in calls[2:]] + [s[:0]])
    assert got["tim/split/reused_tokens"] == sr.numel()
    named = engine._tim_pipeline.causes.named[before:]
    limit = CauseConfig().staleness_k3
    if passes == 1:
        assert share == k3 == 0.0 and sr.numel() == 0
    else:
        share, k3 = float(sr.var(unbiased=False)) / float((sr + mr).var(unbiased=False)), _k3(sr)
        assert got["tim/split/reused_staleness_var_share"] == pytest.approx(share, rel=1e-6)
        assert got["tim/split/reused_staleness_kl_k3"] == pytest.approx(k3, rel=1e-6)
    if passes == 1 or lr < 1e-4:
        if passes == 2:
            assert share > 0.99 and 1e-3 < k3 < limit
        assert got["tim/cause/named"] == 0.0 and named == [] and (decision is None or not decision.tripped)
        return
    assert share > 0.99 and k3 > limit  # the rule's inputs, independently
    assert got["tim/cause/named"] == 1.0 and got["tim/probe/tripped"] == 1.0
    assert decision.stop and decision.action == "stop" and [t.key for t in decision.trips] == ["tim/cause/named"]
    assert [c.code for c in named] == ["staleness"]
    assert named[0].evidence["staleness_k3"] == got["tim/split/reused_staleness_kl_k3"]


@pytest.mark.parametrize("lr,port", [(1e-4, 29641), (1e-5, 29642)])
def test_bypass_mode_keys_each_training_pass_by_lag_against_the_rollout(toy_model_path, lr, port):
    """verl's bypass mode (``algorithm.rollout_correction.bypass_mode``: old_log_probs are the rollout's, no
    old-log-prob pass): the monitor measures the update's first optimizer step in its training forward; every training
    pass is keyed by its lag against the rollout (lag 0: that first step, the tokens the monitor measured; lag 1: the
    same batch after one update), with no exact split (π_old is the rollout). The staleness cause reads the lags, as
    for an asynchronous trainer (``CauseTracker._lag_staleness_causes``: the stale tokens' k3 less the lag-0 floor),
    recomputed here from verl's own tensors: named at lr 1e-4 (k3 0.17 here), not at 1e-5 (0.0035: ordinary PPO
    reuse)."""
    from tim_plugins.causes import CauseConfig

    H.init_dist(port=port)
    engine = H.build_engine(toy_model_path, lr=lr)
    td, raw = H.make_batch(VOCAB, response=6, seed=7)
    # the actor's own log-probs of these tokens, before tim is configured (bypass mode runs no such pass)
    trained = H.old_log_probs_padded(H.infer(engine, td), td)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}), bypass_mode=True)
    noise = 1e-4 * torch.randn(trained.shape, generator=torch.Generator().manual_seed(1))
    rollout = (trained + noise).to(raw["rollout_log_probs"].dtype)
    td["rollout_log_probs"] = H.response_nested(rollout, td) if td["response_mask"].is_nested else rollout
    calls: list = []
    _train(engine, td, rollout, _recording_loss(calls), passes=2)  # verl's bypass: old_log_probs := the rollout's
    got = engine.tim_pop_metrics()

    # two micro-batches per optimizer step: calls 0-1 at lag 0, 2-3 at lag 1; the log-ratio against the rollout
    assert len(calls) == 4
    d = [(current - roll)[mask] for current, _, roll, mask in calls]
    d0, d1 = torch.cat(d[:2]), torch.cat(d[2:])
    _assert_by_lag(got, {0: d[:2], 1: d[2:]})
    assert got["tim/by_lag/1/mean"] == pytest.approx(float(d1.mean()), rel=1e-6)
    # the monitor measured the first pass: the lag-0 tokens
    assert got["tim/tokens"] == d0.numel() == int(raw["response_mask"].sum())
    assert got["tim/token/kl_k3"] == pytest.approx(_k3(d0), rel=1e-6)
    assert not [k for k in got if k.startswith(("tim/staleness/", "tim/split/"))]
    # the lag rule, recomputed: the stale tokens' k3 less the lag-0 floor, against CauseConfig's thresholds
    config = CauseConfig()
    part = _k3(d1) - _k3(d0)
    expect = part > config.staleness_k3 and part >= config.staleness_share * _k3(d1)
    assert expect == (lr == 1e-4), (lr, part, _k3(d1))  # the two learning rates fall on either side of the rule
    named = [c.code for c in engine._tim_pipeline.causes.named]
    assert named == (["staleness"] if expect else []), named
    assert got["tim/cause/named"] == float(expect)
    if expect:
        assert engine._tim_pipeline.causes.named[0].evidence["staleness_k3"] == pytest.approx(part, rel=1e-6)


class _WorkerGroup:
    """What the driver calls: verl's ONE_TO_ALL answer, one result per rank, here of one real engine."""

    def __init__(self, engine):
        self.engine = engine

    def tim_pop_metrics(self):
        return [self.engine.tim_report()]


def test_the_step_a_staleness_cause_trips_the_probe_still_logs_its_threshold_check(toy_model_path):
    """The driver collects the actor's metrics twice a step, after the old-log-prob pass (the window: the thresholds
    checked) and after the update (the staleness rule, whose cause trips the probe there without a threshold check:
    ``ParityProbe.check_causes``), and logs both in one row. That row keeps what the step's threshold check was: the
    probe is due at every step (``every_n_steps=1``), so ``tim/probe/checked`` is 1 beside the trip."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    from tim_plugins.parity.probe import ParityProbe

    H.init_dist(port=29594)
    engine = H.build_engine(toy_model_path, lr=1e-4)
    tim = TIMVerlConfig.from_node({"monitor": {"enable": True}, "probe": {"kl_k3": 1e9, "action": "warn"}})
    engine.tim_configure(tim)
    td, raw = H.make_batch(VOCAB, response=6, seed=7)
    engine.tim_begin_step(1)
    trained = H.old_log_probs_padded(H.infer(engine, td), td)
    engine.tim_pop_metrics(), engine.tim_pop_decision()
    noise = 1e-4 * torch.randn(trained.shape, generator=torch.Generator().manual_seed(1))
    rollout = (trained + noise).to(raw["rollout_log_probs"].dtype)
    td["rollout_log_probs"] = H.response_nested(rollout, td) if td["response_mask"].is_nested else rollout

    trainer = object.__new__(get_trainer_cls("tim_sync"))
    trainer.tim, trainer._tim_stop, trainer.actor_rollout_wg = tim, None, _WorkerGroup(engine)
    trainer.global_steps, trainer.total_training_steps = 2, 10
    engine.tim_begin_step(2)
    logged: dict = {}
    old = H.old_log_probs_padded(H.infer(engine, td), td)
    trainer._tim_collect(logged)  # after verl's _compute_old_log_prob
    assert logged["tim/probe/checked"] == 1.0 and logged["tim/probe/tripped"] == 0.0
    _train(engine, td, old, _recording_loss([]), passes=2)
    trainer._tim_collect(logged)  # after verl's _update_actor
    assert logged["tim/cause/named"] == 1.0 and logged["tim/probe/tripped"] == 1.0  # the staleness cause
    assert ParityProbe(tim.probe.config()).due(2)
    assert logged["tim/probe/checked"] == 1.0


def _with_interior_env(raw: dict, segments: dict[int, list[tuple[int, int]]]):
    """The batch with tool / user message tokens inside responses (response_mask 0 between the model's turns, as
    verl's multi-turn agent loop writes them), in the layout make_batch hands the engine."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    tensors = {k: v.clone() for k, v in raw.items()}
    for row, spans in segments.items():
        for lo, hi in spans:
            tensors["response_mask"][row, lo:hi] = 0
    td = left_right_2_no_padding(DataProto.from_single_dict(tensors).to_tensordict())
    tu.assign_non_tensor(td, temperature=1.0)
    return td, tensors


@pytest.mark.parametrize("multi_turn", [True, False])
def test_mismatch_by_turn_of_multi_turn_responses(toy_model_path, multi_turn):
    """tim/by_turn/<k>: the measured tokens of the model's k-th turn (after k environment messages), against naive
    float64 formulas over verl's own old log-probs; only when the rollout is verl's multi-turn agent loop."""
    H.init_dist(port=29579 if multi_turn else 29580)
    engine = H.build_engine(toy_model_path)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}), multi_turn=multi_turn)
    _, raw = H.make_batch(VOCAB, response=9, seed=41)
    # rows 0 and 1: one environment message inside the response; row 2: two
    td, tensors = _with_interior_env(raw, {0: [(2, 4)], 1: [(1, 2)], 2: [(1, 2), (3, 4)]})
    old = H.old_log_probs_padded(H.infer(engine, td), td)
    got = engine.tim_pop_metrics()
    mask = tensors["response_mask"].bool()
    if not multi_turn:
        assert not any(k.startswith("tim/by_turn/") for k in got)
        return
    turns = turns_naive(mask)
    d = old.double() - tensors["rollout_log_probs"].double()
    want = {}
    for turn in sorted(set(turns[mask].tolist())):
        x = d[mask & (turns == turn)]
        want[turn] = (x.numel(), float((torch.expm1(x) - x).mean()), float(x.abs().max()))
    assert sorted(want) == [0, 1, 2]
    assert {k for k in got if k.startswith("tim/by_turn/") and k.endswith("/count")} == {
        f"tim/by_turn/{t}/count" for t in want}
    for turn, (n, k3, amax) in want.items():
        assert got[f"tim/by_turn/{turn}/count"] == n
        assert got[f"tim/by_turn/{turn}/kl_k3"] == pytest.approx(k3, rel=1e-6)
        assert got[f"tim/by_turn/{turn}/abs_diff_max"] == pytest.approx(amax, rel=1e-6)
    assert sum(n for n, _, _ in want.values()) == got["tim/tokens"]


def test_asynchronous_mode_keys_each_sample_by_the_lag_it_was_drawn_with(toy_model_path):
    """An asynchronous mode (tim_colocate_async): each sample carries the lag its rollout was drawn with (the
    driver's LAG_FIELD, in optimizer steps; -1 unknown). The monitor measures the lag-0 samples only, the training
    passes key every known token by its sample's lag plus the updates since the step began, and there is no exact
    split. Reference: verl's own tensors at each loss call, naive float64 k3 per lag."""
    from tim_plugins.integrations.verl.config import LAG_FIELD

    H.init_dist(port=29581)
    engine = H.build_engine(toy_model_path, lr=1e-2)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}), asynchronous=True)
    td, raw = H.make_batch(VOCAB, response=6, seed=5, rollout_noise=0.05)
    sample_lag = torch.tensor([0, 2, -1, 0])
    td[LAG_FIELD] = sample_lag
    old = H.old_log_probs_padded(H.infer(engine, td), td)
    measured = engine.tim_pop_metrics()
    mask = raw["response_mask"].bool()
    rollout = raw["rollout_log_probs"].double()
    fresh = mask & (sample_lag == 0)[:, None]
    d0 = (old.double() - rollout)[fresh]
    assert measured["tim/tokens"] == d0.numel() > 0
    assert measured["tim/token/kl_k3"] == pytest.approx(_k3(d0), rel=1e-6)
    assert measured["tim/diag/async_lag_unknown"] == int(mask[2].sum())

    calls: list = []
    lags_seen: list = []
    _train(engine, td, old, _recording_lag_loss(calls, lags_seen), passes=2)
    got = engine.tim_pop_metrics()
    assert not any(k.startswith(("tim/split/", "tim/staleness/")) for k in got)
    want: dict[int, list] = {}
    for i, ((current, _, rollout_mb, mask_mb), lag_mb) in enumerate(zip(calls, lags_seen)):
        updates = i // 2  # two micro-batches per optimizer step
        for row in range(current.shape[0]):
            if int(lag_mb[row]) < 0:
                continue
            want.setdefault(int(lag_mb[row]) + updates, []).append((current[row] - rollout_mb[row])[mask_mb[row]])
    assert sorted(want) == [0, 1, 2, 3]
    _assert_by_lag(got, want)
    # lag 0 of the training passes is the measured mismatch: the same tokens, π_θ = π_old before the first update
    assert got["tim/by_lag/0/count"] == measured["tim/tokens"]
    assert got["tim/by_lag/0/kl_k3"] == pytest.approx(measured["tim/token/kl_k3"], rel=1e-3)


def test_separate_async_updates_of_one_global_step_count_the_earlier_ones_in_the_lag(toy_model_path, tmp_path):
    """separate_async with ``parameter_sync_step=2``: two actor updates in one global step, each after its own
    old-log-prob pass (the driver's ``tim_begin_step`` again with the same step, naming the update) and with its own
    scheduler step, before the rollout is synced. A sample of the second update drawn with lag L has seen the first
    update's optimizer step too: keyed L + 1, the first's L. The step's window closes after its last update, over
    both: the first update reports nothing, the second the step's metrics (verl's aggregator keeps a key of the last
    update alone as it is), and the step's dump keeps both updates' measured samples, the second's numbered after
    the first's. Reference: verl's own tensors at each loss call and the batches' tokens, naive float64 k3."""
    from tim_plugins.dump import read_dump
    from tim_plugins.integrations.verl.config import LAG_FIELD

    H.init_dist(port=29582)
    engine = H.build_engine(toy_model_path, lr=1e-2)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True},
                                                  "dump": {"dir": str(tmp_path), "sample_rate": 1.0}}),
                         asynchronous=True)
    want: dict[int, list] = {}  # the training passes' log-ratios by lag, over both updates
    # the lag-0 samples' log-ratios at the old-log-prob pass; their (sequence, position, token id)
    measured, dumped = [], []
    for update, seed in enumerate((5, 6)):
        engine.tim_begin_step(3, update, 2)
        td, raw = H.make_batch(VOCAB, response=6, seed=seed, rollout_noise=0.05)
        td[LAG_FIELD] = torch.tensor([0, 2, 0, 2])
        old = H.old_log_probs_padded(H.infer(engine, td), td)
        fresh = raw["response_mask"].bool() & (td[LAG_FIELD] == 0)[:, None]
        measured.append((old.double() - raw["rollout_log_probs"].double())[fresh])
        dumped += [(4 * update + b, t, int(raw["responses"][b, t])) for b in (0, 2) for t in range(6) if fresh[b, t]]
        calls, lags_seen = [], []
        _train(engine, td, old, _recording_lag_loss(calls, lags_seen), passes=1)
        metrics = engine.tim_pop_metrics()
        for (current, _, rollout, mask), lag in zip(calls, lags_seen):
            for row in range(current.shape[0]):
                want.setdefault(int(lag[row]) + update, []).append((current[row] - rollout[row])[mask[row]])
        if update == 0:
            assert metrics == {}
    assert sorted(want) == [0, 1, 2, 3]
    _assert_by_lag(metrics, want)
    d0 = torch.cat(measured)
    assert metrics["tim/tokens"] == d0.numel()
    assert metrics["tim/token/kl_k3"] == pytest.approx(_k3(d0), rel=1e-6)
    rows = read_dump(tmp_path).to_pylist()
    assert [(r["sequence"], r["position"], r["token_id"]) for r in rows] == dumped
    engine.tim_begin_step(4)  # the next global step: its first update is at lag + 0 again
    td, _ = H.make_batch(VOCAB, response=6, seed=7, rollout_noise=0.05)
    td[LAG_FIELD] = torch.tensor([0, 0, 0, 0])
    old = H.old_log_probs_padded(H.infer(engine, td), td)
    _train(engine, td, old, _recording_loss([]), passes=1)
    assert {k for k in engine.tim_pop_metrics() if k.startswith("tim/by_lag/") and k.endswith("/count")} == {
        "tim/by_lag/0/count"}
