"""LR decay through verl's Megatron optimizer (a ChainedOptimizer of distributed optimizers) and its
OptimizerParamScheduler, TP1 in this process and TP2 and PP2 in two (``ranks.py``): the decay fires at the step the
core controller predicts from the same response lengths, shows in the LR ``lr_scheduler_step`` returns (verl's
actor/lr) and in every param group, is the same on the rank that measures and the ones that do not (the other
tensor-parallel rank; the pipeline stage before the last, which has no outputs at all), and survives verl's
Megatron checkpoint save and load, with the cause tracker's state beside it."""

from __future__ import annotations

import pytest

import scenarios
from tim_plugins.lr_control import LengthTriggeredLRDecay


def _reference(lengths):
    """The core controller fed the same lengths outside verl (the scale of step k applies to step k)."""
    reference = LengthTriggeredLRDecay(**scenarios.LR_OPTIONS)
    return reference, [reference.observe(None, n) for n in lengths]


def _assert_run(run):
    reference, want = _reference(run["lengths"])
    assert want == [1.0, 1.0, 0.5]  # the third step's length is far above the two-step baseline: one trigger
    assert run["lrs"] == [scenarios.LR * s for s in want]  # verl's logged actor/lr is the effective LR
    assert run["state"] == reference.state_dict()
    # after the scheduler's step the groups hold its LR again; the next step's end rewrites them
    assert run["group_lrs"] == [scenarios.LR, scenarios.LR]
    # tim_deconfigure(): verl's own LR, unscaled, in the returned value and in every group
    assert run["stock_lr"] == scenarios.LR and run["stock_group_lrs"] == [scenarios.LR, scenarios.LR]
    return reference


def test_lr_decay_fires_when_the_replay_says_and_survives_the_checkpoint_tp1(one_rank, tiny_qwen2, tmp_path):
    run = scenarios.lr_decay(tiny_qwen2, tp=1, ckpt_dir=str(tmp_path / "ckpt" / "global_step_3"))
    reference = _assert_run(run)
    metrics = run["metrics"]
    assert metrics["tim/lr/scale"] == 0.5 and metrics["tim/lr/trigger_count"] == 1.0
    assert metrics["tim/lr/window_length"] == pytest.approx(run["lengths"][-1])
    # verl's Megatron checkpoint carried the controller's state (the optimizer's param groups)
    assert run["loaded_state"] == run["state"]
    after = reference.observe(None, run["lengths"][0])  # the reference's fourth observation
    assert run["after_lrs"] == [scenarios.LR * after] * 2  # resumed and uninterrupted: the same LR
    assert run["after_states"][0] == run["after_states"][1] == reference.state_dict()
    # and the cause tracker's (the monitor on): the fresh engine judged its step against the three windows before
    # the checkpoint, as the engine that went on did
    saved = run["causes_state"]
    assert len(saved["floor"]) == 3 and run["loaded_causes"] == saved
    resumed, went_on = run["after_causes"]
    assert len(went_on["floor"]) == 4 and went_on["floor"][:3] == saved["floor"]
    assert resumed["floor"] == pytest.approx(went_on["floor"], rel=1e-6) and resumed["tally"] == went_on["tally"]


def test_lr_decay_is_the_same_on_every_tensor_parallel_rank(two_ranks):
    src, other = (two_ranks[r]["tp2_lr"] for r in (0, 1))
    assert src["holds"] and not other["holds"]
    _assert_run(src)
    _assert_run(other)  # the rank without outputs steps with the holder's scale and holds its state
    assert src["metrics"]["tim/lr/scale"] == 0.5 and other["metrics"] == {}


def test_lr_decay_is_the_same_on_every_pipeline_stage(two_ranks):
    """PP2 with the grad norm as an extra signal (``combine="any"``: the length still fires): verl reports the grad
    norm on the last stage only, and the first stage's layers step with the last stage's scale and its controller
    holds the last stage's state, grad norms included; both survive verl's Megatron checkpoint, with the cause
    tracker's state on the last stage."""
    first, last = (two_ranks[r]["pp2_lr"] for r in (0, 1))
    assert last["holds"] and not first["holds"]
    assert first["grad_norms"] == [None] * 3 and all(g > 0 for g in last["grad_norms"])
    reference = LengthTriggeredLRDecay(**scenarios.LR_OPTIONS, signals=("grad_norm",))
    # the engine feeds each step the grad norm of the step before (none before the first)
    want = [reference.observe(None, n, grad_norm=g) for n, g in zip(last["lengths"], [None, *last["grad_norms"][:-1]])]
    assert want == [1.0, 1.0, 0.5]
    for run in (first, last):
        assert run["lrs"] == [scenarios.LR * s for s in want]
        assert run["group_lrs"] == [scenarios.LR, scenarios.LR] and run["stock_lr"] == scenarios.LR
        assert run["state"] == reference.state_dict()
    assert reference.state_dict()["trackers"]["grad_norm"] != LengthTriggeredLRDecay(
        **scenarios.LR_OPTIONS, signals=("grad_norm",)).state_dict()["trackers"]["grad_norm"]  # it saw grad norms
    assert last["metrics"]["tim/lr/scale"] == 0.5 and first["metrics"] == {}
    # verl's Megatron checkpoint, saved and loaded by both stages: each gets its controller state back, and the last
    # stage (the one that measures) its cause tracker's; the first stage's tracker judges nothing and stores none
    # the step after: both engines feed the last step's grad norm (the checkpoint carries it beside the controller)
    after = reference.observe(None, last["lengths"][0], grad_norm=last["grad_norms"][-1])
    for run in (first, last):
        assert run["loaded_state"] == run["state"]
        assert run["loaded_grad_norm"] == pytest.approx(last["grad_norms"][-1], rel=1e-6)
        assert run["after_lrs"] == [scenarios.LR * after] * 2
        assert run["after_states"] == [reference.state_dict()] * 2
    assert first["loaded_causes"] is None and first["causes_state"]["floor"] == []
    assert len(last["causes_state"]["floor"]) == 3 and last["loaded_causes"] == last["causes_state"]
    resumed, went_on = last["after_causes"]
    assert went_on["floor"][:3] == last["causes_state"]["floor"] and len(went_on["floor"]) == 4
    assert resumed["floor"] == pytest.approx(went_on["floor"], rel=1e-6)
