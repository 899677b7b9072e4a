"""Guards on the verl 0.9.1 internals the Megatron engine relies on (``integrations/verl/sources.py``
``VERL_MEGATRON_SOURCES``), against the installed verl and megatron-core (only this suite's environment has
megatron-core): every entry resolves, the feature that names them holds, and the statements and signatures the
subclass binds are still there. The numerics are tested end to end in ``test_megatron_engine.py``."""

from __future__ import annotations

import inspect

import pytest

from tim_plugins.capabilities import check, resolve
from tim_plugins.integrations.verl import features
from tim_plugins.integrations.verl.sources import VERL_MEGATRON_SOURCES

TM = "verl.workers.engine.megatron.transformer_impl"


@pytest.mark.parametrize("key", sorted(VERL_MEGATRON_SOURCES), ids=lambda k: f"{k[0]}:{k[1]}")
def test_every_named_source_exists(key):
    assert resolve(*key) is not None


@pytest.mark.parametrize("feature", [features.MEGATRON_ENGINE, features.MEGATRON_FUSED_SAFE_VOCAB,
                                     features.MEGATRON_SYNC_CHECK],
                         ids=lambda f: f.name)
def test_the_megatron_features_hold_and_check_only_named_sources(feature):
    status = check(feature)
    assert status.available, status.warning()
    assert [s.name for s in features.megatron_features()] == ["verl_megatron_engine", "verl_megatron_fused_safe_vocab",
                                                              "verl_megatron_sync_check"]
    named = {**VERL_MEGATRON_SOURCES, **features.VERL_SOURCES}
    assert all((h.module, h.qualname) in named for h in feature.hooks)


def test_verl_takes_megatrons_output_processor_hook_here():
    """verl's fused forward uses the hook (megatron-core >= 0.18) rather than its legacy forward patch, which the
    fused safe vocabulary has no way into."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from verl.models.mcore import model_forward_fused as mf

    model = GPTModel.__new__(GPTModel)
    assert mf._resolve_fused_forward_mode(model) == mf._HOOK_MODE


def test_the_subclass_keeps_the_parents_signatures_and_verl_registers_its_engine_without_a_vendor():
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from tim_plugins.integrations.verl.megatron_engine import TIMMegatronEngineWithLMHead

    for name in ("postprocess_micro_batch_func", "forward_backward_batch", "train_batch", "lr_scheduler_step",
                 "_lm_head_logits_processor", "forward_step"):
        assert (inspect.signature(getattr(TIMMegatronEngineWithLMHead, name)).parameters.keys()
                == inspect.signature(getattr(MegatronEngineWithLMHead, name)).parameters.keys()), name
    entries = EngineRegistry._engines["language_model"]["megatron"]
    assert entries["cuda"] is MegatronEngineWithLMHead and ("cuda", "nvidia") in entries


def test_output_rank_and_loss_call_are_where_the_engine_reads_them():
    post = inspect.getsource(resolve(TM, "MegatronEngineWithLMHead.postprocess_micro_batch_func"))
    assert "model_output = self.prepare_model_outputs(output, data)" in post
    assert "loss_function(model_output=model_output, data=data, dp_group=self.get_data_parallel_group())" in post
    assert "return output" in inspect.getsource(resolve(TM, "MegatronEngineWithLMHead.prepare_model_outputs"))
    src_rank = inspect.getsource(resolve(TM, "MegatronEngine.is_mp_src_rank_with_outputs"))
    for part in ("mpu.get_tensor_model_parallel_rank() == 0", "mpu.get_context_parallel_rank() == 0",
                 "mpu.get_pipeline_model_parallel_rank() == mpu.get_pipeline_model_parallel_world_size() - 1"):
        assert part in src_rank
    fbb = inspect.getsource(resolve(TM, "MegatronEngine.forward_backward_batch"))
    assert "partial(\n            self.postprocess_micro_batch_func," in fbb
    assert 'loss_mask = data["loss_mask"]' in fbb
    assert "return mpu.get_data_parallel_group()" in inspect.getsource(
        resolve(TM, "MegatronEngine.get_data_parallel_group"))


def test_the_engine_computes_in_the_dtype_the_audit_reads():
    # integrations/verl/parity_spec.py reads a Megatron actor's dtype from actor.megatron.dtype
    assert "self.param_dtype = PrecisionType.to_dtype(self.engine_config.dtype)" in inspect.getsource(
        resolve(TM, "MegatronEngine._build_tf_config"))


def test_the_scheduler_writes_the_lr_the_engine_scales():
    step = inspect.getsource(resolve("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.step"))
    assert "param_group['lr'] = self.get_lr(param_group)" in step
    assert "param_group['lr'].fill_(self.get_lr(param_group))" in step
    assert 'return optimizer.param_groups[0]["lr"]' in inspect.getsource(
        resolve("verl.utils.megatron.optimizer", "get_megatron_last_lr"))
    assert "get_megatron_last_lr(self.optimizer)" in inspect.getsource(resolve(TM, "MegatronEngine.lr_scheduler_step"))


def test_the_logits_processor_scales_and_is_bound_where_the_safe_vocabulary_takes_it_over():
    proc = inspect.getsource(resolve(TM, "MegatronEngineWithLMHead._lm_head_logits_processor"))
    for part in ("temperature[temperature <= 0] = 1e-8", "logits.div_(temperature.unsqueeze(dim=-1).to(logits.dtype))",
                 'ret["log_probs"] = vocab_parallel_log_probs_from_logits(logits_bak, label)',
                 'ret["sum_pi_squared"] = vocab_parallel_sum_pi_squared(logits)'):
        assert part in proc, part
    step = inspect.getsource(resolve(TM, "MegatronEngineWithLMHead.forward_step"))
    assert "partial(\n                self._lm_head_logits_processor," in step
    assert step.index("if use_fused_kernels:\n            from verl.models.mcore") < step.index(
        "self._lm_head_logits_processor")  # the fused forward never calls the processor
    # Megatron's own cross entropy splits the vocabulary by the same rule the engine reads the shard's start from
    ce = inspect.getsource(resolve("megatron.core.tensor_parallel.cross_entropy", "_VocabParallelCrossEntropy.forward"))
    assert "VocabUtility.vocab_range_from_per_partition_vocab_size" in ce


def test_the_engine_forward_hands_the_model_its_thd_packing():
    """The kept sets' thd rows come from the packing the GPT model is called with (``_ModelCall``): verl's engine
    forward passes it by keyword, padded sample by sample."""
    fwd = inspect.getsource(resolve("verl.models.mcore.model_forward", "gptmodel_forward_model_engine"))
    assert "packed_seq_params=packed_seq_params," in fwd and "output_dict = logits_processor(output_orig, **args)" in fwd
    pre = inspect.getsource(resolve("verl.models.mcore.util", "preprocess_thd_engine"))
    assert "cu_seqlens_q_padded=cu_seqlens_padded," in pre
