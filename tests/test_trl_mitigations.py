"""Opt-in mitigations through TIMCallback on a real TRL GRPOTrainer (CPU, toy model): safe vocabulary,
IS correction without vLLM, LR decay, checkpoint/resume."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_trl_callback import LR0, Capture, _logged, make_trainer  # noqa: E402

from transformers import TrainerCallback  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.integrations.trl import features  # noqa: E402
from tim_plugins.rollout.inject import TailNoiseInjector  # noqa: E402

pytestmark = pytest.mark.trl

MIN_P = 0.05  # large enough that the toy model's tail is pruned on most positions

# The safe-vocabulary route of the installed TRL (features.py): the fused head's kernel (TRL >= 1.15), which has a
# labelled-positions-only branch, or selective_log_softmax on full logits (TRL 1.9 - 1.13), which has none.
ROUTE, _ = features.safe_vocab_route()
SAFE_CASES = [pytest.param(False, None, id="every-position"), pytest.param(False, 0.3, id="boundary-tokens")]
if ROUTE is features.SAFE_VOCAB_FUSED_HEAD:
    SAFE_CASES.insert(1, pytest.param(True, None, id="labelled-only"))


def _route_global():
    """(module, name, the object there now) of the module global the route replaces for one log-prob call."""
    if ROUTE is features.SAFE_VOCAB_FUSED_HEAD:
        import trl.trainer.utils as module

        name = "_ChunkedLogProbFunction"
    else:
        import trl.trainer.grpo_trainer as module

        name = "selective_log_softmax"
    return module, name, getattr(module, name)


def test_a_safe_vocab_route_is_available():
    assert ROUTE is not None and features.safe_vocab_status().available


def _safe_references(trainer, **truncation) -> list:
    """Wrap the trainer's ``_compute_loss`` (test-side, before the callback attaches): per loss call, (inputs, the
    core function's safe-vocab result [B, T] on a plain forward's full logits at the same weights, TRL's advantages
    as built), ``truncation`` in HF's order at the trainer's temperature."""
    from tim_plugins.safe_vocab import safe_logprobs_from_logits

    refs, orig_loss = [], trainer._compute_loss

    def _compute_loss(model, inputs, *a, **k):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        t = inputs["completion_ids"].size(1)
        with torch.no_grad():
            logits = trainer.model(input_ids=ids, attention_mask=attn).logits[:, -t - 1:-1]
            res = safe_logprobs_from_logits(logits.reshape(-1, logits.shape[-1]), inputs["completion_ids"].reshape(-1),
                                            temperature=trainer.temperature, order="hf", **truncation)
        shaped = type(res)(res.logprobs.view(-1, t), res.in_safe.view(-1, t), res.pruned_mass.view(-1, t),
                           res.size.view(-1, t))
        refs.append((inputs, shaped, inputs["advantages"].clone()))
        return orig_loss(model, inputs, *a, **k)

    trainer._compute_loss = _compute_loss
    return refs


@pytest.mark.parametrize("compact,trainer_min_p", SAFE_CASES)
def test_safe_vocab_loss_uses_safe_logprobs_and_masks_boundary(toy_model_path, tmp_path, monkeypatch, compact,
                                                               trainer_min_p):
    """``compact`` (fused-head route only): TRL's fused head scores only the labelled positions on Triton devices
    and every position elsewhere (trl/trainer/utils.py add_fused_lm_head, ``compact = _use_triton(device)``); its
    Triton branch is taken on this CPU by answering that check, the safe-vocab head (torch folds here) standing in
    for the kernel. On the full-logits route (TRL 1.9 - 1.13) TRL scores [B, logits_to_keep] logits and the
    safe-vocab stand-in replaces ``selective_log_softmax`` on them. ``trainer_min_p`` above the sampler's: the
    sampler keeps tokens the trainer's safe set excludes (boundary tokens), whose policy term the loss must then
    drop."""
    module, name, original = _route_global()
    if compact:
        import trl.trainer.utils as trl_utils

        asked = []

        def use_triton(device):  # TRL's question, answered yes (and remembered)
            asked.append(device)
            return True

        monkeypatch.setattr(trl_utils, "_use_triton", use_triton)
    trainer = make_trainer(toy_model_path, tmp_path, min_p=MIN_P, max_steps=1)
    refs = _safe_references(trainer, min_p=trainer_min_p or MIN_P)
    cap = Capture(trainer)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, safe_vocab=True, safe_vocab_min_p=trainer_min_p)))
    trainer.train()
    assert refs and cap.losses
    assert not compact or asked  # TRL took its labelled-positions branch
    boundary = 0
    for (inputs, ref, adv), (_, _, used_lp), read in zip(refs, cap.losses, cap.read_in_loss):
        ref_lp, ref_in = ref.logprobs, ref.in_safe
        valid = inputs["completion_mask"].bool()
        assert torch.allclose(used_lp[valid], ref_lp[valid], rtol=0, atol=2e-5)
        # boundary tokens (sampled, outside the trainer's safe set) carry no policy term: TRL's loss read its own
        # advantages times the keep mask on its loss mask (factor 1 off it, where TRL's own IS ratio is 1 too);
        # everything else of TRL's batch is as TRL built it
        keep = torch.where(valid, ref_in.to(adv.dtype), torch.ones((), dtype=adv.dtype))
        assert torch.equal(read["advantages"], adv[:, None] * keep)
        assert "tool_mask" not in inputs
        boundary += int((valid & ~ref_in).sum())
    assert (boundary > 0) == (trainer_min_p is not None)
    logged = _logged(trainer, 1)
    if trainer_min_p is None:
        # Sampler (HF min_p, processed log-probs) and trainer (safe set) now prune the same tail.
        assert logged["tim/token/abs_diff_max"] < 1e-4
    # The pruned mass is averaged over the completion tokens (TRL's labelled positions) of the measured forward,
    # whether the device's fused head scores only those (Triton) or every position, prompt and padding too (here).
    want = [ref.pruned_mass[inputs["completion_mask"].bool()].double() for inputs, ref, _ in refs]
    assert logged["tim/safe_vocab/pruned_mass_mean"] == pytest.approx(float(torch.cat(want).mean()), rel=1e-4)
    assert logged["tim/safe_vocab/boundary_frac"] == pytest.approx(
        boundary / sum(int(inputs["completion_mask"].sum()) for inputs, *_ in refs), rel=1e-12)
    assert 0.0 < logged["tim/safe_vocab/pruned_mass_mean"]
    assert getattr(module, name) is original  # installed for each log-prob call only



def test_safe_vocab_over_the_samplers_top_k_top_p_alone(toy_model_path, tmp_path):
    """A user's ``top_p`` / ``top_k`` as set and no min-p: ``TIMConfig(safe_vocab=True)`` renormalises the trainer's
    log-probs over the sampler's own cut (HF order, top-k then top-p), equal to the core function on a plain forward
    at the same weights; the sampler's processed log-probs are renormalised over the same cut, so the monitor reads
    fp32 noise where a full-vocabulary trainer reads the kept mass."""
    trainer = make_trainer(toy_model_path, tmp_path, top_p=0.8, top_k=10, max_steps=1)
    assert trainer.args.min_p is None
    refs = _safe_references(trainer, min_p=0.0, top_p=0.8, top_k=10)
    cap = Capture(trainer)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, safe_vocab=True)))
    trainer.train()
    assert refs and cap.losses
    for (inputs, ref, _), (_, _, used_lp) in zip(refs, cap.losses):
        valid = inputs["completion_mask"].bool()
        assert torch.allclose(used_lp[valid], ref.logprobs[valid], rtol=0, atol=2e-5)
        assert int(ref.size[valid].max()) <= 10  # the cut, not the whole vocabulary
    logged = _logged(trainer, 1)
    assert logged["tim/token/abs_diff_max"] < 1e-4 and abs(logged["tim/token/ratio_mean"] - 1.0) < 1e-4
    assert 0.0 < logged["tim/safe_vocab/pruned_mass_mean"] < 1.0 and logged["tim/safe_vocab/boundary_frac"] == 0.0


@pytest.mark.parametrize("sampler,trainer_min_p", [({"min_p": MIN_P}, 0.01), ({"top_p": 0.8}, 0.3)],
                         ids=["min-p-differs", "min-p-the-sampler-lacks"])
def test_a_safe_vocab_min_p_other_than_the_samplers_gets_a_fix_that_works(toy_model_path, tmp_path, caplog, sampler,
                                                                          trainer_min_p):
    """safe_vocab=True with a safe_vocab_min_p the sampler does not use: the trainer cuts another tail than the
    sampler, so the ratio is off 1 and the audit names sampler-truncation-unmatched. What the user reads (the warning
    at attach, the audit's and the truncation cause's TRL fix) must name the setting to change, not the safe_vocab=True
    they already set; following it (safe_vocab_min_p=None) brings the ratio back to 1 and the finding goes."""
    import logging

    from tim_plugins.causes import cause_fix
    from tim_plugins.parity.findings import fix_for

    def run(min_p):
        trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, **sampler)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tim_plugins.trl"):
            cb = TIMCallback(trainer, TIMConfig(log_detail=True, safe_vocab=True, safe_vocab_min_p=min_p))
        warned = [r.getMessage() for r in caplog.records if "safe_vocab_min_p" in r.getMessage()]
        trainer.add_callback(cb)
        trainer.train()
        return warned, {f.code: f for f in cb.findings}, _logged(trainer, 1)["tim/token/ratio_mean"]

    warned, findings, ratio = run(trainer_min_p)
    assert "sampler-truncation-unmatched" in findings and abs(ratio - 1) > 1e-3
    sampler_min_p = sampler.get("min_p")
    assert len(warned) == 1 and f"safe_vocab_min_p={trainer_min_p:g}" in warned[0], warned
    assert f"GRPOConfig.min_p={sampler_min_p!r}" in warned[0] and "Fix: safe_vocab_min_p=None" in warned[0], warned
    for fix in (fix_for(findings["sampler-truncation-unmatched"].fix, "trl"), cause_fix("truncation", "trl")):
        assert "safe_vocab_min_p=None" in fix, fix
    warned, findings, ratio = run(None)  # the printed fix
    assert warned == [] and "sampler-truncation-unmatched" not in findings and abs(ratio - 1) < 1e-4


def test_safe_vocab_refuses_a_sampler_that_cuts_nothing(toy_model_path, tmp_path):
    """No min-p, top_p 1 and no top-k: no kept set to renormalise over; refused when the callback is created, with
    the values, the rule and the fixes."""
    trainer = make_trainer(toy_model_path, tmp_path, top_p=1.0, max_steps=1)
    with pytest.raises(ValueError) as err:
        TIMCallback(trainer, TIMConfig(safe_vocab=True, safe_vocab_min_p=0.0))
    msg = str(err.value)
    assert "GRPOConfig(min_p=None, top_p=1.0" in msg and "safe_vocab_min_p=0.0" in msg
    from tim_plugins.options import SAFE_VOCAB_NEEDS_A_CUT  # the rule verl's tim.safe_vocab.enable states too

    assert SAFE_VOCAB_NEEDS_A_CUT in msg and SAFE_VOCAB_NEEDS_A_CUT.endswith("a min-p > 0, a top_p < 1 or a top_k > 0")
    assert "Fix: GRPOConfig(min_p=1e-05)" in msg and "safe_vocab=False" in msg


@pytest.mark.parametrize("lora", [False, True], ids=["ref-model", "peft"])
def test_reference_log_probs_stay_full_vocabulary_with_safe_vocab(toy_model_path, tmp_path, lora):
    """beta > 0: TRL's reference log-probs (its KL regulariser) are the reference model's full-vocabulary ones, as
    verl's reference worker computes them: the safe-vocabulary head applies to the policy's call only. The
    reference here: a plain forward of TRL's reference model, log_softmax over the whole vocabulary; the safe-vocab
    log-probs of the same model (what the reference would be with the head applied) differ from it. A PEFT policy
    has no reference model: TRL scores the reference with the policy itself, its adapters disabled, and that call is
    the reference's too."""
    import functools

    from trl import GRPOTrainer

    from tim_plugins.safe_vocab import safe_logprobs_from_logits

    if lora:
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        trainer = make_trainer(toy_model_path, tmp_path, min_p=MIN_P, max_steps=1, beta=0.04,
                               trainer_cls=functools.partial(GRPOTrainer, peft_config=config))
        assert trainer.ref_model is None

        def reference(**inputs):
            with trainer.model.disable_adapter():
                return trainer.model(**inputs)
    else:
        trainer = make_trainer(toy_model_path, tmp_path, min_p=MIN_P, max_steps=1, beta=0.04)
        assert trainer.ref_model is not None
        reference = trainer.ref_model
    batches, generate = [], trainer._generate_and_score_completions

    def _generate_and_score_completions(*a, **k):  # inside the callback's wrapper: TRL's batch as TRL built it
        out = generate(*a, **k)
        batches.append(out)
        return out

    trainer._generate_and_score_completions = _generate_and_score_completions
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, safe_vocab=True))
    trainer.add_callback(cb)
    trainer.train()
    assert cb.truncation is not None and batches
    for out in batches:
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        t, valid = out["completion_ids"].size(1), out["completion_mask"].bool()
        with torch.no_grad():
            logits = reference(input_ids=ids, attention_mask=attn).logits[:, -t - 1:-1].float()
        logits = logits / trainer.temperature
        full = torch.log_softmax(logits, -1).gather(-1, out["completion_ids"][..., None])[..., 0]
        safe = safe_logprobs_from_logits(logits.reshape(-1, logits.shape[-1]), out["completion_ids"].reshape(-1),
                                         min_p=MIN_P, temperature=1.0, order="hf").logprobs.view(-1, t)
        ref = out["ref_per_token_logps"]
        assert torch.allclose(ref[valid], full[valid], rtol=0, atol=2e-5)
        assert (ref[valid] - safe[valid]).abs().max() > 1e-3  # the safe head would have changed them
    # the policy's own calls took the safe head: the sampler's min_p on both sides (without: > 1e-3, the next test)
    assert _logged(trainer, 1)["tim/token/abs_diff_max"] < 1e-4


def test_without_safe_vocab_min_p_sampler_shows_mismatch(toy_model_path, tmp_path):
    """Control for the test above: same sampler, full-vocabulary trainer → renormalisation bias is visible."""
    trainer = make_trainer(toy_model_path, tmp_path, min_p=MIN_P, max_steps=1)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True)))
    trainer.train()
    assert _logged(trainer, 1)["tim/token/abs_diff_max"] > 1e-3


def _rows_by_content(batch, *keys):
    """{(prompt ids, completion ids): tuple of batch[key] rows}: matches rows across TRL's shuffle."""
    out = {}
    for i in range(batch["completion_ids"].shape[0]):
        row = (tuple(batch["prompt_ids"][i].tolist()), tuple(batch["completion_ids"][i].tolist()))
        out[row] = tuple(batch[k][i] for k in keys)
    return out


def test_is_correction_without_vllm(toy_model_path, tmp_path):
    """Token TIS on TRL's transformers rollouts: the weights are min(exp(train - rollout), C), they differ clearly
    from 1 (injected mismatch), and TRL's loss is the reference loss computed with them, TRL's flags untouched."""
    clip = 1.1
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    cap = Capture(trainer)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, 
        is_correction="token_tis", is_correction_options={"token_clip": clip},
        rollout="inject", inject_options={"scale": 1.0, "tau": 0.5, "mode": "bias", "seed": 0})))
    trainer.train()
    (_, inputs, loss_logps), = cap.losses
    mask = inputs["completion_mask"].bool()
    # Reference: token TIS w = min(exp(train - rollout), C), train scored at the rollout weights (= the loss
    # forward here: on-policy, one micro-batch), 0 off the mask.
    ref_w = torch.clamp(torch.exp(loss_logps.double() - inputs["sampling_per_token_logps"].double()), max=clip)
    w = inputs["tim_weights"]
    assert torch.allclose(w[mask].double(), ref_w[mask], rtol=0, atol=1e-5)
    assert torch.all(w[~mask] == 0)
    # A regime where the weights matter: the clip binds on some tokens, others are well below 1.
    assert int((w[mask] >= clip - 1e-6).sum()) >= 1
    assert int((w[mask] < 0.9).sum()) >= 1
    # TRL's loss used them. dapo, on-policy: r = exp(logp - sg(logp)) = 1 inside the clip, so the per-token term
    # is -A_i and the loss is -sum(A_i * w_it * m_it) / N, with TRL's own advantages (before our fold) and N.
    (built,) = cap.trl_built
    adv = _rows_by_content(built, "advantages")
    a = torch.stack([adv[(tuple(p.tolist()), tuple(c.tolist()))][0]
                     for p, c in zip(inputs["prompt_ids"], inputs["completion_ids"])]).double()
    n = float(built["num_items_in_batch"])
    assert float(inputs["num_items_in_batch"]) == n  # token TIS drops no token
    ref_loss = -(a[:, None] * ref_w * mask).sum() / n
    unweighted = -(a[:, None] * mask).sum() / n
    (read,) = cap.read_in_loss  # what TRL's loss read: its own advantages times the weights (1 off its loss mask)
    assert torch.equal(read["advantages"], inputs["advantages"][:, None] * torch.where(mask, w, torch.ones(())))
    (loss,) = cap.loss_values
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-7)
    assert abs(float(ref_loss) - float(unweighted)) > 1e-3  # the check above would fail with weights ignored
    # TRL read its own configuration in the loss (no vLLM branch raised for our weights).
    assert cap.flags_in_loss == [(False, trainer.args.vllm_importance_sampling_correction)]
    assert trainer.use_vllm is False
    logged = _logged(trainer, 1)
    assert logged["tim/is/weight_max"] == pytest.approx(float(w[mask].max()), rel=1e-6)
    assert logged["tim/correction/kept_frac"] == 1.0


def _forced_lengths(trainer, schedule):
    """Truncate completions to schedule[global_step] tokens (test-side), so the length signal is known."""
    orig = trainer._generate_single_turn

    def _generate_single_turn(*a, **k):
        ids, logps = orig(*a, **k)
        n = schedule[min(trainer.state.global_step, len(schedule) - 1)]
        ids = [x[:n] for x in ids]
        logps = None if logps is None else [x[:n] for x in logps]
        return ids, logps

    trainer._generate_single_turn = _generate_single_turn


LR_OPTS = {"warmup_steps": 2, "window": 1, "patience": 1, "margin": 0.5, "cooldown": 100, "decay_factor": 0.5}
SCHEDULE = [2, 2, 6, 6, 6, 6]  # surge at step 3 → trigger at step 3


def _lr_run(model_path, tmp_path, max_steps, **overrides):
    trainer = make_trainer(model_path, tmp_path, max_steps=max_steps, max_completion_length=6, **overrides)
    _forced_lengths(trainer, SCHEDULE)
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, lr_decay=True, lr_decay_options=dict(LR_OPTS)))
    trainer.add_callback(cb)
    return trainer, cb


def test_lr_decay_shows_in_logged_learning_rate(toy_model_path, tmp_path):
    n = 5
    trainer, cb = _lr_run(toy_model_path, tmp_path, n)
    trainer.train()
    assert cb.pipeline.lr_controller.trigger_steps == [3]
    lrs = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}
    for step in range(1, n + 1):
        unscaled = LR0 * (1 - (step - 1) / n)  # transformers' linear schedule, LR used at this step
        scale = 0.5 if step > 3 else 1.0  # decided at the end of step 3, in force from step 4
        assert lrs[step] == pytest.approx(unscaled * scale, rel=1e-6), step
    assert _logged(trainer, 3)["tim/lr/triggered"] == 1.0


def test_the_length_signal_counts_the_completions_trl_masks_as_truncated(toy_model_path, tmp_path):
    """``mask_truncated_completions=True`` zeroes the loss mask of every completion that does not end: the LR decay's
    length signal still counts its tokens, as TRL's logged ``completions/mean_length`` does (what ``lr-replay``
    reads): a surge is mostly such completions. Every completion is cut (test-side) to the schedule's length, so
    TRL truncates and masks them (EOS is never sampled); reference: the core controller fed TRL's logged lengths."""
    from transformers import AutoTokenizer

    from tim_plugins.lr_control import LengthTriggeredLRDecay

    eos = AutoTokenizer.from_pretrained(toy_model_path).eos_token_id
    trainer, cb = _lr_run(toy_model_path, tmp_path, 4, mask_truncated_completions=True,
                          generation_kwargs={"suppress_tokens": [eos]})
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    assert [h["step"] for h in logs] == [1, 2, 3, 4]
    assert all(h["completions/clipped_ratio"] == 1.0 for h in logs)  # every completion masked whole
    reference = LengthTriggeredLRDecay(**LR_OPTS)
    for h in logs:
        reference.observe(h["step"], h["completions/mean_length"])
        assert h["tim/lr/window_length"] == pytest.approx(h["completions/mean_length"], rel=1e-12), h["step"]
    assert cb.pipeline.lr_controller.trigger_steps == reference.trigger_steps == [3]


def _nan_none(value):
    """A logged value as lr-replay's JSON writes it: NaN (TRL's log() writes None for it) as None."""
    return None if value is None or value != value else value


def _recording_observe(cb):
    """(step, length, kl_k3) of every call the live controller gets (test-side wrapper)."""
    seen, controller = [], cb.pipeline.lr_controller
    observe = controller.observe

    def recording(step, length, **signals):
        seen.append((step, length, signals.get("kl_k3")))
        return observe(step, length, **signals)

    controller.observe = recording
    return seen


def test_lr_decay_observes_each_generation_batch_once_as_lr_replay_reads_it(toy_model_path, tmp_path):
    """``num_iterations=2``: each generation batch trains two optimizer steps. The controller observes each batch
    once, at the step that generated it, with TRL's logged ``completions/mean_length`` and the logged k3 of that step;
    the step that trains it again is a skipped observation (its log row has neither value). So a length surge needs
    two batches above the baseline (``patience=2``): it fires at step 7, where feeding one batch twice fired at step
    6. Reference: ``tim-plugins lr-replay`` on the run's own log history, whose every ``tim/lr/*`` value and trigger
    equal the live controller's, step by step."""
    import json

    from tim_plugins.apps import cli

    n = 8
    options = {"warmup_steps": 2, "window": 1, "patience": 2, "margin": 0.5, "cooldown": 100,
               "decay_factor": 0.5, "signals": ("kl_k3",)}
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=n, num_iterations=2)
    # by the step a batch is generated at (0, 2, 4, 6); a 1-token baseline, so the surge exceeds it however early the
    # sampled completions end (their EOS is the stack's sampling: TRL 1.9's ended the 4th batch at 3 tokens on average)
    _forced_lengths(trainer, [1, 1, 1, 1, 6, 6, 6, 6])
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, lr_decay=True, lr_decay_options=dict(options)))
    trainer.add_callback(cb)
    seen = _recording_observe(cb)
    trainer.train()
    rows = {h["step"]: h for h in trainer.state.log_history if "tim/lr/scale" in h}
    assert sorted(rows) == list(range(1, n + 1))
    generated = [s for s in rows if "completions/mean_length" in rows[s]]
    assert generated == [1, 3, 5, 7]
    assert [s for s, _, _ in seen] == list(range(1, n + 1))
    for step, length, k3 in seen:
        if step in generated:
            assert length == rows[step]["completions/mean_length"] and k3 == rows[step]["tim/token/kl_k3"], step
        else:
            assert length != length and "tim/token/kl_k3" not in rows[step], step  # NaN: a skipped observation
    assert cb.pipeline.lr_controller.trigger_steps == [7]
    assert [rows[s]["learning_rate"] for s in (7, 8)] == pytest.approx([LR0 * 2 / n, LR0 * 1 / n * 0.5], rel=1e-6)
    log = tmp_path / "trainer_state.json"
    log.write_text(json.dumps({"log_history": trainer.state.log_history}))
    out = tmp_path / "replay.json"
    flags = ["--warmup-steps", "2", "--window", "1", "--patience", "2", "--margin", "0.5", "--cooldown", "100",
             "--signals", "kl_k3"]
    assert cli.main(["lr-replay", str(log), *flags, "--out", str(out)]) == 0
    replay = json.loads(out.read_text())
    assert replay["columns"]["length"] == "completions/mean_length" and replay["fires"] == [7]
    assert [r["step"] for r in replay["steps"]] == list(range(1, n + 1))
    for record in replay["steps"]:
        live = rows[record["step"]]
        keys = [k for k in record if k.startswith("tim/lr/")]
        assert len(keys) > 10 and all(k in live for k in keys)
        assert {k: _nan_none(live[k]) for k in keys} == {k: record[k] for k in keys}, record["step"]
    assert rows[n]["tim/lr/skipped"] == 4.0


def test_lr_decay_observes_the_mean_of_the_batches_generated_in_a_step(toy_model_path, tmp_path):
    """``gradient_accumulation_steps=2, steps_per_generation=1``: two generation batches per optimizer step. The
    controller observes their mean length, TRL's logged ``completions/mean_length`` of the step (TRL's log()
    averages the step's batches), not the last batch's alone."""
    n = 3
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=n, gradient_accumulation_steps=2,
                           steps_per_generation=1)
    cb = TIMCallback(trainer, TIMConfig(lr_decay=True))
    trainer.add_callback(cb)
    batches = []  # the mean length TRL appended for each generation batch, read at the step's end (test-side)
    generate = trainer._generate_and_score_completions

    def recording(*args, **kwargs):
        out = generate(*args, **kwargs)
        batches.append((trainer.state.global_step + 1, trainer._metrics["train"]["completions/mean_length"][-1]))
        return out

    trainer._generate_and_score_completions = recording
    seen = _recording_observe(cb)
    trainer.train()
    logged = {h["step"]: h["completions/mean_length"] for h in trainer.state.log_history
              if "completions/mean_length" in h}
    assert [s for s, _ in batches] == [1, 1, 2, 2, 3, 3]
    assert [(s, length) for s, length, _ in seen] == [(s, logged[s]) for s in range(1, n + 1)]
    for step in range(1, n + 1):
        first, last = (length for s, length in batches if s == step)
        assert logged[step] == pytest.approx((first + last) / 2, rel=1e-12)
    assert any(first != last for (_, first), (_, last) in zip(batches[::2], batches[1::2]))


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_the_grad_norm_signal_is_each_steps_own_norm(toy_model_path, tmp_path):
    """lr_decay_signals=("grad_norm",): the controller observes, at the end of each optimizer step, the norm
    transformers computed in that step: with logging_steps=1 its logged grad_norm of the same step; with
    logging_steps=3 (the same seed, the same steps) the same values, every step once. Before, it read the last
    logged value: one step late, and repeated between logs."""
    n = 4
    runs = {}
    for logging_steps in (1, 3):
        trainer = make_trainer(toy_model_path, tmp_path / str(logging_steps), max_steps=n,
                               logging_steps=logging_steps, max_grad_norm=1.0)
        cb = TIMCallback(trainer, TIMConfig(lr_decay=True, lr_decay_signals=("grad_norm",)))
        trainer.add_callback(cb)
        seen = []
        end_step = cb.pipeline.end_step

        def recording(step, _end=end_step, _seen=seen, **kwargs):  # test-side: what the controller is handed
            _seen.append((step, kwargs.get("grad_norm")))
            return _end(step, **kwargs)

        cb.pipeline.end_step = recording
        trainer.train()
        logged = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
        runs[logging_steps] = (seen, logged)
    (every, logged), (sparse, logged_sparse) = runs[1], runs[3]
    assert [s for s, _ in every] == [s for s, _ in sparse] == list(range(1, n + 1))
    assert sorted(logged) == list(range(1, n + 1)) and sorted(logged_sparse) == [3]
    assert all(norm is not None and norm == pytest.approx(logged[step], rel=1e-6) for step, norm in every), every
    assert [norm for _, norm in sparse] == pytest.approx([norm for _, norm in every], rel=1e-6)
    assert any(norm > 0 for _, norm in every)


def test_resume_restores_controller_and_lr_scale(toy_model_path, tmp_path):
    n, k = 5, 4
    full, full_cb = _lr_run(toy_model_path, tmp_path / "full", n)
    full.train()
    # Same schedule length n, interrupted after the checkpoint at step k.
    first, _ = _lr_run(toy_model_path, tmp_path / "resumed", n, save_strategy="steps", save_steps=k)
    first.add_callback(_StopAt(k))
    first.train()
    assert first.state.global_step == k
    ckpt = tmp_path / "resumed" / "out" / f"checkpoint-{k}"
    assert ckpt.is_dir()
    second, second_cb = _lr_run(toy_model_path, tmp_path / "resumed", n)
    second.train(resume_from_checkpoint=str(ckpt))
    a, b = full_cb.pipeline.lr_controller.state_dict(), second_cb.pipeline.lr_controller.state_dict()
    assert b == a
    assert second_cb.pipeline.lr_controller.scale == full_cb.pipeline.lr_controller.scale == 0.5
    lr_full = [h["learning_rate"] for h in full.state.log_history if "learning_rate" in h]
    lr_res = [h["learning_rate"] for h in second.state.log_history if "learning_rate" in h]
    assert lr_res[-1] == pytest.approx(lr_full[-1], rel=1e-12)
    assert lr_res[-1] == pytest.approx(LR0 * (1 - (n - 1) / n) * 0.5, rel=1e-6)
    assert second.optimizer.param_groups[0]["lr"] == pytest.approx(full.optimizer.param_groups[0]["lr"], rel=1e-12)


def test_a_second_train_call_starts_the_lr_decay_afresh_as_transformers_starts_the_schedule(toy_model_path, tmp_path):
    """``trainer.train()`` again without a checkpoint: transformers starts a new run (its state at step 0, its LR
    schedule rebuilt from the start) and so does the callback: the LR controller sees steps 1.. again (none read as
    stale), the length surge at step 3 triggers as in a first run, and the LR is transformers' linear schedule times
    that run's own scale (the first run's decay does not carry over)."""
    n = 5
    trainer, cb = _lr_run(toy_model_path, tmp_path, n)
    trainer.train()
    first = len(trainer.state.log_history)
    assert cb.pipeline.lr_controller.trigger_steps == [3]
    trainer.train()
    second = trainer.state.log_history
    assert len(second) == first  # transformers' own log restarted with the run
    lrs = {h["step"]: h["learning_rate"] for h in second if "learning_rate" in h}
    for step in range(1, n + 1):
        unscaled = LR0 * (1 - (step - 1) / n)  # transformers' linear schedule, LR used at this step
        scale = 0.5 if step > 3 else 1.0  # this run's own trigger at the end of step 3
        assert lrs[step] == pytest.approx(unscaled * scale, rel=1e-6), step
    assert [_logged(trainer, s).get("tim/lr/stale", 0.0) for s in range(1, n + 1)] == [0.0] * n
    assert _logged(trainer, 3)["tim/lr/triggered"] == 1.0
    assert cb.pipeline.lr_controller.trigger_steps == [3]


@pytest.mark.parametrize("overrides", [{}, {"steps_per_generation": 2}], ids=["aligned", "old-logps"])
def test_mitigations_add_no_forward(toy_model_path, tmp_path, overrides):
    """Safe vocabulary + an IS correction run TRL's scoring forwards and no other: one per loss micro-batch, plus
    one per generation batch where TRL itself computes ``old_per_token_logps`` (generation misaligned with the
    optimizer step), as TRL's plain run does."""
    trainer = make_trainer(toy_model_path, tmp_path, min_p=MIN_P, max_steps=2, **overrides)
    cap = Capture(trainer)
    calls = []
    inner = trainer._get_per_token_logps_and_entropies

    def counting(*a, **k):
        calls.append(torch.is_grad_enabled())
        return inner(*a, **k)

    trainer._get_per_token_logps_and_entropies = counting
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, 
        safe_vocab=True, is_correction="token_tis", rollout="inject",
        inject_options={"scale": 1.0, "tau": 0.5, "mode": "bias", "seed": 0})))
    trainer.train()
    old_logps = "old_per_token_logps" in cap.trl_built[0]
    assert old_logps == bool(overrides)
    assert sum(calls) == len(cap.losses)  # grad-enabled: the loss forwards
    assert len(calls) - sum(calls) == (len(cap.generations) if old_logps else 0)
    logged = _logged(trainer, 1)
    assert logged["tim/correction/kept_frac"] == 1.0 and logged["tim/safe_vocab/tokens"] > 0


def _inject_run(toy_model_path, out, n, **overrides):
    trainer = make_trainer(toy_model_path, out, max_steps=n, **overrides)
    cb = TIMCallback(trainer, TIMConfig(rollout="inject", inject_options={"scale": 2.0, "tau": 0.5, "seed": 3},
                                        parity_audit=False))
    trainer.add_callback(cb)
    return trainer, cb


def _tim_rows(trainer, steps) -> dict:
    return {s: {k: v for k, v in _logged(trainer, s).items() if k.startswith("tim/token/") or k == "tim/tokens"}
            for s in steps}


def test_a_resumed_injected_run_draws_the_noise_the_uninterrupted_run_draws(toy_model_path, tmp_path):
    """rollout='inject': the injector's noise generator rides in the checkpoint, so the steps after a resume draw
    what the uninterrupted run drew there (the reference: that run's logged tim/token/* rows, step by step), not
    the seed's first draws again; and a second ``train()`` without a checkpoint starts the noise (and the exact
    sampler's generation count) over at the seed, as the first ``train()`` did."""
    n, k = 4, 2
    full, full_cb = _inject_run(toy_model_path, tmp_path / "full", n)
    full.train()
    want = _tim_rows(full, range(1, n + 1))
    assert all(row.get("tim/tokens", 0) > 0 for row in want.values())
    first, _ = _inject_run(toy_model_path, tmp_path / "resumed", n, save_strategy="steps", save_steps=k)
    first.add_callback(_StopAt(k))
    first.train()
    second, _ = _inject_run(toy_model_path, tmp_path / "resumed", n)
    second.train(resume_from_checkpoint=str(tmp_path / "resumed" / "out" / f"checkpoint-{k}"))
    got = _tim_rows(second, range(k + 1, n + 1))
    for step, row in got.items():
        assert row.keys() == want[step].keys() and all(row[key] == pytest.approx(want[step][key], rel=1e-5, abs=1e-9)
                                                      for key in row), step
    # the noise matters here: the steps after the resume differ from the steps the seed's first draws made
    assert got[k + 1]["tim/token/kl_k3"] != pytest.approx(want[1]["tim/token/kl_k3"], rel=1e-3)

    class AtBegin(TrainerCallback):  # after the TIM callback's on_train_begin: what the new run starts from
        def on_train_begin(self, args, state, control, **kwargs):
            seen.append((full_cb.injector.state_dict(), full_cb.generation_count))

    seen = []
    full.add_callback(AtBegin())
    assert full_cb.injector.state_dict() != TailNoiseInjector(seed=3).state_dict()  # the first run drew
    full.train()
    assert seen == [(TailNoiseInjector(seed=3).state_dict(), 0)]
