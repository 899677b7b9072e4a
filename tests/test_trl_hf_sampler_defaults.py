"""TRL's transformers generation (``use_vllm=False``) samples with what transformers fills in where TRL's
``GenerationConfig`` leaves a value None: the model's own generation_config, then transformers' global defaults
(transformers/generation/utils.py ``GenerationMixin._prepare_generation_config``; top_k 50). The parity audit's
rollout side and the safe vocabulary read those values, not None.

The reference is independent of the adapter: the warpers transformers builds in one real TRL generation step
(``_get_logits_processor`` spied on, as test_trl_exact_generation_kwargs does), and the kept set of TRL's own
``generate(output_scores=True)`` (the finite processed scores), against the kept set the safe vocabulary computes
from the trainer's logits of the same tokens.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_parity_trl_hf_sampler_keys import _trl_generate  # noqa: E402
from test_trl_callback import make_trainer  # noqa: E402
from test_trl_exact_generation_kwargs import trl_generation  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.integrations.trl.parity_spec import (  # noqa: E402
    greedy_decoding,
    sampler_settings,
    specs_from_grpo_config,
    specs_from_trainer,
)
from tim_plugins.integrations.trl.translate import safe_truncation  # noqa: E402
from tim_plugins.parity import audit  # noqa: E402
from tim_plugins.truncation import truncation_threshold  # noqa: E402

pytestmark = pytest.mark.trl

# a generation_config.json of the model's own that sets a cut (Qwen-style checkpoints ship top_k / top_p there)
MODEL_GC = {"top_k": 20, "top_p": 0.8, "min_p": 0.05}


@pytest.fixture(scope="module")
def model_with_gc(toy_model_path, tmp_path_factory):
    """The toy checkpoint with MODEL_GC in its generation_config.json."""
    path = tmp_path_factory.mktemp("gc") / "model"
    shutil.copytree(toy_model_path, path)
    gc_file = path / "generation_config.json"
    gc_file.write_text(json.dumps({**json.loads(gc_file.read_text()), **MODEL_GC}))
    return path


def applied_cut(trainer) -> dict:
    """The reference: {top_k, top_p, min_p} of the warpers transformers builds in TRL's generation (0 / 1.0 / 0.0
    where it builds none)."""
    processors, mode, _ = trl_generation(trainer)
    assert mode == "sample"
    cut = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
    for p in processors:
        for name in cut:
            if type(p).__name__ == {"top_k": "TopKLogitsWarper", "top_p": "TopPLogitsWarper",
                                    "min_p": "MinPLogitsWarper"}[name]:
                cut[name] = getattr(p, name)
    return cut


# case -> (model with MODEL_GC, GRPOConfig overrides, the cut transformers applies)
CASES = {
    "config top_k None": (False, {"top_k": None}, {"top_k": 50, "top_p": 1.0, "min_p": 0.0}),
    "gen top_k None": (False, {"generation_kwargs": {"top_k": None}}, {"top_k": 50, "top_p": 1.0, "min_p": 0.0}),
    "config top_k None, min_p": (False, {"top_k": None, "min_p": 0.1}, {"top_k": 50, "top_p": 1.0, "min_p": 0.1}),
    "model gc, TRL defaults": (True, {}, {"top_k": 0, "top_p": 1.0, "min_p": 0.05}),  # TRL's min_p=None
    "model gc, config None": (True, {"top_k": None, "top_p": None}, {"top_k": 20, "top_p": 0.8, "min_p": 0.05}),
    "model gc, gen top_k None": (True, {"generation_kwargs": {"top_k": None}}, {"top_k": 20, "top_p": 1.0,
                                                                                "min_p": 0.05}),
    "model gc, config wins": (True, {"top_k": 5, "top_p": 0.9, "min_p": 0.1}, {"top_k": 5, "top_p": 0.9,
                                                                              "min_p": 0.1}),
}


def test_the_global_defaults_are_transformers_own():
    from transformers import GenerationConfig

    from tim_plugins.integrations.trl.exact_settings import HF_GLOBAL_DEFAULTS

    defaults = GenerationConfig._get_default_generation_params()
    assert {k: defaults[k] for k in HF_GLOBAL_DEFAULTS} == HF_GLOBAL_DEFAULTS


@pytest.mark.parametrize("case", list(CASES))
def test_the_audit_and_the_safe_vocabulary_read_the_cut_transformers_applies(case, toy_model_path, model_with_gc,
                                                                             tmp_path):
    with_gc, overrides, expected = CASES[case]
    path = model_with_gc if with_gc else toy_model_path
    trainer = make_trainer(path, tmp_path, max_steps=1, **overrides)
    assert applied_cut(trainer) == pytest.approx(expected)  # the case is what it says, by transformers itself
    for model in (trainer.model, str(path)):  # the live model, or the checkpoint's generation_config.json
        rollout, trainer_spec = specs_from_grpo_config(trainer.args, model)
        assert {k: getattr(rollout, k) for k in expected} == pytest.approx(expected), model
    rollout, trainer_spec = specs_from_trainer(trainer, rollout_source="hf")
    assert {k: getattr(rollout, k) for k in expected} == pytest.approx(expected)
    found = {f.code: f for f in audit(rollout, trainer_spec)}
    cut = {k: v for k, v in expected.items() if v != {"top_k": 0, "top_p": 1.0, "min_p": 0.0}[k]}
    assert found["sampler-truncation-unmatched"].rollout_value == pytest.approx(cut)
    trunc = safe_truncation(trainer, TIMConfig(safe_vocab=True))
    assert {"top_k": trunc.top_k, "top_p": trunc.top_p, "min_p": trunc.min_p} == pytest.approx(expected)
    TIMCallback(trainer, TIMConfig(safe_vocab=True))  # attaches (the old reading refused "no cut" or cut elsewhere)


@pytest.mark.parametrize("case", ["config top_k None", "model gc, config None", "model gc, TRL defaults"])
def test_the_safe_vocabularys_kept_set_is_the_one_trls_generate_samples_from(case, toy_model_path, model_with_gc,
                                                                            tmp_path):
    """Token by token: the finite entries of TRL's own generate scores (its processed distribution) are the tokens
    the safe vocabulary keeps from the trainer's logits of the same prefix."""
    with_gc, overrides, _ = CASES[case]
    trainer = make_trainer(model_with_gc if with_gc else toy_model_path, tmp_path, max_steps=1, **overrides)
    trunc = safe_truncation(trainer, TIMConfig(safe_vocab=True))
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    for prompt in ([5, 6, 5], [7]):
        sequences, scores = _trl_generate(trainer, prompt)
        with torch.no_grad():
            logits = model(input_ids=sequences).logits[0, len(prompt) - 1:-1].float() / trainer.temperature
        kept = logits >= truncation_threshold(logits, trunc)[:, None]
        sampled = torch.stack([torch.isfinite(s[0]) for s in scores])
        assert kept.shape == sampled.shape
        assert torch.equal(kept, sampled), (kept.sum(-1), sampled.sum(-1))
        assert bool((sampled.sum(-1) < logits.shape[-1]).all())  # transformers did cut: the check has teeth


def test_config_only_audit_says_where_a_none_goes(tmp_path):
    """Without the model the audit reads transformers' default and says the model's generation_config may set it."""
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], top_k=None)
    rollout, _ = specs_from_grpo_config(args)
    assert rollout.top_k == 50 and sampler_settings(args)["top_k"] == 50
    assert "transformers' default" in rollout.notes["top_k"] and "generation_config" in rollout.notes["top_k"]
    vllm = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], top_k=None, use_vllm=True)
    assert sampler_settings(vllm)["top_k"] is None  # vLLM's reading is unchanged (SamplingParams' own None)


def test_do_sample_none_is_the_models(toy_model_path, model_with_gc, tmp_path):
    """generation_kwargs do_sample=None hands it to the model's generation_config (then transformers' False)."""
    gc_file = model_with_gc / "generation_config.json"
    sampling = tmp_path / "sampling"
    shutil.copytree(model_with_gc, sampling)
    (sampling / "generation_config.json").write_text(json.dumps({**json.loads(gc_file.read_text()),
                                                                 "do_sample": True}))
    for path, greedy in ((toy_model_path, True), (sampling, False)):
        trainer = make_trainer(path, tmp_path / path.name, max_steps=1, generation_kwargs={"do_sample": None})
        _, mode, _ = trl_generation(trainer)
        assert (mode == "greedy_search") is greedy
        assert (greedy_decoding(trainer.args, trainer.model) is not None) is greedy


def test_the_exact_sampler_refuses_a_cut_from_the_models_generation_config(model_with_gc, tmp_path):
    """TRL's default min_p=None is the model's min_p: TRL's generation cuts there, so rollout='exact' (softmax(logits/T)
    only) is refused, naming the model's value and a fix that, applied, attaches."""
    from test_trl_exact_generation_kwargs import samples_softmax_over_t

    trainer = make_trainer(model_with_gc, tmp_path / "cut", max_steps=1)
    assert samples_softmax_over_t(trainer) is False  # TRL cuts at the model's min_p
    with pytest.raises(ValueError) as err:
        TIMCallback(trainer, TIMConfig(rollout="exact"))
    msg = str(err.value)
    assert "the model's generation_config sets {'min_p': 0.05} (TRL's GenerationConfig leaves it None" in msg, msg
    assert "Fix: add {'min_p': 0.0} to GRPOConfig.generation_kwargs for the exact run" in msg, msg
    trainer = make_trainer(model_with_gc, tmp_path / "fixed", max_steps=1, generation_kwargs={"min_p": 0.0})
    assert samples_softmax_over_t(trainer) is True
    TIMCallback(trainer, TIMConfig(rollout="exact"))
