"""What TRL's sampler does with ``GRPOConfig.generation_kwargs``, which TRL lays over GRPOConfig's sampler settings:
``TIMConfig(rollout="exact")`` refuses exactly the settings under which TRL's transformers generation would sample
something else than softmax(logits/T); greedy decoding (transformers' ``do_sample=False``, vLLM's temperature 0)
cuts nothing, and the parity audit and the safe vocabulary read it so.

References are independent of the adapter: the logits processors and decoding mode that TRL's own transformers
generation builds (one real ``_generate_single_turn`` call, its processors applied to random scores and compared with
log_softmax(scores / T)), TRL's own merged ``GenerationConfig``, and vLLM's own ``SamplingParams``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl_callback import make_trainer  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.integrations.trl.parity_spec import specs_from_grpo_config, specs_from_trainer  # noqa: E402
from tim_plugins.parity import PipelineSpec, audit, enforce  # noqa: E402
from tim_plugins.parity.audit import FIXABLE, rollout_processing_active  # noqa: E402

pytestmark = pytest.mark.trl

PROMPT = [5, 6, 5]  # a repeated token and bigram: repetition penalties and n-gram bans bite at the first step


def trl_generation(trainer):
    """(logits processors, decoding mode, GenerationConfig) of one real TRL transformers generation step, as
    transformers builds them from the GenerationConfig TRL passes (spied on the unwrapped model, undone after)."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    seen = []
    original = model._get_logits_processor

    def spy(*args, **kwargs):
        processors = original(*args, **kwargs)
        seen.append((processors, kwargs.get("generation_config", args[0] if args else None)))
        return processors

    model._get_logits_processor = spy
    try:
        trainer._generate_single_turn([PROMPT], None, {}, 1)
    finally:
        del model._get_logits_processor
    assert len(seen) == 1
    processors, config = seen[0]
    return processors, str(config.get_generation_mode().value), config


def samples_softmax_over_t(trainer) -> bool:
    """The reference: TRL's generation samples softmax(logits / GRPOConfig.temperature), one token per row per step,
    max_completion_length tokens, ending at TRL's EOS ids; the distribution checked on random scores."""
    processors, mode, config = trl_generation(trainer)
    ids = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    if mode != "sample" or config.max_new_tokens != trainer.max_completion_length \
            or set(ids) != set(trainer.eos_token_ids):
        return False
    vocab = trainer.model.config.vocab_size
    scores = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 3
    got = torch.log_softmax(processors(torch.tensor([PROMPT]), scores.clone()), dim=-1)
    want = torch.log_softmax(scores / trainer.temperature, dim=-1)
    return bool(torch.isfinite(got).all()) and torch.allclose(got, want, atol=1e-5)


# GRPOConfig overrides -> (whether TRL then samples softmax(logits/T), the text the refusal names)
CASES = {
    "defaults": ({}, True, None),
    "gen top_p": ({"generation_kwargs": {"top_p": 0.9}}, False, "{'top_p': 0.9}"),
    "gen top_k": ({"generation_kwargs": {"top_k": 5}}, False, "{'top_k': 5}"),
    "gen top_k None": ({"generation_kwargs": {"top_k": None}}, False, "{'top_k': None}"),  # transformers: 50
    "gen min_p": ({"generation_kwargs": {"min_p": 0.2}}, False, "{'min_p': 0.2}"),
    "gen typical_p": ({"generation_kwargs": {"typical_p": 0.5}}, False, "{'typical_p': 0.5}"),
    "gen repetition_penalty": ({"generation_kwargs": {"repetition_penalty": 1.3}}, False,
                               "{'repetition_penalty': 1.3}"),
    "gen no_repeat_ngram_size": ({"generation_kwargs": {"no_repeat_ngram_size": 2}}, False,
                                 "{'no_repeat_ngram_size': 2}"),
    "gen bad_words_ids": ({"generation_kwargs": {"bad_words_ids": [[9]]}}, False, "{'bad_words_ids': [[9]]}"),
    "gen suppress_tokens": ({"generation_kwargs": {"suppress_tokens": [9]}}, False, "{'suppress_tokens': [9]}"),
    "gen min_new_tokens": ({"generation_kwargs": {"min_new_tokens": 3}}, False, "{'min_new_tokens': 3}"),
    "gen temperature": ({"generation_kwargs": {"temperature": 0.7}}, False, "{'temperature': 0.7}"),
    "gen greedy": ({"generation_kwargs": {"do_sample": False}}, False, "{'do_sample': False}"),
    "gen beams": ({"generation_kwargs": {"num_beams": 2}}, False, "{'num_beams': 2}"),
    "gen max_new_tokens": ({"generation_kwargs": {"max_new_tokens": 3}}, False, "{'max_new_tokens': 3}"),
    "gen eos": ({"generation_kwargs": {"eos_token_id": 9}}, False, "{'eos_token_id': 9}"),
    "config top_k None": ({"top_k": None}, False, "{'top_k': None}"),  # TRL passes None: transformers' 50
    # generation_kwargs win over GRPOConfig (TRL updates its dict with them): these end neutral
    "gen top_p 1 over 0.9": ({"top_p": 0.9, "generation_kwargs": {"top_p": 1.0}}, True, None),
    "gen top_k 0 over 5": ({"top_k": 5, "generation_kwargs": {"top_k": 0}}, True, None),
    "gen penalty 1 over 1.2": ({"repetition_penalty": 1.2, "generation_kwargs": {"repetition_penalty": 1.0}}, True,
                               None),
    "gen T as config": ({"temperature": 0.7, "generation_kwargs": {"temperature": 0.7}}, True, None),
    # settings that leave the distribution as it is
    "gen min_p 0": ({"generation_kwargs": {"min_p": 0.0}}, True, None),
    "gen inert": ({"generation_kwargs": {"do_sample": True, "renormalize_logits": True, "use_cache": True,
                                         "remove_invalid_values": True, "max_length": 512, "bad_words_ids": None,
                                         "output_scores": False}}, True, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_exact_sampler_is_refused_exactly_where_trl_would_sample_something_else(name, toy_model_path, tmp_path):
    overrides, reproduces, named = CASES[name]
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, **overrides)
    assert samples_softmax_over_t(trainer) is reproduces  # the case is what it says, by TRL's own generation
    if reproduces:
        TIMCallback(trainer, TIMConfig(rollout="exact"))  # no error
        return
    with pytest.raises(ValueError) as err:
        TIMCallback(trainer, TIMConfig(rollout="exact"))
    msg = str(err.value)
    assert msg.startswith("TIMConfig.rollout='exact' samples softmax(logits/T) only"), msg
    assert f"sets {named}" in msg and "Fix: " in msg and "TIMConfig(rollout='auto')" in msg, msg
    where = "GRPOConfig.generation_kwargs" if "generation_kwargs" in overrides else "GRPOConfig sets"
    assert where in msg, msg


def test_the_refusal_names_generation_kwargs_value_over_grpo_configs_and_the_fix(toy_model_path, tmp_path):
    """GRPOConfig top_p=0.8 with generation_kwargs top_p=0.9: TRL samples at 0.9 (its own GenerationConfig), and the
    refusal names that value, where it is set, and the settings that fix it."""
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, top_p=0.8,
                           generation_kwargs={"top_p": 0.9, "temperature": 0.5})
    assert (trainer.generation_config.top_p, trainer.generation_config.temperature) == (0.9, 0.5)
    with pytest.raises(ValueError) as err:
        TIMCallback(trainer, TIMConfig(rollout="exact"))
    msg = str(err.value)
    assert "generation_kwargs, which TRL lays over GRPOConfig's sampler settings, sets {'top_p': 0.9, " \
           "'temperature': 0.5}" in msg, msg
    assert "0.8" not in msg, msg
    assert "Fix: drop 'top_p', 'temperature' from generation_kwargs (or set top_p=1.0, temperature=1.0 there)" \
           in msg, msg
    assert "set GRPOConfig.temperature instead of generation_kwargs['temperature']" in msg, msg


def test_an_unknown_generation_kwarg_is_refused_as_unknown(toy_model_path, tmp_path):
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, generation_kwargs={"my_sampler_knob": 3})
    with pytest.raises(ValueError) as err:
        TIMCallback(trainer, TIMConfig(rollout="exact"))
    msg = str(err.value)
    assert "sets {'my_sampler_knob': 3} ('my_sampler_knob': not a transformers generation setting" in msg, msg
    assert "Fix: drop 'my_sampler_knob' from generation_kwargs for the exact run" in msg, msg


# ---------------------------------------------------------------------------------------------- greedy decoding
def _truncation_codes(findings):
    return {f.code for f in findings} & {"sampler-truncation-unmatched", "temperature-mismatch"}


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_transformers_greedy_decoding_cuts_nothing_and_its_log_probs_are_those_of_t1(toy_model_path, tmp_path,
                                                                                        temperature):
    """do_sample=False: transformers applies none of GRPOConfig's top_p / min_p / temperature (its processors are the
    identity on the scores, the distribution the recorder reads is log_softmax(logits)), so the audit reports no
    truncation, and a temperature mismatch exactly when the trainer divides by T != 1."""
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, top_p=0.9, min_p=0.05, temperature=temperature,
                           generation_kwargs={"do_sample": False})
    processors, mode, _ = trl_generation(trainer)
    scores = torch.randn(1, trainer.model.config.vocab_size, generator=torch.Generator().manual_seed(1)) * 3
    assert mode == "greedy_search"
    torch.testing.assert_close(torch.log_softmax(processors(torch.tensor([PROMPT]), scores.clone()), -1),
                               torch.log_softmax(scores, -1))
    expected = {"temperature-mismatch"} if temperature != 1.0 else set()
    for rollout, trainer_spec in (specs_from_grpo_config(trainer.args), specs_from_trainer(trainer,
                                                                                            rollout_source="hf")):
        found = audit(rollout, trainer_spec)
        assert _truncation_codes(found) == expected, [f.message for f in found]
        assert rollout_processing_active(rollout) is False
        if expected:
            f = next(f for f in found if f.code == "temperature-mismatch")
            assert f.trainer_value == temperature and "decodes greedily" in f.message, f.message
            # enforce's default fix: the trainer divides by the T the greedy log-probs have
            assert enforce(rollout, trainer_spec).trainer.temperature == 1.0


def test_vllm_greedy_requests_cut_nothing_as_vllm_resets_them():
    """temperature 0 in generation_kwargs on the vLLM path: vLLM's SamplingParams resets top_p, top_k and min_p;
    the audit compares what vLLM applies (no truncation finding), and the rollout spec says what vLLM runs."""
    vllm = pytest.importorskip("vllm")
    from trl import GRPOConfig

    args = GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, use_vllm=True, top_p=0.9, top_k=5, min_p=0.1,
                      generation_kwargs={"temperature": 0.0})
    params = vllm.SamplingParams(temperature=0.0, top_p=0.9, top_k=5, min_p=0.1)
    rollout, trainer = specs_from_grpo_config(args)
    assert (rollout.top_p, rollout.top_k, rollout.min_p) == (params.top_p, params.top_k, params.min_p)
    assert _truncation_codes(audit(rollout, trainer)) == set()
    # a spec that keeps the settings vLLM ignores (hand-written, or another reader): the audit reads them as vLLM does
    raw = rollout.replace(top_p=0.9, top_k=5, min_p=0.1)
    assert _truncation_codes(audit(raw, trainer)) == set() and rollout_processing_active(raw) is False
    # the trainer's own cut against a greedy rollout: reported against what vLLM applies, fixed on the trainer
    cutting = trainer.replace(top_p=0.9)
    found = next(f for f in audit(raw, cutting) if f.code == "sampler-truncation-unmatched")
    assert found.rollout_value == {"top_p": params.top_p} and found.trainer_value == {"top_p": 0.9}
    fixed = enforce(raw, cutting, fix=set(FIXABLE))
    assert fixed.trainer.top_p == params.top_p and not fixed.vllm_sampling_params
    assert "sampler-truncation-unmatched" not in {f.code for f in fixed.findings}


def test_a_greedy_rollout_spec_cuts_nothing_against_a_hand_written_pair():
    rollout = PipelineSpec(side="rollout", temperature=0.0, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.0)
    trainer = PipelineSpec(side="trainer", temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    assert _truncation_codes(audit(rollout, trainer)) == set()
    sampled = rollout.replace(temperature=1.0)  # the same settings, sampled: the cut is real
    assert _truncation_codes(audit(sampled, trainer)) == {"sampler-truncation-unmatched"}


def test_the_safe_vocabulary_refuses_greedy_decoding(toy_model_path, tmp_path):
    """GRPOConfig min_p=0.1 with do_sample=False: transformers applies no min-p (no MinPLogitsWarper in TRL's
    generation), so there is no kept set; it was taken as a cut at 0.1 and the trainer renormalised over it."""
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, min_p=0.1, generation_kwargs={"do_sample": False})
    processors, _, _ = trl_generation(trainer)
    assert not any("MinP" in type(p).__name__ for p in processors)
    with pytest.raises(ValueError) as err:
        TIMCallback(trainer, TIMConfig(safe_vocab=True))
    msg = str(err.value)
    assert msg.startswith("TIMConfig.safe_vocab=True with greedy decoding (generation_kwargs['do_sample']=False) "
                          "is invalid"), msg
    assert msg.endswith("Fix: drop do_sample from generation_kwargs (TRL samples then), or safe_vocab=False"), msg
