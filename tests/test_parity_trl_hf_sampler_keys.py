"""The parity audit of TRL's transformers generation (``use_vllm=False``) reads every ``GRPOConfig.generation_kwargs``
setting that changes the distribution TRL samples from, and only those.

TRL lays ``generation_kwargs`` over its sampler dict and builds one ``GenerationConfig`` of them; transformers-only
settings there (n-gram bans, bad words, suppressed / forced tokens, typical / epsilon / eta cuts, ...) add logits
processors the trainer never recomputes. The reference is independent of the adapter: TRL's own ``GenerationConfig``
(a real GRPOTrainer's, with and without the key) run through transformers' own ``generate(output_scores=True)`` on
the toy model, inside TRL's own ``unwrap_model_for_generation`` as TRL calls it; the processed distributions (and the
tokens drawn with one seed) differ exactly when the setting changes what is sampled. The audit must report exactly
those keys, and (greedy decoding, ``do_sample=False``) none of the sampling-only warpers.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl_callback import make_trainer  # noqa: E402

from tim_plugins.integrations.trl.parity_spec import (  # noqa: E402
    hf_sampler_processors,
    specs_from_grpo_config,
    specs_from_trainer,
)
from tim_plugins.parity import audit, enforce  # noqa: E402
from tim_plugins.parity.audit import FIXABLE, rollout_processing_active  # noqa: E402

pytestmark = pytest.mark.trl

# a repeated token and bigram (n-gram bans and penalties bite at the first step), and a one-token prompt (the forced
# BOS id applies at length 1 only)
PROMPTS = ([5, 6, 5], [7])

# generation_kwargs key -> (value, whether it changes the sampled distribution when sampling, when greedy)
KEYS = {
    # transformers-only logits processors: applied whether transformers samples or not
    "no_repeat_ngram_size": (2, True, True),
    "encoder_no_repeat_ngram_size": (2, True, True),  # decoder-only: the prompt is its "encoder input"
    "bad_words_ids": ([[9]], True, True),
    "suppress_tokens": ([9], True, True),
    "begin_suppress_tokens": ([9], True, True),
    "sequence_bias": ([[[9], -5.0]], True, True),
    "encoder_repetition_penalty": (1.5, True, True),
    "min_new_tokens": (3, True, True),
    "min_length": (5, True, True),
    "exponential_decay_length_penalty": ((1, 1.5), True, True),
    "forced_bos_token_id": (9, True, True),
    "forced_eos_token_id": (9, True, True),
    "guidance_scale": (1.5, True, True),
    "watermarking_config": ({"greenlist_ratio": 0.25}, True, True),
    "num_beams": (2, True, True),
    "repetition_penalty": (1.3, True, True),
    # warpers: applied only when sampling
    "typical_p": (0.5, True, False),
    "epsilon_cutoff": (0.01, True, False),
    "eta_cutoff": (0.01, True, False),
    "top_h": (0.5, True, False),
    "top_p": (0.9, True, False),
    "top_k": (5, True, False),
    "min_p": (0.2, True, False),
    "temperature": (0.7, True, False),
    # settings that leave it as it is, neutral values, and vLLM's names (transformers keeps them unread)
    "renormalize_logits": (True, False, False),
    "remove_invalid_values": (True, False, False),
    "max_length": (512, False, False),
    "use_cache": (False, False, False),
    "length_penalty": (2.0, False, False),
    "typical_p=1": (1.0, False, False),
    "no_repeat_ngram_size=0": (0, False, False),
    "min_new_tokens=0": (0, False, False),
    "bad_words_ids=None": (None, False, False),
    "presence_penalty": (0.5, False, False),
    "frequency_penalty": (0.5, False, False),
    "logit_bias": ({9: 5.0}, False, False),
    "bad_words": (["a"], False, False),
    "allowed_token_ids": ([1, 2], False, False),
}


def _trl_generate(trainer, prompt):
    """TRL's transformers generation of one prompt, as TRL runs it (its GenerationConfig, its unwrap context with its
    generation kwargs laid over the model's), keeping the processed scores; one seed."""
    from trl.models import unwrap_model_for_generation

    config = copy.deepcopy(trainer.generation_config)
    config.update(output_scores=True, return_dict_in_generate=True)
    ids = torch.tensor([prompt])
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                     generation_kwargs=trainer.generation_kwargs) as model, torch.no_grad():
        torch.manual_seed(0)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out.sequences, [torch.log_softmax(s.float(), dim=-1) for s in out.scores]


def distribution_differs(trainer, baseline) -> bool:
    """The reference: whether TRL's generation under ``trainer``'s settings draws other tokens or has another
    processed distribution at any step than under ``baseline``'s (the same weights)."""
    for prompt in PROMPTS:
        (seq_a, a), (seq_b, b) = _trl_generate(baseline, prompt), _trl_generate(trainer, prompt)
        if seq_a.shape != seq_b.shape or not torch.equal(seq_a, seq_b) or len(a) != len(b):
            return True
        for x, y in zip(a, b):
            if x.shape != y.shape or not torch.equal(torch.isinf(x), torch.isinf(y)):
                return True
            kept = torch.isfinite(x)
            if not torch.allclose(x[kept], y[kept], atol=1e-5):
                return True
    return False


def reported_keys(findings) -> set:
    """The generation settings the audit's sampler findings name (custom processors as ``key=value``)."""
    keys = set()
    for f in findings:
        if f.code in ("sampler-penalties-unmatched", "sampler-truncation-unmatched"):
            for name, value in f.rollout_value.items():
                keys |= {p.split("=")[0] for p in value} if name == "custom_logits_processors" else {name}
        elif f.code == "temperature-mismatch":
            keys.add("temperature")
    return keys


@pytest.fixture(scope="module")
def baselines(toy_model_path, tmp_path_factory):
    return {do_sample: make_trainer(toy_model_path, tmp_path_factory.mktemp("base"), max_steps=1,
                                    generation_kwargs={"do_sample": do_sample})
            for do_sample in (True, False)}


@pytest.mark.parametrize("do_sample", [True, False], ids=["sample", "greedy"])
@pytest.mark.parametrize("case", list(KEYS))
def test_the_audit_reports_exactly_the_generation_kwargs_that_change_trls_sampling(case, do_sample, baselines,
                                                                                   toy_model_path, tmp_path):
    key = case.split("=")[0]
    value, when_sampling, when_greedy = KEYS[case]
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1,
                           generation_kwargs={"do_sample": do_sample, key: value})
    changes = distribution_differs(trainer, baselines[do_sample])
    assert changes is (when_sampling if do_sample else when_greedy)  # the case is what it says, by the reference
    for rollout, trainer_spec in (specs_from_grpo_config(trainer.args),
                                  specs_from_trainer(trainer, rollout_source="hf")):
        found = audit(rollout, trainer_spec)
        assert reported_keys(found) == ({key} if changes else set()), [f.message for f in found]
        if changes:
            assert rollout_processing_active(rollout) is True
        # nothing else appears with it: the baseline's spec pair audits to the same findings but this one
        base = audit(*specs_from_grpo_config(baselines[do_sample].args))
        assert {f.code for f in found} - {f.code for f in base} <= {
            "sampler-penalties-unmatched", "sampler-truncation-unmatched", "temperature-mismatch"}


@pytest.mark.parametrize("key,value", [("typical_p", 0.5), ("epsilon_cutoff", 0.01), ("eta_cutoff", 0.01),
                                       ("top_h", 0.5)])
def test_transformers_only_cuts_are_processing_to_drop_not_a_truncation_to_match(key, value, tmp_path):
    """typical/epsilon/eta/top-h cuts: no trainer applies them (the safe vocabulary cuts at min-p / top-p / top-k
    only), so they are sampler-penalties-unmatched (drop them), not sampler-truncation-unmatched, whose fixes make the
    trainer apply the same top-p/top-k/min-p; enforce cannot fix them and says so."""
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[],
                      generation_kwargs={key: value})
    rollout, trainer = specs_from_grpo_config(args)
    assert rollout.custom_logits_processors == (f"{key}={value!r}",) and hf_sampler_processors(args) == \
        rollout.custom_logits_processors
    assert "generation_kwargs" in rollout.notes["custom_logits_processors"]
    found = {f.code: f for f in audit(rollout, trainer)}
    assert "sampler-truncation-unmatched" not in found
    penalties = found["sampler-penalties-unmatched"]
    assert penalties.rollout_value == {"custom_logits_processors": (f"{key}={value!r}",)}
    assert key in penalties.fix["trl"] and "generation_kwargs" in penalties.fix["trl"]
    fixed = enforce(rollout, trainer, fix=set(FIXABLE), truncation_side="trainer")
    assert "sampler-penalties-unmatched" in {f.code for f in fixed.findings} and not fixed.trainer_settings


def test_vllm_path_reads_vllms_names_and_no_transformers_setting(tmp_path):
    """With vLLM, generation_kwargs go to SamplingParams: its penalties are read as before; transformers' settings
    are not vLLM's (SamplingParams refuses them), so none is listed as a processor."""
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], use_vllm=True,
                      generation_kwargs={"presence_penalty": 0.3, "logit_bias": {9: 1.0}})
    rollout, trainer = specs_from_grpo_config(args)
    assert rollout.presence_penalty == 0.3 and rollout.logit_bias is True and rollout.custom_logits_processors == ()
    assert reported_keys(audit(rollout, trainer)) == {"presence_penalty", "logit_bias"}
    other = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], use_vllm=True,
                       generation_kwargs={"no_repeat_ngram_size": 2})
    assert hf_sampler_processors(other) == ()
