"""TIMConfig and TIMCallback refuse what cannot work, early, with the value, the rule and the fix; options that do
nothing are warned about; the safe vocabulary cuts where TRL's sampler cuts (generation_kwargs included).

The trainer-side cases build a real toy GRPOTrainer (CPU). References are independent of the adapter: the core's own
``LRDecayConfig`` and ``CorrectionConfig``, TRL's own ``GenerationConfig`` (what its sampler runs with), and the
sampler's own processed log-probs against the trainer's.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_trl_callback import make_trainer  # noqa: E402

from tim_plugins.corrections import CorrectionConfig  # noqa: E402
from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.integrations.trl.callback import TIMState  # noqa: E402
from tim_plugins.integrations.trl.config import IS_CORRECTION_CHOICES  # noqa: E402
from tim_plugins.lr_control import LRDecayConfig  # noqa: E402

pytestmark = pytest.mark.trl


# ------------------------------------------------------------------------------------ is_correction="none"
@pytest.mark.parametrize("value", ["none", " none "])
def test_the_string_none_is_refused_with_the_fix_none(value):
    """None is the field's "no correction" (IS_CORRECTION_CHOICES leaves the core's 'none' out): the string would run
    the correction pass with weights 1 and, with vLLM, refuse a run that asked for nothing."""
    assert "none" not in IS_CORRECTION_CHOICES
    with pytest.raises(ValueError) as err:
        TIMConfig(is_correction=value)
    msg = str(err.value)
    assert msg.startswith(f"TIMConfig.is_correction={value!r} is invalid"), msg
    assert msg.endswith("Fix: is_correction=None"), msg
    assert TIMConfig(is_correction=None).is_correction_options is None


# ------------------------------------------------------------------- a CorrectionConfig in is_correction_options
def test_a_correction_config_instance_is_treated_like_a_dict_of_its_thresholds():
    band = (0.8, 1.25)
    instance = CorrectionConfig(mode="icepop", icepop_band=band)
    # alone: refused as a dict of thresholds is, the fix naming the instance's mode (it was silently dropped)
    with pytest.raises(ValueError) as err:
        TIMConfig(is_correction_options=instance)
    msg = str(err.value)
    assert "is invalid with is_correction=None" in msg and "Fix: is_correction='icepop'" in msg, msg
    with pytest.raises(ValueError, match=r"is invalid with is_correction=None.*Fix: is_correction='token_tis'"):
        TIMConfig(is_correction_options={"icepop_band": band})
    # another mode than is_correction: refused naming both (the instance's mode was overwritten)
    with pytest.raises(ValueError) as err:
        TIMConfig(is_correction="token_tis", is_correction_options=instance)
    msg = str(err.value)
    assert "is_correction='token_tis'" in msg and "is_correction_options.mode='icepop'" in msg, msg
    assert "disagree" in msg and "Fix: " in msg, msg
    # the same mode: its thresholds kept, exactly as the dict of them gives
    cfg = TIMConfig(is_correction="icepop", is_correction_options=instance)
    assert cfg.is_correction_options == instance == TIMConfig(
        is_correction="icepop", is_correction_options={"icepop_band": band}).is_correction_options
    # a combination spelt with spaces is the same mode as the core writes it
    assert TIMConfig(is_correction="geo_rs + token_tis",
                     is_correction_options=CorrectionConfig(mode="geo_rs+token_tis")).is_correction_options.mode \
        == "geo_rs+token_tis"


# ---------------------------------------------------------------------- options of a feature switched off
@pytest.mark.parametrize("kwargs, field, given, off, fix", [
    ({"lr_decay_options": {"window": 3}}, "lr_decay_options", {"window": 3}, "lr_decay=False", "lr_decay=True"),
    ({"lr_decay_signals": ("k3",)}, "lr_decay_signals", ("k3",), "lr_decay=False", "lr_decay=True"),
    ({"dump_options": {"sample_rate": 0.5}}, "dump_options", {"sample_rate": 0.5}, "dump_dir=None",
     "dump_dir='/path/to/tim_dump'"),
    ({"dump_dir": "", "dump_options": {"sample_rate": 0.5}}, "dump_options", {"sample_rate": 0.5}, "dump_dir=''",
     "dump_dir='/path/to/tim_dump'"),
    ({"safe_vocab_min_p": 0.05}, "safe_vocab_min_p", 0.05, "safe_vocab=False", "safe_vocab=True"),
    ({"mask_boundary_tokens": False}, "mask_boundary_tokens", False, "safe_vocab=False", "safe_vocab=True"),
])
def test_options_of_a_switched_off_feature_get_the_does_nothing_warning(kwargs, field, given, off, fix, caplog,
                                                                         tmp_path):
    """As the probe's and the sync check's groups: one line naming the options, the switch and the fix; the
    switch on is quiet, and so is every default."""
    with caplog.at_level(logging.WARNING, logger="tim_plugins.trl"):
        TIMConfig(**kwargs)
        warned = [r.getMessage() for r in caplog.records]
        caplog.clear()
        switched_on = {"lr_decay": True} if "lr_decay" in off else {"safe_vocab": True} if "safe_vocab" in off else \
            {"dump_dir": str(tmp_path)}
        TIMConfig(**{**kwargs, **switched_on})
        TIMConfig()
        assert caplog.records == []
    assert warned == [f"TIMConfig.{field}={given!r} while {off}: this setting does nothing. Fix: {fix}"]


def test_signals_named_by_lr_decay_signals_are_warned_about_once(caplog):
    """lr_decay_signals fills lr_decay_options.signals: one setting, one line (under the field the user set)."""
    with caplog.at_level(logging.WARNING, logger="tim_plugins.trl"):
        TIMConfig(lr_decay_signals="k3", lr_decay_options={"window": 3})
    assert [r.getMessage() for r in caplog.records] == [
        "TIMConfig.lr_decay_options={'window': 3} while lr_decay=False: this setting does nothing. Fix: lr_decay=True",
        "TIMConfig.lr_decay_signals=('k3',) while lr_decay=False: this setting does nothing. Fix: lr_decay=True"]


# ----------------------------------------------------------------------------------- lr_decay_signals
@pytest.mark.parametrize("spelling", ["k3", "k3, grad_norm", "tim/token/kl_k3,grad_norm"])
def test_lr_decay_signals_takes_a_string_as_lr_decay_config_does(spelling):
    core = LRDecayConfig(signals=spelling).signals  # the core's reading of the same string
    cfg = TIMConfig(lr_decay=True, lr_decay_signals=spelling)
    assert cfg.lr_decay_options.signals == core
    assert TIMConfig(lr_decay=True, lr_decay_options={"signals": spelling}).lr_decay_options == cfg.lr_decay_options


@pytest.mark.parametrize("value, rule", [
    (None, "must be a list of signal names"), (3, "must be a list of signal names"),
    ({"k3": 1}, "must be a list of signal names"), ([3], "must be a list of signal names"),
    ("k3,loss", "contains 'loss'"), (["loss"], "contains 'loss'"),
])
def test_a_bad_lr_decay_signals_names_the_value_given_the_rule_and_the_fix(value, rule):
    with pytest.raises(ValueError) as err:
        TIMConfig(lr_decay=True, lr_decay_signals=value)
    msg = str(err.value)
    assert msg.startswith(f"TIMConfig.lr_decay_signals={value!r} is invalid: "), msg
    said, _, fix = msg.partition(" Fix: ")
    assert rule in said, msg
    assert fix.startswith("lr_decay_signals=('kl_k3',)"), msg


# ------------------------------------------------------------------------------------ exact + safe_vocab
def test_the_exact_sampler_with_the_safe_vocabulary_is_refused_in_one_message():
    with pytest.raises(ValueError) as err:
        TIMConfig(rollout="exact", safe_vocab=True, safe_vocab_min_p=0.05)
    msg = str(err.value)
    assert msg.startswith("TIMConfig.rollout='exact' with safe_vocab=True is invalid"), msg
    assert "full softmax" in msg and "no kept set" in msg, msg
    assert msg.split(" Fix: ")[1].startswith("safe_vocab=False"), msg
    TIMConfig(rollout="exact")  # each alone is fine
    TIMConfig(safe_vocab=True)


# ----------------------------------------------------------- a correction where no rollout log-probs exist
@pytest.mark.parametrize("overrides, named, fix", [
    ({"use_transformers_continuous_batching": True}, "use_transformers_continuous_batching=True",
     "use_transformers_continuous_batching=False"),
    ({"generation_kwargs": {"num_beams": 2}}, "generation_kwargs={'num_beams': 2}",
     "drop 'num_beams' from generation_kwargs"),
    ({"generation_kwargs": {"prompt_lookup_num_tokens": 2}}, "generation_kwargs={'prompt_lookup_num_tokens': 2}",
     "drop 'prompt_lookup_num_tokens' from generation_kwargs"),
], ids=["continuous-batching", "beam-search", "assisted"])
def test_a_correction_without_rollout_log_probs_is_refused_at_attach(toy_model_path, tmp_path, overrides, named,
                                                                     fix):
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, **overrides)
    with pytest.raises(ValueError) as err:
        TIMCallback(trainer, TIMConfig(is_correction="icepop"))
    msg = str(err.value)
    assert msg.startswith(f"TIMConfig.is_correction='icepop' with GRPOConfig.{named} is invalid"), msg
    assert "would train uncorrected" in msg, msg
    assert f"Fix: {fix}" in msg and msg.endswith("or is_correction=None"), msg
    assert not any(isinstance(cb, TIMState) for cb in trainer.callback_handler.callbacks)  # nothing left behind
    TIMCallback(trainer, TIMConfig())  # the monitor alone attaches: such batches are counted, not measured


def _rollout_func_without_logprobs(prompts, trainer):
    """A GRPOTrainer rollout_func (TRL's own hook) that hands TRL completions but no log-probs."""
    tok = trainer.processing_class
    return {"prompt_ids": [tok(p)["input_ids"] for p in prompts],
            "completion_ids": [[5, 6, tok.eos_token_id] for _ in prompts], "logprobs": None}


@pytest.mark.parametrize("route", ["model-generation-config-beams", "rollout-func"])
def test_a_batch_without_rollout_log_probs_raises_with_a_correction_and_is_counted_without(toy_model_path, tmp_path,
                                                                                        route, monkeypatch):
    """What shows only at generation: beam search set in the model's own generation config (TRL's GenerationConfig
    leaves num_beams at its default, so transformers takes the model's), or a rollout_func returning no
    log-probs. With a correction the loss would train uncorrected: train() raises (it was only counted); without
    one the batch is counted, as before, and training goes on."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's documented experimental hook

    def trainer_for(out):
        trainer = make_trainer(toy_model_path, tmp_path / out, max_steps=1)
        if route == "rollout-func":
            trainer.rollout_func = _rollout_func_without_logprobs
        else:
            trainer.model.generation_config.num_beams = 2
        return trainer

    trainer = trainer_for("corrected")
    cb = TIMCallback(trainer, TIMConfig(is_correction="token_tis"))
    trainer.add_callback(cb)
    with pytest.raises(RuntimeError) as err:
        trainer.train()
    msg = str(err.value)
    assert "TIMConfig(is_correction='token_tis')" in msg and "generation batch of step 1 has none" in msg, msg
    assert ("rollout_func" if route == "rollout-func" else "decoding mode the recorder cannot follow") in msg, msg
    assert msg.endswith("or is_correction=None"), msg
    assert trainer.state.global_step == 0 and cb.installed == []  # no step trained; TRL's methods put back

    trainer = trainer_for("monitor")
    trainer.add_callback(TIMCallback(trainer, TIMConfig()))
    trainer.train()
    key = "tim/diag/no_rollout_logprobs" if route == "rollout-func" else "tim/diag/unsupported_generation_mode"
    assert trainer.state.global_step == 1
    assert [h[key] for h in trainer.state.log_history if key in h] == [1.0]


# ----------------------------------------------------------------- the safe vocabulary and generation_kwargs
def test_generation_kwargs_top_k_is_a_cut_the_safe_vocabulary_takes(toy_model_path, tmp_path):
    """TRL lays generation_kwargs over its sampler settings: top_k=5 there is a cut (it was refused as "this sampler
    keeps the whole vocabulary"); the trainer's cut is the sampler's own setting."""
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, generation_kwargs={"top_k": 5})
    assert (trainer.args.top_k or 0) == 0 and trainer.generation_config.top_k == 5  # what TRL's generate runs
    cb = TIMCallback(trainer, TIMConfig(safe_vocab=True))
    assert cb.truncation.top_k == trainer.generation_config.top_k
    assert cb.truncation.min_p == 0.0 and cb.truncation.top_p == trainer.generation_config.top_p


def test_generation_kwargs_min_p_is_the_cut_the_trainer_applies(toy_model_path, tmp_path):
    """generation_kwargs min_p=0.1 over GRPOConfig min_p=0.01: the sampler cuts at 0.1, and so must the trainer (it
    cut at 0.01: k3 ~1e-4 and the audit's sampler-truncation-unmatched). Reference: the sampler's own setting, and
    the log-probs it recorded while sampling against the trainer's over the safe set."""
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, min_p=0.01, generation_kwargs={"min_p": 0.1})
    assert trainer.generation_config.min_p == 0.1
    cb = TIMCallback(trainer, TIMConfig(safe_vocab=True))
    assert cb.truncation.min_p == trainer.generation_config.min_p
    trainer.add_callback(cb)
    trainer.train()
    (row,) = [h for h in trainer.state.log_history if "tim/token/kl_k3" in h]
    assert row["tim/tokens"] > 0 and abs(row["tim/token/kl_k3"]) < 1e-9, row
    assert row["tim/parity/errors"] == 0.0, [f.code for f in cb.findings if f.severity == "error"]


@pytest.mark.parametrize("rollout", ["hf", "exact", "inject"])
def test_a_rollout_mode_that_a_rollout_func_bypasses_is_refused(toy_model_path, tmp_path, rollout, monkeypatch):
    """rollout='hf', 'exact' and 'inject' record or replace TRL's transformers generation, which GRPOTrainer never
    calls with a rollout_func (``GRPOTrainer._generate`` calls the function instead): each is refused at attach,
    naming the mode, rollout_func and the fix, instead of measuring the function's log-probs as if the mode held.
    The default 'auto' measures what the function returns."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    trainer.rollout_func = _rollout_func_without_logprobs
    with pytest.raises(ValueError) as err:
        TIMCallback(trainer, TIMConfig(rollout=rollout))
    msg = str(err.value)
    assert f"TIMConfig.rollout={rollout!r}" in msg and "rollout_func" in msg and "Fix: rollout='auto'" in msg, msg
    assert not any(isinstance(cb, TIMState) for cb in trainer.callback_handler.callbacks)
    assert TIMCallback(trainer, TIMConfig()).rollout_source == "custom"


def test_a_disabled_callback_built_without_a_trainer_detaches_as_a_no_op():
    """TIMConfig(enabled=False) accepts no trainer (it attaches nothing); ``detach()``, idempotent by its contract,
    then has nothing to remove, twice."""
    cb = TIMCallback(None, TIMConfig(enabled=False))
    assert cb.installed == []
    cb.detach()
    cb.detach()
    assert cb.installed == []
