"""Guards on the TRL 1.16 internals the adapter relies on (``integrations/trl/hooks.py`` ``TRL_SOURCES``).

Each test fails when the named TRL source changes the shape the adapter assumes, and says which hook to revisit.
The policy-term route (``hooks.scale_policy_term``) is checked against TRL's own vLLM-branch product, for every
loss type TRL documents, with ratios that clip and a KL term: the reference is TRL's ``_compute_loss`` itself.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import re

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl_callback import make_trainer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tim_plugins.integrations.trl.hooks import TRL_SOURCES, scale_policy_term  # noqa: E402
from tim_plugins.toy_model import synthetic_prompts  # noqa: E402

pytestmark = pytest.mark.trl

# The loss types of GRPOConfig.loss_type's help text in TRL 1.16; a release adding one fails
# test_loss_types_are_the_documented_ones until the IS route is checked for it below.
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _src(obj) -> str:
    return inspect.getsource(obj)


def test_every_named_source_exists():
    for module, qualname in TRL_SOURCES:
        assert _resolve(module, qualname) is not None, f"{module}.{qualname} is gone: revisit integrations/trl/hooks.py"


def test_loss_types_are_the_documented_ones():
    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    documented = set(re.findall(r"'([a-z_]+)'", help_text.split("Supported values are", 1)[1].split(".")[0]))
    assert documented == set(LOSS_TYPES)


def test_signatures_the_wrappers_bind():
    sig = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies)
    assert list(sig.parameters)[:7] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep",
                                        "batch_size", "compute_entropy"]
    assert list(inspect.signature(GRPOTrainer._compute_loss).parameters) == ["self", "model", "inputs"]
    assert list(inspect.signature(GRPOTrainer._generate_single_turn).parameters)[:2] == ["self", "prompt_ids"]
    from trl.kernels import ChunkedLogProbFunction

    params = list(inspect.signature(ChunkedLogProbFunction.forward).parameters)
    assert params[1:] == ["hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                          "final_logit_softcapping", "logit_scale", "outputs"]


def test_sources_hold_the_assumed_statements():
    loss = _src(GRPOTrainer._compute_loss)
    # (B, T) advantages pass through unchanged (the IS route folds the weights into them).
    assert "if advantages.dim() == 1:" in loss
    # TRL's own IS product exists only in the vLLM branch, and vespo reads the ratio key directly.
    branch = (r"if self\.use_vllm and self\.vllm_importance_sampling_correction and self\.loss_type != \"vespo\":"
              r"\s*per_token_loss = per_token_loss \* inputs\[\"importance_sampling_ratio\"\]")
    assert re.search(branch, loss)
    assert 'importance_sampling_ratio=inputs.get("importance_sampling_ratio")' in loss
    # The loss mask the adapter reads (hooks.response_mask), and the inputs the loss reads only after its
    # log-prob call (the adapter scales them from inside that call, hooks.scale_policy_term).
    assert 'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in loss
    forward = loss.index("self._get_per_token_logps_and_entropies(")
    assert forward < loss.index('advantages = inputs["advantages"]')
    assert forward < loss.index('importance_sampling_ratio=inputs.get("importance_sampling_ratio")')
    assert loss.count('inputs["advantages"]') == 1
    # old_per_token_logps is the generation's first policy forward, computed exactly when TRL needs it
    gen = _src(GRPOTrainer._generate_and_score_completions)
    assert "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(" in gen
    assert "if self.args.gradient_accumulation_steps % generate_every != 0 or (" in gen
    assert gen.index("old_per_token_logps, _, _ =") < gen.index("ref_per_token_logps")
    # hooks._label_mask rebuilds the positions the fused head scores, as TRL labels them.
    logps = _src(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "labels = input_ids_batch.masked_fill(attention_mask_batch == 0, -100)" in logps
    assert "labels[:, :-logits_to_keep] = -100" in logps and "fused_lm_head=True" in logps
    single = _src(GRPOTrainer._generate_single_turn)
    assert "unwrapped_model.generate(" in single and "generation_config=self.generation_config" in single
    assert "logprobs = None" in single
    import trl.trainer.utils as trl_utils

    # The fused head looks the kernel up as a module global at call time (the safe-vocab shim replaces it).
    assert "_ChunkedLogProbFunction.apply(" in _src(trl_utils.add_fused_lm_head)
    # TIMCallback._push_metrics appends to trainer._metrics["train"]; TRL's log() averages and clears it.
    log = _src(GRPOTrainer.log)
    assert "for key, val in self._metrics[mode].items():" in log and "self._metrics[mode].clear()" in log
    prepare = _src(GRPOTrainer._prepare_inputs)
    assert "self._generate_and_score_completions(generation_batch)" in prepare
    assert "shuffle_sequence_dict" in prepare and "split_tensor_dict" in prepare


def test_vllm_generation_attributes_the_audit_reads():
    """_parity.py reads trainer.vllm_generation.llm (colocate) and .vllm_client.get_server_info() (server)."""
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    init = _src(GRPOTrainer.__init__)
    assert "self.vllm_generation = VLLMGeneration(" in init and "if self.use_vllm:" in init
    assert "self._init_vllm()" in _src(VLLMGeneration.__init__)
    gen = re.sub(r"\s+", " ", _src(VLLMGeneration._init_vllm))
    assert "self.llm = LLM(" in gen and "self.vllm_client = VLLMClient(" in gen
    assert gen.index('elif self.mode == "colocate":') < gen.index("self.llm = LLM(")
    assert list(inspect.signature(VLLMClient.get_server_info).parameters) == ["self"]
    info = _src(VLLMClient.get_server_info)
    assert 'f"{self.base_url}/server_info", params={"config_format": "json"}' in info
    assert 'return response.json()["vllm_config"]' in info


@pytest.fixture(scope="module")
def batch_and_trainer(toy_model_path, tmp_path_factory):
    trainer = make_trainer(toy_model_path, tmp_path_factory.mktemp("guard"), max_steps=1, beta=0.04,
                           epsilon=0.1, delta=1.5)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; _compute_loss reads it
    prompts = synthetic_prompts(2)
    with torch.no_grad():
        batch = trainer._generate_and_score_completions(
            [{"prompt": p} for p in prompts for _ in range(trainer.num_generations)])
    mask = batch["completion_mask"].bool()
    g = torch.Generator().manual_seed(0)
    shape = mask.shape
    # Old and reference log-probs away from the current ones, so r = pi/pi_old spreads over the clip range.
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), shape[1])
    batch["old_per_token_logps"] = logps + 0.4 * torch.randn(shape, generator=g)
    batch["ref_per_token_logps"] = logps + 0.2 * torch.randn(shape, generator=g)
    # Advantages of both signs, and weights well away from 1 (0.2 .. 3), zero off the mask.
    batch["advantages"] = torch.randn(shape[0], generator=g)
    weights = torch.where(mask, 0.2 + 2.8 * torch.rand(shape, generator=g), torch.zeros(()))
    return trainer, batch, weights, mask


def _loss_and_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]
    return loss.detach(), grads


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_is_weights_route_equals_trls_vllm_product(batch_and_trainer, loss_type, level):
    trainer, batch, weights, mask = batch_and_trainer
    trainer.loss_type, trainer.importance_sampling_level = loss_type, level
    assert not trainer.use_vllm
    # Reference: TRL's own vLLM branch, its flags raised on this test trainer only, ratio 1 off the mask (TRL's
    # own ratio is exp(0) there).
    ref_inputs = copy.copy(batch)
    ref_inputs["importance_sampling_ratio"] = torch.where(mask, weights, torch.ones(()))
    flags = (trainer.use_vllm, trainer.vllm_importance_sampling_correction)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    try:
        ref_loss, ref_grads = _loss_and_grads(trainer, ref_inputs)
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = flags
    plain_loss, _ = _loss_and_grads(trainer, copy.copy(batch))
    # The adapter's route, with TRL's flags as configured.
    ours = copy.copy(batch)
    saved = scale_policy_term(ours, weights, mask, trainer.loss_type)
    assert set(saved) == {"importance_sampling_ratio" if loss_type == "vespo" else "advantages"}
    loss, grads = _loss_and_grads(trainer, ours)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-7), (loss_type, level, float(loss), float(ref_loss))
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-7), (loss_type, level)
    # The weights matter here (the check above could not pass with weights ignored).
    assert abs(float(ref_loss) - float(plain_loss)) > 1e-3 * max(1.0, abs(float(plain_loss)))
