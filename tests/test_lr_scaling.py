"""Scaling an optimizer together with its LR scheduler; the in-step scaling mixin for verl-style optimizers."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from tim_plugins.lr_control import LengthTriggeredLRDecay
from tim_plugins.lr_scaling import (
    APPLIED_SCALE_KEY,
    CONTROLLER_STATE_KEY,
    ControllerCheckpoint,
    ScaledLROptimizerMixin,
    apply_lr_scale,
    get_applied_lr_scale,
    restore_controller_state,
    scaled_optimizer_class,
    store_controller_state,
)

# The mixin on AdamW, as integrations/verl/optim.py builds its classes (there with the controller plumbing on top).
AdamWWithScale = scaled_optimizer_class(torch.optim.AdamW)

BASE_LR = 3e-4
STEPS = 40


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _opt(model, two_groups=True):
    if two_groups:  # second group with its own LR: each group must scale by the same factor
        groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": BASE_LR / 3}]
        return torch.optim.AdamW(groups, lr=BASE_LR)
    return torch.optim.AdamW(model.parameters(), lr=BASE_LR)


def warmup_lambda(step):  # linear warm-up over 10 steps, then linear decay to 0 at STEPS
    if step < 10:
        return (step + 1) / 10
    return max(0.0, (STEPS - step) / (STEPS - 10))


def _lambda_lr(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)


def _hf_cosine(opt):
    transformers = pytest.importorskip("transformers")
    return transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=8, num_training_steps=STEPS)


def _cosine_annealing(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=BASE_LR / 20)


def _sequential(opt):
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=8)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 8, eta_min=BASE_LR / 50)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[8])


def _step(opt, sched):
    opt.step()  # no grads: params untouched, keeps the scheduler's "step before scheduler" check quiet
    sched.step()


@pytest.mark.parametrize("make_sched", [_lambda_lr, _hf_cosine, _cosine_annealing, _sequential],
                         ids=["LambdaLR-warmup", "hf-cosine-warmup", "CosineAnnealingLR-eta_min", "SequentialLR"])
@pytest.mark.parametrize("k", [0, 5, 17])
def test_scaled_schedule_is_scale_times_unscaled(make_sched, k):
    s = 0.37
    ref_opt = _opt(_model())
    ref = make_sched(ref_opt)
    opt = _opt(_model())
    sched = make_sched(opt)
    for _ in range(k):
        _step(ref_opt, ref)
        _step(opt, sched)
    apply_lr_scale(opt, s, sched)
    # immediately in force, and what trainers log (get_last_lr) shows it
    for g, rg in zip(opt.param_groups, ref_opt.param_groups):
        assert g["lr"] == pytest.approx(s * rg["lr"], rel=1e-12)
    assert sched.get_last_lr() == pytest.approx([s * v for v in ref.get_last_lr()], rel=1e-12)
    for _ in range(k, STEPS):
        _step(ref_opt, ref)
        _step(opt, sched)
        for g, rg in zip(opt.param_groups, ref_opt.param_groups):
            assert g["lr"] == pytest.approx(s * rg["lr"], rel=1e-9, abs=1e-18)


def test_greedy_lr_keeps_the_scale_through_its_reset():
    """transformers' GreedyLR (``lr_scheduler_type="greedy"``) multiplies the groups' LR by its metric and, after
    ``reset_start`` steps at its floor, sets them back to the LRs it was built with: scaled, the whole trajectory is
    the scale times an unscaled twin's, the reset included."""
    optimization = pytest.importorskip("transformers.optimization")
    if not hasattr(optimization, "GreedyLR"):
        pytest.skip("this transformers has no GreedyLR")

    def make():
        opt = _opt(_model())
        return opt, optimization.GreedyLR(opt, factor=0.5, patience=0, min_lr=BASE_LR / 40, max_lr=1.0,
                                          reset_start=2)

    (ref_opt, ref), (opt, sched) = make(), make()
    apply_lr_scale(opt, 0.5, sched)
    resets = 0
    for t in range(12):  # a loss that only worsens: halved each step down to the floor, then reset
        before = ref_opt.param_groups[0]["lr"]
        ref.step(1.0 + t)
        sched.step(1.0 + t)
        resets += ref_opt.param_groups[0]["lr"] > before
        for g, rg in zip(opt.param_groups, ref_opt.param_groups):
            assert g["lr"] == pytest.approx(0.5 * rg["lr"], rel=1e-12), t
    assert resets >= 1  # the twin went through a reset to its initial LRs


def test_accelerate_wrapped_optimizer_and_scheduler():
    """What a transformers/TRL callback receives after accelerator.prepare: wrappers around both."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    ref_opt = _opt(_model())
    ref = _lambda_lr(ref_opt)
    raw_opt = _opt(_model())
    opt, sched = acc.prepare(raw_opt, _lambda_lr(raw_opt))
    assert type(sched).__name__ == "AcceleratedScheduler"
    for _ in range(4):
        _step(ref_opt, ref)
        _step(opt, sched)
    apply_lr_scale(opt, 0.5, sched)
    assert sched.get_last_lr() == pytest.approx([0.5 * v for v in ref.get_last_lr()], rel=1e-12)
    for _ in range(10):
        _step(ref_opt, ref)
        _step(opt, sched)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(
            [0.5 * g["lr"] for g in ref_opt.param_groups], rel=1e-12)


def test_idempotent_and_relative_to_applied_scale():
    ref_opt = _opt(_model())
    ref = _lambda_lr(ref_opt)
    opt = _opt(_model())
    sched = _lambda_lr(opt)
    for _ in range(12):
        _step(ref_opt, ref)
        _step(opt, sched)
    assert apply_lr_scale(opt, 0.5, sched) == 0.5
    before = ([g["lr"] for g in opt.param_groups], list(sched.base_lrs))
    assert apply_lr_scale(opt, 0.5, sched) == 1.0  # same scale again: nothing changes
    assert ([g["lr"] for g in opt.param_groups], list(sched.base_lrs)) == before
    assert apply_lr_scale(opt, 0.25, sched) == 0.5  # total 0.25, not 0.125
    assert get_applied_lr_scale(opt) == 0.25
    assert sched.base_lrs == pytest.approx([0.25 * b for b in ref.base_lrs], rel=1e-15)
    apply_lr_scale(opt, 1.0, sched)  # back to the schedule
    _step(ref_opt, ref)
    _step(opt, sched)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([g["lr"] for g in ref_opt.param_groups], rel=1e-15)
    with pytest.raises(ValueError, match="scale=0.0"):
        apply_lr_scale(opt, 0.0, sched)
    with pytest.raises(ValueError, match="scale=nan"):
        apply_lr_scale(opt, math.nan, sched)


def test_constant_lr_without_scheduler():
    opt = _opt(_model())
    apply_lr_scale(opt, 0.5)
    apply_lr_scale(opt, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [BASE_LR * 0.5, BASE_LR / 3 * 0.5]


def test_checkpoint_round_trip_keeps_applied_scale():
    opt = _opt(_model())
    sched = _lambda_lr(opt)
    for _ in range(6):
        _step(opt, sched)
    apply_lr_scale(opt, 0.5, sched)
    _step(opt, sched)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    opt2 = _opt(_model())
    sched2 = _lambda_lr(opt2)
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    assert get_applied_lr_scale(opt2) == 0.5
    assert apply_lr_scale(opt2, 0.5, sched2) == 1.0  # a resumed run re-applying the same scale: no-op
    for _ in range(10):
        _step(opt, sched)
        _step(opt2, sched2)
        assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    assert all(g[APPLIED_SCALE_KEY] == 0.5 for g in opt2.param_groups)


def _grad_steps(opt, sched, model, n, lr_hook=None):
    torch.manual_seed(123)
    x = torch.randn(16, 7)
    y = torch.randn(16, 3)
    for t in range(n):
        if lr_hook:
            lr_hook(t)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        sched.step()


class _NoScheduler:
    def step(self):
        pass


def test_mixin_scales_inside_step_only():
    s, k, n = 0.25, 7, 25
    model, ref_model = _model(), _model()
    opt = AdamWWithScale(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    sched = _lambda_lr(opt)
    logged = []

    def set_scale(t):
        if t == k:
            opt.set_lr_scale(s)
        logged.append(sched.get_last_lr()[0])

    # Reference: plain AdamW, no scheduler, LR written by hand as schedule × scale before each step.
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=BASE_LR, weight_decay=0.01)
    plain = []

    def manual(t):
        lr = BASE_LR * warmup_lambda(t)
        ref_opt.param_groups[0]["lr"] = lr * s if t >= k else lr
        plain.append(lr)

    _grad_steps(opt, sched, model, n, set_scale)
    _grad_steps(ref_opt, _NoScheduler(), ref_model, n, manual)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)  # bit-identical: same LR float, same update
    assert logged == plain  # the scheduler never saw the scaled LR
    assert opt.lr_scale == s
    sd = opt.state_dict()
    opt2 = AdamWWithScale(_model().parameters(), lr=BASE_LR)
    assert opt2.lr_scale == 1.0
    opt2.load_state_dict(copy.deepcopy(sd))
    assert opt2.lr_scale == s


def test_mixin_tensor_lr_and_class_factory():
    s = 0.5
    m1, m2 = _model(), _model()
    o1 = scaled_optimizer_class(torch.optim.SGD)(m1.parameters(), lr=torch.tensor(0.1), momentum=0.9, lr_scale=s)
    o2 = torch.optim.SGD(m2.parameters(), lr=torch.tensor(0.1 * s), momentum=0.9)
    lr_obj = o1.param_groups[0]["lr"]
    for o, m in ((o1, m1), (o2, m2)):
        _grad_steps(o, torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0), m, 5)
    assert o1.param_groups[0]["lr"] is lr_obj and float(lr_obj) == pytest.approx(0.1)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert scaled_optimizer_class(torch.optim.SGD) is type(o1)
    assert type(o1).__name__ == "ScaledSGD" and isinstance(o1, ScaledLROptimizerMixin)
    with pytest.raises(TypeError):
        scaled_optimizer_class(dict)
    with pytest.raises(ValueError, match="lr_scale"):
        AdamWWithScale(_model().parameters(), lr=1e-3, lr_scale=-1.0)


def test_controller_state_rides_in_optimizer_checkpoint():
    ctrl = LengthTriggeredLRDecay(warmup_steps=3, window=1, patience=1)
    for i, x in enumerate([100.0, 100.0, 100.0, 300.0]):
        ctrl.observe(i, x)
    assert ctrl.scale == 0.5
    opt = AdamWWithScale(_model().parameters(), lr=1e-3)
    opt.set_lr_scale(ctrl.scale)
    store_controller_state(opt, ctrl)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt2 = AdamWWithScale(_model().parameters(), lr=1e-3)
    fresh = LengthTriggeredLRDecay(warmup_steps=3, window=1, patience=1)
    assert restore_controller_state(opt2, fresh) is False
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    assert restore_controller_state(opt2, fresh) is True
    assert fresh.state_dict() == ctrl.state_dict() and opt2.lr_scale == 0.5


def test_controller_checkpoint_keeps_the_live_controller_and_the_stored_state_in_step():
    """ControllerCheckpoint's rule against a reference controller fed the same lengths: attach continues from a
    state loaded before, store writes each decision, sync continues from a checkpoint loaded since (a real torch
    save/load), and never rereads its own store (the controller would be set back)."""
    def ctrl():
        return LengthTriggeredLRDecay(warmup_steps=3, window=1, patience=1)

    lengths = [100.0, 100.0, 100.0, 300.0, 300.0, 300.0]
    reference = ctrl()
    for i, x in enumerate(lengths):
        reference.observe(i, x)

    opt = AdamWWithScale(_model().parameters(), lr=1e-3)
    live = ControllerCheckpoint(opt, ctrl())  # a fresh run: nothing stored, nothing restored
    for i, x in enumerate(lengths[:4]):
        live.sync()
        live.controller.observe(i, x)
        live.store()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # the checkpoint after 4 steps
    for i, x in enumerate(lengths[4:], start=4):
        live.sync()  # its own store: not reread (it would set the controller back to what it already holds)
        live.controller.observe(i, x)
        live.store()
    assert live.controller.state_dict() == reference.state_dict()
    assert opt.param_groups[0][CONTROLLER_STATE_KEY] == reference.state_dict()

    # the run goes on from the 4-step checkpoint, loaded after the controller was attached (verl's load path)
    buf.seek(0)
    live.optimizer.load_state_dict(torch.load(buf, weights_only=False))
    live.sync()
    after_four = ctrl()
    for i, x in enumerate(lengths[:4]):
        after_four.observe(i, x)
    assert live.controller.state_dict() == after_four.state_dict()
    # and a controller attached after the load (a resumed worker) starts from it as well
    buf.seek(0)
    resumed = AdamWWithScale(_model().parameters(), lr=1e-3)
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    assert ControllerCheckpoint(resumed, ctrl()).controller.state_dict() == after_four.state_dict()
    # detached: the stored state stays for a later attach, and nothing is written or read
    live.detach()
    live.store()
    live.sync()
    assert resumed.param_groups[0][CONTROLLER_STATE_KEY] == after_four.state_dict()
