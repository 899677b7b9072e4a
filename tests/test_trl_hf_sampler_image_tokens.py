"""TRL suppresses the image token on its transformers path when the processing class is a ``ProcessorMixin``
(trl/trainer/grpo_trainer.py ``GRPOTrainer.__init__``: ``suppress_tokens=[model.config.image_token_id]``, outside
``GRPOConfig.generation_kwargs``). The audit of a live trainer reads TRL's own generation dict and reports it; a
config alone cannot tell (the processing class is a GRPOTrainer argument, neither GRPOConfig's nor the model's).

The reference is TRL's own generation: the logits processors transformers builds in one real
``_generate_single_turn`` call, on the toy model with a toy processor and an image token id.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_trl_callback import _reward, synthetic_prompts  # noqa: E402
from test_trl_exact_generation_kwargs import trl_generation  # noqa: E402

from tim_plugins.integrations.trl.parity_spec import specs_from_grpo_config, specs_from_trainer  # noqa: E402
from tim_plugins.parity import audit  # noqa: E402

pytestmark = pytest.mark.trl

IMAGE_TOKEN = 9


def image_text_trainer(model_path, tmp_path, **overrides):
    """GRPOTrainer on the toy model with a ProcessorMixin processing class and an image token id, as TRL builds one
    for an image-text model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, ProcessorMixin
    from trl import GRPOConfig, GRPOTrainer

    class ToyProcessor(ProcessorMixin):
        attributes = ["tokenizer"]
        tokenizer_class = "AutoTokenizer"

        def __call__(self, *args, **kwargs):
            return self.tokenizer(*args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(model_path)
    model.config.image_token_id = IMAGE_TOKEN
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=1, report_to=[], save_strategy="no",
                      **overrides)
    return GRPOTrainer(model=model, reward_funcs=_reward, args=args, processing_class=ToyProcessor(
        AutoTokenizer.from_pretrained(model_path)), train_dataset=datasets.Dataset.from_dict(
        {"prompt": synthetic_prompts(16)}))


def suppressed(trainer) -> list:
    """The reference: the token ids transformers' SuppressTokensLogitsProcessor masks in TRL's generation."""
    processors, _, _ = trl_generation(trainer)
    return [p.suppress_tokens.tolist() for p in processors if type(p).__name__ == "SuppressTokensLogitsProcessor"]


def test_trls_own_image_token_suppression_is_reported(toy_model_path, tmp_path):
    trainer = image_text_trainer(toy_model_path, tmp_path)
    assert suppressed(trainer) == [[IMAGE_TOKEN]]
    rollout, trainer_spec = specs_from_trainer(trainer, rollout_source="hf")
    assert rollout.custom_logits_processors == (f"suppress_tokens={[IMAGE_TOKEN]!r}",)
    assert "image-text" in rollout.notes["suppress_tokens"]
    found = {f.code: f for f in audit(rollout, trainer_spec)}
    assert found["sampler-penalties-unmatched"].rollout_value == {
        "custom_logits_processors": (f"suppress_tokens={[IMAGE_TOKEN]!r}",)}
    # the config alone does not say which processing class the trainer gets: not read there
    assert specs_from_grpo_config(trainer.args, trainer.model)[0].custom_logits_processors == ()


def test_generation_kwargs_lifting_it_is_read_as_lifted(toy_model_path, tmp_path):
    trainer = image_text_trainer(toy_model_path, tmp_path, generation_kwargs={"suppress_tokens": None})
    assert suppressed(trainer) == []
    rollout, _ = specs_from_trainer(trainer, rollout_source="hf")
    assert rollout.custom_logits_processors == () and "suppress_tokens" not in rollout.notes
