"""The Megatron actor engine: verl 0.9.1's Megatron LM-head engine with the tim hooks (``engine_mixin.TIMEngineMixin``),
registered through ``EngineRegistry``.

Registered under ``device="cuda", vendor="nvidia"`` for backend "megatron": verl registers its own
``MegatronEngineWithLMHead`` under the device-only key "cuda" and looks the (device, vendor) key up first
(``workers/engine/base.py`` ``EngineRegistry.get_engine_cls``), so every Megatron language-model engine verl builds on
NVIDIA CUDA is this class. Until ``tim_configure`` is called (only the tim trainer modes do, on the actor) every
override returns the parent's result untouched: numerics are stock verl's.

No verl object is patched. What is Megatron's own here:
* ``postprocess_micro_batch_func``: verl's per-micro-batch step on the last pipeline stage, where the micro-batch, the
  model's per-token outputs and verl's loss call meet; the mixin's calls go around the parent's
  (``_tim_wrap_loss``, ``_tim_after_forward``).
* which ranks measure: Megatron computes the log-probs on every tensor-parallel rank of the last pipeline stage
  (``vocab_parallel_log_probs_from_logits`` reduces over TP), but only the rank verl takes its outputs from
  (``is_mp_src_rank_with_outputs``: TP rank 0, last stage, CP rank 0) measures, merges over its data-parallel group
  (``mpu.get_data_parallel_group()``: the ranks with the same TP/PP/CP coordinates) and reports; the others measure
  nothing (one dump file per data-parallel rank, not one per TP rank).
* the settings it refuses (``_tim_check_config``): the safe vocabulary (its tensor-parallel form is not written yet),
  the LR decay (Megatron's optimizer and ``OptimizerParamScheduler`` are not the FSDP route's) and dynamic context
  parallelism. Static context parallelism: CP rank 0 measures, its data-parallel group holds only CP-rank-0 ranks.
The mixin's overrides call the parent's: the merge after a forward-only pass
(VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine.forward_backward_batch), over the
data-parallel group (VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine.get_data_parallel_group),
and the end of the actor update (VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine.lr_scheduler_step).
Each verl internal it reads is an entry of ``sources.VERL_MEGATRON_SOURCES``, named where it is used and checked
against the installed verl and megatron-core by ``tests/megatron_suite/test_megatron_sources.py``.
"""

from __future__ import annotations

from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from .config import TIMVerlConfig
from .engine_mixin import TIMEngineMixin

__all__ = ["TIMMegatronEngineWithLMHead"]


# VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead
class TIMMegatronEngineWithLMHead(TIMEngineMixin, MegatronEngineWithLMHead):
    """verl's Megatron LM-head engine with tim-plugins' hooks (inactive until ``tim_configure``)."""

    # ------------------------------------------------------------------------------------- backend hooks
    def _tim_holds_outputs(self) -> bool:
        # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine.is_mp_src_rank_with_outputs
        return bool(self.is_mp_src_rank_with_outputs())

    def _tim_check_config(self, config: TIMVerlConfig) -> None:
        # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine.is_mp_src_rank_with_outputs
        # (under dynamic CP one rank of the whole DPxCP plane holds the outputs: its merge would wait for the others)
        if self.engine_config.dynamic_context_parallel:
            raise ValueError(
                "actor_rollout_ref.actor.megatron.dynamic_context_parallel=True with a tim trainer mode: the tim "
                "engine does not support Megatron's dynamic context parallelism (one rank of the whole data x "
                "context plane holds the outputs). Fix: actor_rollout_ref.actor.megatron.dynamic_context_parallel="
                "False")
        if config.safe_vocab.enabled:
            raise ValueError(
                f"tim.safe_vocab.min_p={config.safe_vocab.min_p!r} with actor strategy megatron: the safe vocabulary "
                "is not available on verl's Megatron engine yet (its logits are split over the tensor-parallel "
                "ranks). Fix: tim.safe_vocab.min_p=0 (the monitor works), or actor_rollout_ref.actor.strategy=fsdp2")
        if config.lr_decay.enable:
            raise ValueError(
                "tim.lr_decay.enable=true with actor strategy megatron: the LR decay is not available on verl's "
                "Megatron engine yet (Megatron's optimizer and scheduler are not the FSDP route's). Fix: "
                "tim.lr_decay.enable=false, or actor_rollout_ref.actor.strategy=fsdp2")

    # ------------------------------------------------------------------------------------ per micro-batch
    # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.postprocess_micro_batch_func
    def postprocess_micro_batch_func(self, output, data, forward_only, loss_function, local_cp_size=None):
        if self._tim is None:
            return super().postprocess_micro_batch_func(output, data, forward_only, loss_function,
                                                        local_cp_size=local_cp_size)
        result = super().postprocess_micro_batch_func(output, data, forward_only, self._tim_wrap_loss(loss_function),
                                                      local_cp_size=local_cp_size)
        if self._tim_holds_outputs():
            # the parent's model_output is prepare_model_outputs(output, data), i.e. ``output`` itself: verl's
            # per-token log_probs (jagged nested on data["input_ids"])
            # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.prepare_model_outputs
            self._tim_after_forward(data, self.prepare_model_outputs(output, data), forward_only)
        else:
            self._tim_mb = None
        return result
