"""LR scaling with several param groups, one of them added mid-run (``optimizer.add_param_group``), against a naive
reference: every group runs at scale × the LR it would have without scaling (a twin optimizer, never scaled, with
the same groups and schedule gives that LR)."""

from __future__ import annotations

import pytest
import torch

from tim_plugins.lr_scaling import (
    APPLIED_SCALE_KEY,
    LR_SCALE_KEY,
    apply_lr_scale,
    get_applied_lr_scale,
    scaled_optimizer_class,
)

SCALES = [1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 0.125]


def _params(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2)) for _ in range(n)]


def _pair(lrs: list[float], with_scheduler: bool):
    """Two identical SGD optimizers (and LambdaLR schedulers): the one to scale, and the unscaled twin."""
    out = []
    for _ in range(2):
        opt = torch.optim.SGD([{"params": _params(1), "lr": lr} for lr in lrs], lr=lrs[0])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t)) if with_scheduler else None
        out.append((opt, sched))
    return out


@pytest.mark.parametrize("with_scheduler", [False, True], ids=["constant", "lambda_lr"])
def test_every_group_runs_at_scale_times_its_unscaled_lr(with_scheduler):
    (opt, sched), (twin, twin_sched) = _pair([1e-3, 3e-3], with_scheduler)
    # step -> nominal LR of a group added then (torch's schedulers refuse groups added after them: constant LR only)
    added = {} if with_scheduler else {2: 7e-3, 5: 2e-2}
    for t, scale in enumerate(SCALES):
        if t in added:
            for o in (opt, twin):
                o.add_param_group({"params": _params(1), "lr": added[t]})
        apply_lr_scale(opt, scale, sched)
        want = [scale * g["lr"] for g in twin.param_groups]  # the naive reference
        got = [g["lr"] for g in opt.param_groups]
        assert got == pytest.approx(want, rel=1e-12), (t, scale)
        assert [g.get(APPLIED_SCALE_KEY, 1.0) for g in opt.param_groups] == [scale] * len(want)
        assert get_applied_lr_scale(opt) == scale
        if sched is not None:
            assert sched.get_last_lr() == pytest.approx([scale * v for v in twin_sched.get_last_lr()], rel=1e-12)
            for o, s in ((opt, sched), (twin, twin_sched)):
                o.step()
                s.step()


def test_repeating_the_scale_after_adding_a_group_scales_only_that_group():
    opt = torch.optim.SGD([{"params": _params(1), "lr": 1.0}], lr=1.0)
    assert apply_lr_scale(opt, 0.5) == 0.5
    opt.add_param_group({"params": _params(1), "lr": 2.0})
    assert apply_lr_scale(opt, 0.5) == 1.0  # the first group's ratio: it is at 0.5 already
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1.0]
    assert apply_lr_scale(opt, 0.5) == 1.0
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1.0]


def test_groups_at_different_applied_scales_are_each_brought_to_the_scale():
    # e.g. a group restored from an optimizer checkpoint at one scale next to a group at another
    opt = torch.optim.SGD([{"params": _params(1), "lr": 1.0}, {"params": _params(1), "lr": 0.5}], lr=1.0)
    opt.param_groups[1][APPLIED_SCALE_KEY] = 0.5  # nominal LR 1.0, applied 0.5
    apply_lr_scale(opt, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    apply_lr_scale(opt, 0.2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2, 0.2], rel=1e-12)


def _effective_lr(opt, group: int) -> float:
    """The LR the optimizer's step() applied to ``group`` (SGD, gradient 1, parameter started at 0)."""
    for p in (p for g in opt.param_groups for p in g["params"]):
        p.grad = torch.ones_like(p)
        p.data.zero_()
    opt.step()
    return -float(opt.param_groups[group]["params"][0].detach()[0])


def test_mixin_group_added_mid_run_runs_at_the_scale_in_force():
    cls = scaled_optimizer_class(torch.optim.SGD)
    opt = cls([{"params": _params(1)}, {"params": _params(1), "lr": 0.2}], lr=0.1, lr_scale=0.5)
    assert [g[LR_SCALE_KEY] for g in opt.param_groups] == [0.5, 0.5]
    opt.set_lr_scale(0.25)
    opt.add_param_group({"params": _params(1), "lr": 0.4})
    opt.add_param_group({"params": _params(1), "lr": 0.4, LR_SCALE_KEY: 1.0})  # an explicit scale stays
    assert [g[LR_SCALE_KEY] for g in opt.param_groups] == [0.25, 0.25, 0.25, 1.0]
    want = [0.25 * 0.1, 0.25 * 0.2, 0.25 * 0.4, 1.0 * 0.4]  # naive: scale × the group's LR
    assert [_effective_lr(opt, i) for i in range(4)] == pytest.approx(want, rel=1e-6)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2, 0.4, 0.4]  # restored after step()


def test_mixin_group_added_after_loading_a_checkpoint_takes_the_loaded_scale():
    cls = scaled_optimizer_class(torch.optim.SGD)
    src = cls([{"params": _params(1)}], lr=0.1)
    src.set_lr_scale(0.25)
    opt = cls([{"params": _params(1)}], lr=0.1)  # constructed at scale 1.0, then resumed
    opt.load_state_dict(src.state_dict())
    opt.add_param_group({"params": _params(1), "lr": 0.4})
    assert [g[LR_SCALE_KEY] for g in opt.param_groups] == [0.25, 0.25]
    assert _effective_lr(opt, 1) == pytest.approx(0.25 * 0.4, rel=1e-6)
