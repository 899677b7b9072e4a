"""LR decay through verl's own optimizer builder (optim.optimizer_impl / optim.optimizer), its LambdaLR scheduler
and FSDPCheckpointManager: the decay fires on a response-length surge, shows in the returned (logged) LR, and
survives checkpoint save → load."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import harness as H  # noqa: E402
import torch  # noqa: E402

from tim_plugins.integrations.verl.config import OPTIMIZER_IMPL, TIMVerlConfig  # noqa: E402

VOCAB = 383
LR = 1e-3
OPTIONS = {"warmup_steps": 2, "window": 1, "patience": 1, "margin": 0.25, "cooldown": 0,
           "decay_factor": 0.5, "min_lr_ratio": 0.1, "baseline_ema": 0.01}


def test_lr_decay_through_verl_optimizer_and_checkpoint(toy_model_path, tmp_path):
    H.init_dist(port=29572)
    eng = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    assert type(eng.optimizer).__module__ == OPTIMIZER_IMPL
    eng.tim_configure(TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": OPTIONS}}))
    short, _ = H.make_batch(VOCAB, response=4, seed=2)
    long, raw_long = H.make_batch(VOCAB, response=12, seed=3)
    lrs = []
    for td in (short, short, long):
        old = H.old_log_probs_padded(H.infer(eng, td), td)
        _, lr = H.train_step(eng, td, old)
        lrs.append(lr)
    # the third step's mean response length is far above the 2-step baseline: one trigger, scale 0.5
    assert eng.optimizer.lr_scale == 0.5
    assert lrs == [LR, LR, LR * 0.5]  # verl's logged actor/lr is the effective LR
    # the LambdaLR still holds the unscaled schedule (it would overwrite an outside write)
    assert eng.lr_scheduler.get_last_lr()[0] == LR
    metrics = eng.tim_pop_metrics()
    assert metrics["tim/lr/scale"] == 0.5 and metrics["tim/lr/trigger_count"] == 1.0
    # the controller saw the DP-mean response length of the batch
    want_len = raw_long["response_mask"].sum().item() / raw_long["response_mask"].shape[0]
    assert metrics["tim/lr/window_length"] == pytest.approx(want_len)

    ckpt = str(tmp_path / "ckpt")
    eng.save_checkpoint(ckpt, global_step=3)
    state_before = eng.optimizer.tim_controller.state_dict()

    fresh = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    fresh.tim_configure(TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": OPTIONS}}))
    assert fresh.optimizer.lr_scale == 1.0
    fresh.load_checkpoint(ckpt)
    td = short
    old = H.old_log_probs_padded(H.infer(fresh, td), td)
    _, lr_fresh = H.train_step(fresh, td, old)
    _, lr_orig = H.train_step(eng, td, H.old_log_probs_padded(H.infer(eng, td), td))
    assert fresh.optimizer.tim_controller.state_dict()["scale"] == 0.5 or fresh.optimizer.lr_scale == 0.5
    assert lr_fresh == lr_orig  # same observation after resume → same LR as the uninterrupted run
    assert fresh.optimizer.tim_controller.state_dict() == eng.optimizer.tim_controller.state_dict()
    assert state_before != eng.optimizer.tim_controller.state_dict()  # it did move on by one observation
