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


def _mean_length(raw) -> float:
    """What the engine hands the controller: the batch's mean response length (world size 1: the DP mean)."""
    return raw["response_mask"].sum().item() / raw["response_mask"].shape[0]


def test_lr_decay_through_verl_optimizer_and_checkpoint(toy_model_path, tmp_path):
    from tim_plugins.lr_control import LengthTriggeredLRDecay

    H.init_dist(port=29572)
    eng = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    assert type(eng.optimizer).__module__ == OPTIMIZER_IMPL
    eng.tim_configure(TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": OPTIONS}}))
    short, raw_short = H.make_batch(VOCAB, response=4, seed=2)
    long, raw_long = H.make_batch(VOCAB, response=12, seed=3)
    # Reference: the core controller fed the same lengths, outside verl (the scale of step k applies to step k).
    reference = LengthTriggeredLRDecay(**OPTIONS)
    want = [reference.observe(None, _mean_length(raw)) for raw in (raw_short, raw_short, raw_long)]
    assert want == [1.0, 1.0, 0.5]  # the third step's length is far above the 2-step baseline: one trigger
    lrs = []
    for td in (short, short, long):
        old = H.old_log_probs_padded(H.infer(eng, td), td)
        _, lr = H.train_step(eng, td, old)
        lrs.append(lr)
    assert eng.optimizer.lr_scale == want[-1]
    assert lrs == [LR * s for s in want]  # verl's logged actor/lr is the effective LR
    # the LambdaLR still holds the unscaled schedule (it would overwrite an outside write)
    assert eng.lr_scheduler.get_last_lr()[0] == LR
    metrics = eng.tim_pop_metrics()
    assert metrics["tim/lr/scale"] == 0.5 and metrics["tim/lr/trigger_count"] == 1.0
    # the controller saw the DP-mean response length of the batch
    assert metrics["tim/lr/window_length"] == pytest.approx(_mean_length(raw_long))
    assert eng.optimizer.tim_controller.state_dict() == reference.state_dict()

    ckpt = str(tmp_path / "ckpt")
    eng.save_checkpoint(ckpt, global_step=3)
    state_before = eng.optimizer.tim_controller.state_dict()

    fresh = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    fresh.tim_configure(TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": OPTIONS}}))
    assert fresh.optimizer.lr_scale == 1.0
    fresh.load_checkpoint(ckpt)
    # verl's own load restored both the controller and the scale it applies (before any step)
    assert fresh.optimizer.tim_controller.state_dict() == state_before
    assert fresh.optimizer.lr_scale == 0.5
    td = short
    old = H.old_log_probs_padded(H.infer(fresh, td), td)
    _, lr_fresh = H.train_step(fresh, td, old)
    _, lr_orig = H.train_step(eng, td, H.old_log_probs_padded(H.infer(eng, td), td))
    after = reference.observe(None, _mean_length(raw_short))  # the reference's fourth observation
    assert fresh.optimizer.lr_scale == eng.optimizer.lr_scale == after
    assert lr_fresh == lr_orig == LR * after  # same observation after resume → same LR as the uninterrupted run
    assert fresh.optimizer.tim_controller.state_dict() == eng.optimizer.tim_controller.state_dict() \
        == reference.state_dict()
    assert state_before != eng.optimizer.tim_controller.state_dict()  # it did move on by one observation

    # resumed from it with the LR decay off: verl's own numerics (the checkpoint's scale is not applied by
    # anything); switched on after the load, the controller continues from the checkpoint's state and scale
    off = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    off.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
    off.load_checkpoint(ckpt)
    assert off.optimizer.lr_scale == 1.0 and off.optimizer.tim_controller is None
    _, lr_off = H.train_step(off, td, H.old_log_probs_padded(H.infer(off, td), td))
    assert lr_off == off.lr_scheduler.get_last_lr()[0] == LR
    later = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    later.load_checkpoint(ckpt)
    assert later.optimizer.lr_scale == 1.0
    later.tim_configure(TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": OPTIONS}}))
    assert later.optimizer.lr_scale == 0.5 and later.optimizer.tim_controller.state_dict() == state_before

    # tim_deconfigure(): back to verl's own numerics: the scheduler's LR, unscaled, and no tim metric
    eng.tim_deconfigure()
    assert not eng.tim_active and eng.optimizer.lr_scale == 1.0
    _, lr_stock = H.train_step(eng, td, H.old_log_probs_padded(H.infer(eng, td), td))
    assert lr_stock == eng.lr_scheduler.get_last_lr()[0] == LR
    assert eng.tim_pop_metrics() == {}


def _flat(x, prefix="") -> dict:
    if isinstance(x, dict):
        return {k: v for key, value in x.items() for k, v in _flat(value, f"{prefix}/{key}").items()}
    if isinstance(x, (list, tuple)):
        return {k: v for i, value in enumerate(x) for k, v in _flat(value, f"{prefix}/{i}").items()}
    return {prefix: x}


def _assert_same_state(controller, reference) -> None:
    """The engine's controller state is the reference's: exact but for floats (the monitor's float32 k3 against a
    float64 reference: 1e-6 relative)."""
    got, ref = _flat(controller.state_dict()), _flat(reference.state_dict())
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        same = got[key] == value if isinstance(value, (str, bool, type(None))) else got[key] == pytest.approx(
            value, rel=1e-6)
        assert same, (key, got[key], value)


def _naive_k3(old_padded, raw) -> float:
    """k3 of the rollout log-probs vs the actor's recomputation over the response tokens, by its definition."""
    m = raw["response_mask"].bool()
    d = (old_padded.double() - raw["rollout_log_probs"].double())[m]
    return float((torch.expm1(d) - d).mean())


def test_verls_padding_samples_are_not_responses_to_the_length_signal(toy_model_path):
    """verl pads a batch to a multiple of the DP size with synthetic samples whose response mask is all zero: the
    length signal is the mean over the real responses. Reference: the core controller fed the mean over the rows
    with a response token, outside verl; the rows themselves train as verl trains them (their loss weight is 0)."""
    from tim_plugins.lr_control import LengthTriggeredLRDecay

    H.init_dist(port=29575)
    eng = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    eng.tim_configure(TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": OPTIONS}}))
    reference = LengthTriggeredLRDecay(**OPTIONS)
    wants = []
    for seed, response in ((2, 4), (3, 4), (4, 12)):
        td, raw = H.make_batch(VOCAB, batch=6, response=response, seed=seed, padding_samples=2)
        real = raw["response_mask"][:4]
        assert raw["response_mask"][4:].sum() == 0 and (real.sum(1) > 0).all()
        want = reference.observe(None, real.sum().item() / 4)
        wants.append(want)
        H.train_step(eng, td, H.old_log_probs_padded(H.infer(eng, td), td))
        assert eng.optimizer.lr_scale == want
        assert eng.tim_pop_metrics()["tim/lr/window_length"] == pytest.approx(real.sum().item() / 4)
    assert wants == [1.0, 1.0, 0.5]  # the surge fires once


@pytest.mark.parametrize("signal", ["kl_k3", "grad_norm"])
def test_every_lr_signal_works_through_the_engine(toy_model_path, signal):
    """tim.lr_decay.options.signals reaches the controller: the engine closes each optimizer step through the
    pipeline with the step's k3 (its own measurement pass, merged over the DP group) or the last step's grad norm
    (what verl's train_batch reported), and the optimizer applies the scale. Reference: the core controller fed the
    naive k3 of each batch / verl's reported grad norms, outside verl; the length stays flat, so only the signal
    can fire (mode 'any')."""
    from tim_plugins.lr_control import LengthTriggeredLRDecay

    options = {**OPTIONS, "signals": [signal], "combine": "any", "kl_k3_margin": 0.5, "grad_norm_margin": 0.5}
    H.init_dist(port=29573 if signal == "kl_k3" else 29574)
    eng = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    cfg = {"lr_decay": {"enable": True, "options": options}, "monitor": {"enable": signal == "kl_k3"}}
    eng.tim_configure(TIMVerlConfig.from_node(cfg))
    reference = LengthTriggeredLRDecay(**options)
    grad_norms, lrs, want = [], [], []
    for step in range(4):
        # the third step: its rollout disagrees far more (k3: the batch's random rollout log-probs sit ~12 nats
        # further from the toy model's ~-6; about twice the others' k3), or its advantages are 1000x (its grad
        # norm, which the controller sees at the fourth step)
        surge = step == 2
        td, raw = H.make_batch(VOCAB, response=6, seed=10 + step,
                               rollout_noise=-12.0 if surge and signal == "kl_k3" else 0.0)
        if surge and signal == "grad_norm":
            td["advantages"] = td["advantages"] * 1000.0
        old = H.old_log_probs_padded(H.infer(eng, td), td)
        signals = {"kl_k3": _naive_k3(old, raw)} if signal == "kl_k3" else {
            "grad_norm": grad_norms[-1] if grad_norms else float("nan")}
        want.append(reference.observe(None, _mean_length(raw), **signals))
        out, lr = H.train_step(eng, td, old)
        grad_norms.append(float(out["metrics"]["grad_norm"]))
        lrs.append(lr)
    assert lrs == [LR * s for s in want]
    # the same state, up to the float32 k3 of the monitor vs the float64 reference
    _assert_same_state(eng.optimizer.tim_controller, reference)
    assert min(want) < 1.0, (want, reference.state_dict()['trackers'])  # the signal fired (the reference says when)
    metrics = eng.tim_pop_metrics()
    assert metrics["tim/lr/scale"] == want[-1] and metrics["tim/lr/trigger_count"] >= 1.0


def test_the_grad_norm_signal_continues_from_the_checkpoints_last_step(toy_model_path, tmp_path):
    """The engine feeds each step the grad norm of the step before; verl's checkpoint carries that norm (the
    optimizer's first param group), so a resumed run's first step is fed the norm of the checkpoint's last step, as
    the uninterrupted run's is. The checkpoint's last step has 1000x advantages: its norm fires the decay at the step
    after the resume, on both engines. Reference: the core controller fed verl's reported grad norms, outside verl."""
    from tim_plugins.integrations.verl.engine_mixin import GRAD_NORM_STATE_KEY
    from tim_plugins.lr_control import LengthTriggeredLRDecay

    options = {**OPTIONS, "signals": ["grad_norm"], "combine": "any", "grad_norm_margin": 0.5}
    cfg = TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": options}})
    H.init_dist(port=29588)
    batches = []
    for step in range(4):
        td, raw = H.make_batch(VOCAB, response=6, seed=10 + step)
        if step == 2:
            td["advantages"] = td["advantages"] * 1000.0
        batches.append((td, raw))
    eng = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    eng.tim_configure(cfg)
    reference = LengthTriggeredLRDecay(**options)
    grad_norms, want = [], []
    for td, raw in batches[:3]:
        want.append(reference.observe(None, _mean_length(raw), grad_norm=grad_norms[-1] if grad_norms else None))
        out, _ = H.train_step(eng, td, H.old_log_probs_padded(H.infer(eng, td), td))
        grad_norms.append(float(out["metrics"]["grad_norm"]))
    assert want == [1.0, 1.0, 1.0]  # the surge's norm is seen at the step after it
    ckpt = str(tmp_path / "ckpt")
    eng.save_checkpoint(ckpt, global_step=3)

    fresh = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    fresh.tim_configure(cfg)
    fresh.load_checkpoint(ckpt)
    assert fresh.optimizer.param_groups[0][GRAD_NORM_STATE_KEY] == pytest.approx(grad_norms[-1], rel=1e-6)
    td, raw = batches[3]
    after = reference.observe(None, _mean_length(raw), grad_norm=grad_norms[-1])
    assert after < 1.0  # the checkpoint's last norm fires the decay
    lrs = [H.train_step(e, td, H.old_log_probs_padded(H.infer(e, td), td))[1] for e in (fresh, eng)]
    assert lrs == [LR * after] * 2
    _assert_same_state(fresh.optimizer.tim_controller, reference)
    _assert_same_state(eng.optimizer.tim_controller, reference)
    # skipped once in the whole run (its first step, before any norm), not again at the resume
    assert fresh.tim_pop_metrics()["tim/lr/skipped_grad_norm"] == 1.0

    # switched off, the engine drops the norm it stored: a later tim_configure is not fed a stale one
    fresh.tim_deconfigure()
    H.train_step(fresh, td, H.old_log_probs_padded(H.infer(fresh, td), td))
    assert GRAD_NORM_STATE_KEY not in fresh.optimizer.param_groups[0]


def _train_mini_batches(eng, tds: list, old_padded: list, loss) -> list[float]:
    """verl's actor update of one global step, as ``TrainingWorker`` runs it: one ``train_batch`` (one optimizer
    step) per mini-batch TensorDict, then the scheduler step; the scale in force after each optimizer step."""
    from verl.utils import tensordict_utils as tu

    scales = []
    with eng.train_mode():
        for td, old in zip(tds, old_padded):
            td = td.copy()
            td["old_log_probs"] = old
            tu.assign_non_tensor(td, use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                                 max_token_len_per_gpu=4096, use_fused_kernels=False, calculate_entropy=False,
                                 global_batch_size=td.batch_size[0])
            eng.train_batch(td, loss_function=loss)
            scales.append(eng.optimizer.lr_scale)
        eng.lr_scheduler_step()
    return scales


def _ppo_loss():
    from functools import partial

    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                                                    ppo_mini_batch_size=2, use_dynamic_bsz=False))


def test_the_k3_signal_is_observed_once_per_global_step(toy_model_path):
    """verl measures a global step's batch once (the old-log-prob pass) and then takes several optimizer steps on it
    (here two PPO epochs; mini-batches alike): the controller observes the step once, before its first optimizer
    step, and every optimizer step of the step runs at the scale that observation decides. With ``patience=2`` a k3
    surge fires at the second global step that shows it, not within the first (which an observation per optimizer
    step would do: the reference fed twice a step fires there). Reference: the core controller fed each global step's
    naive k3 once, outside verl."""
    from tim_plugins.lr_control import LengthTriggeredLRDecay

    options = {**OPTIONS, "patience": 2, "signals": ["kl_k3"], "combine": "any", "kl_k3_margin": 0.5}
    H.init_dist(port=29576)
    eng = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    eng.tim_configure(TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": options},
                                               "monitor": {"enable": True}}))
    reference, per_optimizer_step = LengthTriggeredLRDecay(**options), LengthTriggeredLRDecay(**options)
    want, got, fired_early = [], [], []
    for step in range(5):
        surge = step in (2, 3)
        td, raw = H.make_batch(VOCAB, response=6, seed=10 + step, rollout_noise=-12.0 if surge else 0.0)
        old = H.old_log_probs_padded(H.infer(eng, td), td)
        k3 = _naive_k3(old, raw)
        scale = reference.observe(None, _mean_length(raw), kl_k3=k3)
        want += [scale, scale]  # both optimizer steps of the step run at it
        fired_early += [per_optimizer_step.observe(None, _mean_length(raw), kl_k3=k3) for _ in range(2)]
        got += _train_mini_batches(eng, [td, td], [old, old], _ppo_loss())
    assert got == want
    assert want.index(min(want)) == 6 and min(want) < 1.0, want  # fired at the second surge step (step 3)
    assert fired_early.index(min(fired_early)) == 5  # an observation per optimizer step fires inside step 2
    _assert_same_state(eng.optimizer.tim_controller, reference)


def test_the_length_signal_is_the_steps_whole_batch_before_verls_rejection_sampling(toy_model_path):
    """One global step's batch, rolled out and scored whole by the old-log-prob pass, then trained in two
    mini-batches after verl's rollout correction has masked rejected sequences out of ``response_mask``
    (``algorithm.rollout_correction.rollout_rs``): the length the controller sees is the whole batch's mean response
    length as rolled out, once per global step, not a mini-batch's nor the masked one. Reference: the batch's mask
    before verl's own ``compute_rollout_correction_and_rejection_mask``, and the core controller fed it once a step;
    the rejection does reject here (the masked mean differs)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from tim_plugins.lr_control import LengthTriggeredLRDecay

    H.init_dist(port=29589)
    eng = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
    eng.tim_configure(TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": OPTIONS}}))
    reference = LengthTriggeredLRDecay(**OPTIONS)
    wants = []
    for step, response in enumerate((4, 4, 12)):
        td, raw = H.make_batch(VOCAB, batch=4, response=response, seed=20 + step)
        old = H.old_log_probs_padded(H.infer(eng, td), td)
        # rows 1 and 2 sampled far from the actor: verl's sequence-level rejection masks them out
        rollout = old.detach().clone()
        rollout[1:3] -= 5.0
        _, rejected, _ = compute_rollout_correction_and_rejection_mask(
            old_log_prob=old.detach(), rollout_log_prob=rollout, response_mask=raw["response_mask"],
            rollout_rs="seq_max_k2", rollout_rs_threshold=2.0)
        assert rejected[1:3].sum() == 0 and torch.equal(rejected[[0, 3]], raw["response_mask"][[0, 3]].to(rejected))
        halves = []
        for rows in (slice(0, 2), slice(2, 4)):
            part, _ = H.make_batch(VOCAB, batch=4, response=response, seed=20 + step, rows=rows)
            part["response_mask"] = rejected[rows].to(raw["response_mask"].dtype)  # as verl trains it
            part["loss_mask"] = part["response_mask"]
            halves.append(part)
        want = reference.observe(None, _mean_length(raw))
        wants.append(want)
        assert _train_mini_batches(eng, halves, [old[0:2], old[2:4]], _ppo_loss()) == [want, want]
        metrics = eng.tim_pop_metrics()
        assert metrics["tim/lr/window_length"] == pytest.approx(_mean_length(raw))
        assert _mean_length({"response_mask": rejected}) != pytest.approx(_mean_length(raw))
    assert wants == [1.0, 1.0, 0.5]  # the surge fires once
    _assert_same_state(eng.optimizer.tim_controller, reference)


def test_a_rank_without_outputs_sees_the_grad_norm_too(toy_model_path):
    """verl's ``train_batch`` reports ``grad_norm`` only where ``is_mp_src_rank_with_outputs()`` (with Ulysses
    sequence parallelism, SP rank 0), while every rank steps its own shard with the scale its controller decides: the
    grad-norm signal must reach the others too. Reference: the same run on a rank with outputs (same weights, same
    batches, so the same norms and scales); the surge fires the decay on both."""
    options = {**OPTIONS, "signals": ["grad_norm"], "combine": "any", "grad_norm_margin": 0.5}
    H.init_dist(port=29575)

    def run(outputs: bool) -> list[float]:
        eng = H.build_engine(toy_model_path, optimizer_impl=OPTIMIZER_IMPL, optimizer="AdamW", lr=LR)
        eng.tim_configure(TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": options}}))
        if not outputs:  # as on a Ulysses SP rank other than 0
            eng.is_mp_src_rank_with_outputs = lambda: False
        lrs = []
        for step in range(5):
            td, _ = H.make_batch(VOCAB, response=6, seed=10 + step)
            if step == 2:
                td["advantages"] = td["advantages"] * 1000.0
            out, lr = H.train_step(eng, td, H.old_log_probs_padded(H.infer(eng, td), td))
            assert ("grad_norm" in out["metrics"]) == outputs
            lrs.append(lr)
        return lrs

    with_outputs, without = run(True), run(False)
    assert min(with_outputs) < LR, with_outputs  # the surge fired (its norm is seen at the next step)
    assert without == with_outputs
