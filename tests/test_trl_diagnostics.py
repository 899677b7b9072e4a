"""Diagnostic rollout choices (exact sampler, injector), the Parquet dump, wandb histograms and the live
parity probe through TIMCallback on a real TRL GRPOTrainer (CPU, toy model)."""

from __future__ import annotations

from html import escape as html_escape

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl_callback import Capture, _check_against_reference, _logged, _loss_mask, make_trainer  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.integrations.trl._parity import run_audit  # noqa: E402

pytestmark = pytest.mark.trl


def test_exact_rollouts_refuse_a_truncating_sampler_with_the_settings_that_fix_it(toy_model_path, tmp_path):
    """The exact sampler draws from softmax(logits/T) alone: with GRPOConfig's top-p and repetition penalty on it
    fails when the callback is built, naming the values and the fix; with the printed GRPOConfig it builds."""
    trainer = make_trainer(toy_model_path, tmp_path, top_p=0.8, repetition_penalty=1.2)
    with pytest.raises(ValueError) as err:
        TIMCallback(trainer, TIMConfig(rollout="exact"))
    assert "{'top_p': 0.8, 'repetition_penalty': 1.2}" in str(err.value), err.value
    assert "Fix: GRPOConfig(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)" in str(err.value), err.value
    fixed = make_trainer(toy_model_path, tmp_path / "fixed", top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    TIMCallback(fixed, TIMConfig(rollout="exact"))  # no error


def test_exact_rollouts_feed_the_monitor(toy_model_path, tmp_path):
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    generations = []  # what TRL's generation step returned (installed before the callback wraps it)
    generate = trainer._generate_and_score_completions

    def record(*args, **kwargs):
        out = generate(*args, **kwargs)
        generations.append(out)
        return out

    trainer._generate_and_score_completions = record
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, rollout="exact")))
    trainer.train()
    # The trainer scores with the sampler's ops at the sampler's buffer shape (the exact scorer replaces
    # TRL's fused-head scoring, so the loss-side capture sees nothing): bitwise zero mismatch.
    logged = _logged(trainer, 1)
    assert logged["tim/token/kl_k3"] == 0.0 and logged["tim/token/abs_diff_max"] == 0.0
    assert logged["tim/seq/log_ratio_abs_max"] == 0.0
    rollout = torch.cat([out["sampling_per_token_logps"][_loss_mask(out)] for out in generations])
    assert logged["tim/tokens"] == rollout.numel() > 0
    assert rollout.min() < -1e-3  # real sampled log-probs, not a degenerate all-zero pair


def test_injected_mismatch_is_measured(toy_model_path, tmp_path):
    base = make_trainer(toy_model_path, tmp_path / "base", max_steps=1)
    base.add_callback(TIMCallback(base, TIMConfig(log_detail=True)))
    base.train()
    trainer = make_trainer(toy_model_path, tmp_path / "inj", max_steps=1)
    cap = Capture(trainer)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, 
        rollout="inject", inject_options={"scale": 1.0, "tau": 0.5, "mode": "bias", "seed": 0})))
    trainer.train()
    assert _check_against_reference(trainer, cap) == 1
    k3_inj = _logged(trainer, 1)["tim/token/kl_k3"]
    k3_base = _logged(base, 1)["tim/token/kl_k3"]
    assert k3_inj > 1e-3 > 1e-9 > k3_base


def test_parquet_dump_rows_match_tensors(toy_model_path, tmp_path):
    from tim_plugins.dump import read_dump

    out = tmp_path / "dump"
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    cap = Capture(trainer)
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, dump_dir=str(out), dump_options={"sample_rate": 1.0}))  # every sequence
    trainer.add_callback(cb)
    trainer.train()
    table = read_dump(out)
    from report_reference import assert_same_numbers

    assert_same_numbers(out)  # the report's streaming queries equal the in-memory computation on TRL's own dump
    df = table.to_pandas() if hasattr(table, "to_pandas") else table
    (_, inputs, logps), = cap.losses
    mask = _loss_mask(inputs)
    assert len(df) == int(mask.sum())
    # Row by row, at the dump's own (sequence, position): exactly the loss tensors TRL built and scored (the
    # rollout and train log-probs differ by ~1e-6 here, so only an exact, paired check tells them apart).
    s, p = torch.tensor(df["sequence"].tolist()), torch.tensor(df["position"].tolist())
    assert bool(mask[s, p].all()) and len(set(zip(s.tolist(), p.tolist()))) == len(df)
    assert torch.equal(torch.tensor(df["train_logprob"].tolist(), dtype=torch.float32), logps.float()[s, p])
    assert torch.equal(torch.tensor(df["rollout_logprob"].tolist(), dtype=torch.float32),
                       inputs["sampling_per_token_logps"].float()[s, p])
    assert torch.equal(torch.tensor(df["token_id"].tolist()), inputs["completion_ids"][s, p].cpu())
    # beside the dump, the run's summary: `tim-plugins report DUMP_DIR` renders the audit with TRL's fixes
    import json

    from tim_plugins.integrations.trl.fixes import FINDING_FIXES
    from tim_plugins.report import build_report

    summary = json.loads((out / "summary.json").read_text())
    assert summary["framework"] == "trl" and summary["settings"]["model"] == str(toy_model_path)
    assert [f["code"] for f in summary["findings"]] == [f.code for f in cb.findings]
    html = build_report(out).read_text()
    assert "fix (TRL)" in html and "Training-inference mismatch report (TRL run)" in html
    fixed = [f.code for f in cb.findings if f.code in FINDING_FIXES]
    assert fixed and all(html_escape(FINDING_FIXES[code]) in html for code in fixed)


# Between the toy model's fp32 noise (max |Δ log p| ~1e-6: KV-cache decode vs full forward) and the injected
# mismatch (k3 > 1e-3, so max |Δ log p| > 0.04; test_injected_mismatch_is_measured): the probe must stay quiet on
# the first and stop the second, so it fails if it misfires either way.
PROBE_ABS_DIFF_MAX = 1e-3


@pytest.mark.parametrize("rollout", ["hf", "inject"])
def test_probe_stops_training_gracefully_only_past_its_threshold(toy_model_path, tmp_path, rollout):
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=3)
    inject = {"inject_options": {"scale": 1.0, "tau": 0.5, "mode": "bias", "seed": 0}} if rollout == "inject" else {}
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, 
        rollout=rollout, **inject, parity_probe=True,
        parity_probe_options={"kl_k3_max": None, "abs_diff_max": PROBE_ABS_DIFF_MAX, "action": "stop"})))
    trainer.train()
    steps = [_logged(trainer, s) for s in range(1, trainer.state.global_step + 1)]
    if rollout == "hf":
        assert trainer.state.global_step == 3
        assert all(h["tim/token/abs_diff_max"] < PROBE_ABS_DIFF_MAX for h in steps)
        assert [h["tim/probe/tripped"] for h in steps] == [0.0, 0.0, 0.0]
    else:
        assert trainer.state.global_step == 1
        assert steps[0]["tim/token/abs_diff_max"] > PROBE_ABS_DIFF_MAX
        assert steps[0]["tim/probe/tripped"] == 1.0


def test_a_probe_raise_logs_the_tripped_step_first(toy_model_path, tmp_path):
    """action="raise": ``train()`` raises ``ParityError`` at the first step past the limit, and that step's row is
    in TRL's log history (with TRL's own window metrics: its reward) and in the dump's log history, with the value
    that tripped; nothing raises on the step before."""
    from tim_plugins.dump import LOG_HISTORY, read_log_history
    from tim_plugins.parity.findings import ParityError

    trainer = make_trainer(toy_model_path, tmp_path, max_steps=3)
    dump = tmp_path / "dump"
    trainer.add_callback(TIMCallback(trainer, TIMConfig(
        rollout="inject", inject_options={"scale": 1.0, "tau": 0.5, "mode": "bias", "seed": 0}, dump_dir=str(dump),
        parity_probe=True, parity_probe_options={"kl_k3_max": None, "abs_diff_max": PROBE_ABS_DIFF_MAX,
                                                 "action": "raise"})))
    with pytest.raises(ParityError, match=r"tim/token/abs_diff_max=") as err:
        trainer.train()
    assert err.value.trip.step == 1
    (row,) = [h for h in trainer.state.log_history if "tim/probe/tripped" in h]
    (dumped,) = read_log_history(dump / LOG_HISTORY)
    assert row["step"] == dumped["step"] == 1 and row["tim/probe/tripped"] == dumped["tim/probe/tripped"] == 1.0
    assert dumped["tim/token/abs_diff_max"] > PROBE_ABS_DIFF_MAX and "reward" in row
    logged = [k for k in row if k.startswith("tim/")]
    assert len(logged) > 2 and all(row[k] == pytest.approx(dumped[k], rel=1e-12) for k in logged)


INJECT = {"rollout": "inject", "inject_options": {"scale": 1.0, "tau": 0.5, "mode": "bias", "seed": 0}}


def _probe_run(model_path, tmp_path, probe_options, causes=True, **overrides):
    """A toy run whose every measured window is past the probe's limit (the injected mismatch), stopping on a trip."""
    trainer = make_trainer(model_path, tmp_path, **overrides)
    options = {"kl_k3_max": None, "abs_diff_max": PROBE_ABS_DIFF_MAX, "action": "stop", **probe_options}
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, **INJECT, causes=causes, parity_probe=True,
                                        parity_probe_options=options))
    trainer.add_callback(cb)
    trainer.train()
    rows = [h for h in trainer.state.log_history if "tim/probe/checked" in h]
    return trainer, cb, rows


@pytest.mark.parametrize("logging_steps,every_n_steps,stop_at", [(3, 2, 3), (2, 3, 4)])
def test_the_probe_judges_each_logging_window_that_holds_a_due_step(toy_model_path, tmp_path, logging_steps,
                                                                    every_n_steps, stop_at):
    """The probe reads the metrics TRL logs, one logging window at a time: a window is checked when it holds a
    multiple of ``every_n_steps``, so ``logging_steps=3`` with ``every_n_steps=2`` stops at the first window (steps
    1-3 hold step 2; ``step % 2`` at the logging steps alone would first check at step 6, after this 5-step run), and
    ``logging_steps=2`` with ``every_n_steps=3`` at the second (steps 3-4 hold step 3). Reference: the naive rule over
    the windows TRL logged, each of which is past the limit."""
    trainer, cb, rows = _probe_run(toy_model_path, tmp_path, {"every_n_steps": every_n_steps}, max_steps=5,
                                   logging_steps=logging_steps)
    assert all(h["tim/token/abs_diff_max"] > PROBE_ABS_DIFF_MAX for h in rows)
    windows = [h["step"] for h in rows]
    assert windows == list(range(logging_steps, stop_at + 1, logging_steps))  # TRL logged these windows
    starts = [0] + windows[:-1]
    due = [any(m % every_n_steps == 0 for m in range(a + 1, b + 1)) for a, b in zip(starts, windows)]
    assert [h["tim/probe/checked"] for h in rows] == [float(d) for d in due]
    assert due[-1] and not any(due[:-1])
    assert trainer.state.global_step == stop_at and cb.pipeline.probe.num_checks == 1
    assert rows[-1]["tim/probe/tripped"] == 1.0


def test_a_probe_on_a_run_that_never_logs_is_refused_when_training_starts(toy_model_path, tmp_path):
    """``logging_strategy="no"``: the probe, which judges logging windows, would check once, after the last step.
    ``train()`` refuses before the first step and before any hook is installed, naming the value and the fix."""
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=2, logging_strategy="no")
    cb = TIMCallback(trainer, TIMConfig(parity_probe=True))
    trainer.add_callback(cb)
    with pytest.raises(ValueError, match=r"logging_strategy='no'.*Fix: GRPOConfig\(logging_strategy='steps'"):
        trainer.train()
    assert trainer.state.global_step == 0 and cb.installed == []
    monitor_only = make_trainer(toy_model_path, tmp_path / "monitor", max_steps=1, logging_strategy="no")
    monitor_only.add_callback(TIMCallback(monitor_only, TIMConfig()))
    monitor_only.train()  # without the probe nothing needs a logging window
    assert monitor_only.state.global_step == 1


@pytest.mark.parametrize("overrides", [{"num_iterations": 2}, {"steps_per_generation": 2}],
                         ids=["num_iterations", "steps_per_generation"])
def test_probe_patience_counts_the_windows_that_measured_tokens(toy_model_path, tmp_path, overrides):
    """With a batch trained over two optimizer steps, the second step measures nothing (no ``tim/token/*`` in its
    row): that window is no check, so ``patience=2`` acts at the second measured window, step 3. Before, the empty
    window reset the count and the probe never acted. Reference: the rows TRL logged with a measured value. (The
    causes are off: the injected mismatch trained over twice names a staleness cause, which acts without patience.)"""
    trainer, cb, rows = _probe_run(toy_model_path, tmp_path, {"patience": 2}, causes=False, max_steps=6,
                                   **overrides)
    measured = [h["step"] for h in rows if "tim/token/abs_diff_max" in h]
    assert measured[:2] == [1, 3] and all(h["tim/token/abs_diff_max"] > PROBE_ABS_DIFF_MAX for h in rows
                                          if "tim/token/abs_diff_max" in h)
    assert trainer.state.global_step == measured[1] == 3
    assert [h["tim/probe/checked"] for h in rows] == [1.0, 0.0, 1.0]
    assert [h["tim/probe/tripped"] for h in rows] == [1.0, 0.0, 1.0] and cb.pipeline.probe.num_checks == 2


def test_a_measurement_that_fails_costs_its_statistics_not_the_step(toy_model_path, tmp_path, monkeypatch):
    """The measurement and the staleness split made to raise (fault injection, standing in for a batch layout this
    code does not know): training runs as an unbroken run does (the same losses, seed for seed) and the failures are
    counted under tim/diag/measure_failed; with an IS correction configured a failing measurement raises (the loss
    would otherwise run uncorrected)."""
    import tim_plugins.integrations.trl.callback as callback_module

    def broken(*args, **kwargs):
        raise RuntimeError("a batch layout this code does not know")

    losses = {}
    for fault in (False, True):
        trainer = make_trainer(toy_model_path, tmp_path / str(fault), max_steps=2, num_iterations=2)
        cb = TIMCallback(trainer, TIMConfig(log_detail=True))
        trainer.add_callback(cb)
        with monkeypatch.context() as patch:
            if fault:
                patch.setattr(cb.pipeline, "measure", broken)
                patch.setattr(callback_module.translate, "loss_pass_inputs", broken)
            trainer.train()
        losses[fault] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        rows = [h for h in trainer.state.log_history if "loss" in h]
    assert losses[True] == losses[False] and len(losses[True]) == 2
    assert rows[-1]["tim/diag/measure_failed"] >= 2 and "tim/token/kl_k3" not in rows[0]
    trainer = make_trainer(toy_model_path, tmp_path / "is", max_steps=1)
    cb = TIMCallback(trainer, TIMConfig(is_correction="token_tis"))
    trainer.add_callback(cb)
    monkeypatch.setattr(cb.pipeline, "measure", broken)
    with pytest.raises(RuntimeError, match="a batch layout this code does not know"):
        trainer.train()


def test_wandb_histograms(toy_model_path, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    from wandb.sdk.wandb_run import Run

    logged = []
    real_log = Run.log

    def recording_log(self, data, *a, **k):  # the real Run.log, with its payload kept for the check
        logged.append(dict(data))
        return real_log(self, data, *a, **k)

    monkeypatch.setattr(Run, "log", recording_log)
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, report_to=["wandb"])
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True)))
    trainer.train()
    wandb.finish()
    hist = next(d for d in logged if "tim/hist/abs_diff" in d)
    tokens = _logged(trainer, 1)["tim/tokens"]
    assert sum(hist["tim/hist/abs_diff"].histogram) == tokens
    assert sum(hist["tim/hist/ratio"].histogram) == tokens


@pytest.mark.parametrize("overrides,level", [({}, "INFO"), ({"repetition_penalty": 1.3}, "ERROR")])
def test_parity_audit_logged_at_its_worst_findings_level(toy_model_path, tmp_path, caplog, overrides, level):
    trainer = make_trainer(toy_model_path, tmp_path, **overrides)
    with caplog.at_level("DEBUG", logger="tim_plugins.trl"):
        findings, _, _ = run_audit(trainer, "hf")
    (record,) = [r for r in caplog.records if "parity audit" in r.getMessage()]
    severities = {f.severity for f in findings}
    # The reference: the worst severity among the findings (an HF rollout with matched knobs has info only).
    worst = next((s for s in ("error", "warning", "info") if s in severities), "info")
    assert record.levelname == level == worst.upper()
    # the one table format (tim_plugins.parity.table), under the title line with the counts
    from tim_plugins.parity.table import findings_table

    n = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
    assert record.getMessage() == (
        f"tim_plugins parity audit (hf rollouts vs TRL trainer): {n['error']} error(s), {n['warning']} warning(s), "
        f"{n['info']} info\n" + findings_table(findings, framework="trl"))


class _RenamingTrainer:
    """A GRPOTrainer subclass (built by ``_renaming``) whose batches carry one of TRL's keys under its own name: its
    ``_prepare_inputs`` renames it, its ``_compute_loss`` hands TRL's loss the batch as TRL names it, so TRL's loss is
    TRL's own and only the batch the callback reads between them is one it does not know."""

    key = "completion_mask"

    def _prepare_inputs(self, generation_batch):
        inputs = dict(super()._prepare_inputs(generation_batch))
        inputs[f"my_{self.key}"] = inputs.pop(self.key)
        return inputs

    def _compute_loss(self, model, inputs):
        renamed = dict(inputs)
        renamed[self.key] = renamed.pop(f"my_{self.key}")
        return super()._compute_loss(model, renamed)


def _renaming(key: str) -> type:
    from trl import GRPOTrainer

    return type("RenamingTrainer", (_RenamingTrainer, GRPOTrainer), {"key": key})


@pytest.mark.parametrize("key,options,reference", [
    # the monitor alone: reference, the same subclass without the callback
    ("completion_mask", {}, None),
    # the safe vocabulary's boundary mask, which cannot reach a batch without TRL's advantages: reference, the safe
    # vocabulary with boundary tokens left in the loss (TRL's loss over the safe-vocabulary log-probs)
    ("advantages", {"safe_vocab": True}, {"safe_vocab": True, "mask_boundary_tokens": False}),
])
def test_a_loss_batch_the_adapter_cannot_read_costs_its_statistics_not_the_step(toy_model_path, tmp_path, key,
                                                                                options, reference):
    """A GRPOTrainer subclass hands ``_compute_loss`` a batch whose keys the callback does not know: each loss forward
    is counted under tim/diag/loss_batch_unread and the step trains with TRL's own loss, the same losses seed for
    seed as the reference run (before, the callback's KeyError ended train())."""
    sampler = {"min_p": 0.05} if options.get("safe_vocab") else {}
    losses = {}
    for name, trainer_cls, config in (("tim", _renaming(key), options),
                                      ("reference", _renaming(key) if reference is None else None, reference)):
        trainer = make_trainer(toy_model_path, tmp_path / name, trainer_cls=trainer_cls, max_steps=2, **sampler)
        if config is not None:
            trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, **config)))
        trainer.train()
        rows = [h for h in trainer.state.log_history if "loss" in h]
        losses[name] = [h["loss"] for h in rows]
        if name == "tim":
            assert rows[-1]["tim/diag/loss_batch_unread"] == 2.0  # one loss forward per step
            assert "tim/diag/measure_failed" not in rows[-1]
    assert losses["tim"] == losses["reference"] and len(losses["tim"]) == 2


def test_a_loss_batch_the_adapter_cannot_read_raises_with_an_is_correction(toy_model_path, tmp_path):
    """With an IS correction the loss needs the callback's weights: a batch it cannot read would train uncorrected,
    so ``train()`` raises, saying so."""
    trainer = make_trainer(toy_model_path, tmp_path, trainer_cls=_renaming("completion_mask"), max_steps=1)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(is_correction="token_tis")))
    with pytest.raises(RuntimeError, match=r"is_correction='token_tis'.*uncorrected.*'completion_mask'"):
        trainer.train()


def _audited_codes(trainer) -> dict:
    """{finding code: finding} of the parity audit of ``trainer``'s transformers generation against its trainer."""
    from tim_plugins.integrations.trl.parity_spec import specs_from_trainer
    from tim_plugins.parity import audit

    return {f.code: f for f in audit(*specs_from_trainer(trainer, rollout_source="hf"))}


def test_the_printed_temperature_fix_clears_the_finding(toy_model_path, tmp_path):
    """A temperature in generation_kwargs samples at it while the trainer divides by GRPOConfig.temperature: the
    audit names it, and the TRL fix it prints (set it once in GRPOConfig, none in generation_kwargs) clears it."""
    from tim_plugins.integrations.trl.fixes import FINDING_FIXES

    trainer = make_trainer(toy_model_path, tmp_path, temperature=0.7, generation_kwargs={"temperature": 1.0})
    found = _audited_codes(trainer)
    assert "temperature-mismatch" in found, list(found)
    assert "GRPOConfig(temperature=T)" in FINDING_FIXES["temperature-mismatch"]
    assert "drop 'temperature' from generation_kwargs" in FINDING_FIXES["temperature-mismatch"]
    fixed = make_trainer(toy_model_path, tmp_path / "fixed", temperature=0.7, generation_kwargs={})
    assert "temperature-mismatch" not in _audited_codes(fixed)


def test_the_printed_penalty_fix_clears_a_setting_the_models_generation_config_brings(toy_model_path, tmp_path):
    """With use_vllm=False transformers fills what TRL's GenerationConfig leaves None from the model's own
    generation_config: a no_repeat_ngram_size there is named with nothing in generation_kwargs to drop. The neutral
    value in generation_kwargs, as the printed fix says, clears it."""
    import json
    import shutil

    from tim_plugins.integrations.trl.fixes import FINDING_FIXES

    model = tmp_path / "model"
    shutil.copytree(toy_model_path, model)
    gen_path = model / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen_path.write_text(json.dumps({**gen, "no_repeat_ngram_size": 3}))
    trainer = make_trainer(model, tmp_path / "a", generation_kwargs={})
    found = _audited_codes(trainer)
    assert "sampler-penalties-unmatched" in found, list(found)
    assert "no_repeat_ngram_size" in str(found["sampler-penalties-unmatched"].rollout_value)
    assert "{'no_repeat_ngram_size': 0" in FINDING_FIXES["sampler-penalties-unmatched"]
    fixed = make_trainer(model, tmp_path / "b", generation_kwargs={"no_repeat_ngram_size": 0})
    assert "sampler-penalties-unmatched" not in _audited_codes(fixed)
