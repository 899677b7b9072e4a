"""verl's bypass mode (``algorithm.rollout_correction.bypass_mode``) through verl 0.9.1's real Megatron engine on CPU
(TP1, gloo, in this process): verl copies the rollout's log-probs into ``old_log_probs`` and runs no old-log-prob
pass. The engine measures the rollout against the training forward of the update's first optimizer step
(``_tim_measuring``: ``tim/token/*``, ``tim/tokens``) and keys every training pass by its policy lag against the
rollout (``tim/by_lag/<optimizer steps since the rollout>/*``), with no exact split (π_old is the rollout itself).
The Megatron twin of ``tests/verl_suite/test_verl_staleness.py::
test_bypass_mode_keys_each_training_pass_by_lag_against_the_rollout``: the same mixin, reached through Megatron's
``postprocess_micro_batch_func`` and pipeline schedule instead of FSDP's micro-batch loop.

Reference, independent of tim's accumulators: verl's own tensors at each loss call (the log-probs Megatron hands
verl's ``ppo_loss``, the micro-batch's ``rollout_log_probs`` and response mask), recorded by a loss function that
wraps verl's, and naive float64 formulas in the test.
"""

from __future__ import annotations


import pytest

import harness as H
import torch

PORT = 29851  # this file's process group when it runs alone (the suite's other in-process tests use 29611)
NOISE = 1e-4  # the rollout's log-probs: the actor's own plus this much Gaussian noise (a trainer-grade match)


@pytest.fixture(scope="module")
def rank():
    """torch.distributed in this process (world size 1, gloo): Megatron's parallel state here is TP1. Where the
    suite's ``one_rank`` fixture already set it up, that one is reused (one process group per process)."""
    H.init_dist(port=PORT)
    yield


def _recording_loss(calls: list):
    """verl's ppo_loss (Megatron's actor config) under Megatron's loss-call signature, recording each call's
    (current, old, rollout, mask) response-aligned, in float64: what verl's loss was handed."""
    from verl.workers.config import McoreActorConfig

    return H.recording_ppo_loss(McoreActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=H.MICRO,
                                                 ppo_mini_batch_size=4, use_dynamic_bsz=False), calls)


def _train(engine, td, old, loss_fn, *, passes: int) -> list:
    """``passes`` optimizer steps on the same batch (as ``ppo_epochs`` or mini-batches do), then the scheduler step
    that ends verl's global step, with the suite's pass settings (``harness.train_step``'s, one mini-batch each);
    verl's per-call outputs."""
    from verl.utils import tensordict_utils as tu

    td = td.copy()
    td["old_log_probs"] = old
    H._pass_settings(td, engine, calculate_entropy=False, global_batch_size=td.batch_size[0])
    tu.assign_non_tensor(td, update_lr_scheduler=True)
    outs = []
    with engine.train_mode():
        for _ in range(passes):
            outs.append(engine.train_batch(td, loss_function=loss_fn))
        engine.lr_scheduler_step()
    return outs


def _k3(d: torch.Tensor) -> float:
    return float((torch.expm1(d) - d).mean())


def _nested(values: torch.Tensor, td) -> torch.Tensor:
    """[B, R] response values in the batch's own response layout (ragged rows in verl's V1 layout)."""
    return H._FSDP_HARNESS.response_nested(values, td) if td["response_mask"].is_nested else values


# the learning rates fall on either side of the staleness rule (asserted below, from the recomputed rule): the
# stale tokens' k3 is ~0.50 at 1e-3 (the suite's LR), ~0.008 at 2e-4 (ordinary PPO reuse, under staleness_k3 0.015)
@pytest.mark.parametrize("lr,named", [(1e-3, True), (2e-4, False)])
def test_bypass_mode_keys_each_training_pass_by_lag_against_the_rollout_tp1(rank, tiny_qwen2, lr, named):
    """Bypass mode in the Megatron engine, TP1: two optimizer steps on a rollout 1e-4 nats from the actor (its own
    log-probs, computed before tim is configured, so no measurement pass runs), ``old_log_probs`` := the rollout's.
    ``tim/by_lag/0`` is the first step's micro-batches, ``tim/by_lag/1`` the second's, each token count and k3
    equal to naive float64 over verl's loss-call tensors; the monitor measured the first step (``tim/tokens``,
    ``tim/token/kl_k3`` = lag 0's); no ``tim/split/*`` or ``tim/staleness/*``. The staleness cause follows the lag
    rule (``CauseTracker._lag_staleness_causes``) recomputed here against ``CauseConfig``: named at lr 1e-3 (the
    second pass moved well past ordinary PPO reuse), not at 2e-4 (ordinary reuse)."""
    from tim_plugins.causes import CauseConfig
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    engine = H.build_engine(tiny_qwen2, lr=lr)
    td, raw = H.make_batch(H.VOCAB, batch=4, seed=7)
    # the actor's own log-probs of these tokens, before tim is configured (bypass mode runs no such pass)
    trained = H.old_log_probs_padded(H.infer(engine, td), td)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}), bypass_mode=True)
    try:
        noise = NOISE * torch.randn(trained.shape, generator=torch.Generator().manual_seed(1))
        rollout = (trained + noise).to(raw["rollout_log_probs"].dtype)
        td["rollout_log_probs"] = _nested(rollout, td)
        calls: list = []
        # verl's bypass: old_log_probs := the rollout's
        _train(engine, td, _nested(rollout, td), _recording_loss(calls), passes=2)
        got = engine.tim_pop_metrics()
        causes = list(engine._tim_pipeline.causes.named)
    finally:
        engine.tim_deconfigure()

    # two micro-batches per optimizer step (micro_batch_size_per_gpu=2, 4 rows): calls 0-1 at lag 0, 2-3 at lag 1
    assert len(calls) == 4
    for _, old_mb, roll_mb, mask in calls:  # verl's bypass as the loss saw it
        assert torch.equal(old_mb[mask], roll_mb[mask])
    d = [(current - roll)[mask] for current, _, roll, mask in calls]
    d0, d1 = torch.cat(d[:2]), torch.cat(d[2:])
    n = int(raw["response_mask"].sum())
    assert d0.numel() == d1.numel() == n
    assert {k for k in got if k.startswith("tim/by_lag/") and k.endswith("/count")} == {
        "tim/by_lag/0/count", "tim/by_lag/1/count"}
    assert got["tim/by_lag/0/count"] == got["tim/by_lag/1/count"] == n
    assert got["tim/by_lag/0/kl_k3"] == pytest.approx(_k3(d0), rel=1e-6)
    assert got["tim/by_lag/1/kl_k3"] == pytest.approx(_k3(d1), rel=1e-6)
    assert got["tim/by_lag/0/mean"] == pytest.approx(float(d0.mean()), rel=1e-6)
    assert got["tim/by_lag/1/mean"] == pytest.approx(float(d1.mean()), rel=1e-6)
    # lag 0 is the rollout against the weights that drew it (the first step's forward, before its update): the
    # injected noise alone, as against the log-probs computed before tim_configure; lag 1 moved
    mask = raw["response_mask"].bool()
    assert _k3(d0) == pytest.approx(_k3((trained.double() - rollout.double())[mask]), rel=1e-6)
    assert _k3(d0) < 1e-6 < _k3(d1)
    # the monitor measured the first optimizer step's forward: the lag-0 tokens
    assert got["tim/tokens"] == n
    assert got["tim/token/kl_k3"] == pytest.approx(_k3(d0), rel=1e-6)
    assert not [k for k in got if k.startswith(("tim/staleness/", "tim/split/"))]
    # the lag rule, recomputed: the stale tokens' k3 less the lag-0 floor, against CauseConfig's thresholds
    config = CauseConfig()
    part = _k3(d1) - _k3(d0)
    expect = part > config.staleness_k3 and part >= config.staleness_share * _k3(d1)
    assert expect == named, (lr, part, _k3(d1))  # the two learning rates fall on either side of the rule
    assert [c.code for c in causes] == (["staleness"] if expect else []), causes
    assert got["tim/cause/named"] == float(expect)
    if expect:
        assert causes[0].evidence["staleness_k3"] == pytest.approx(part, rel=1e-6)
