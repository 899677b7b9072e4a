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
* the LR decay's route (``_tim_lr_*``): the scale over Megatron's scheduled LR, the holders' decision on every rank,
  the controller's state in the optimizer's param groups (see the comment on the ``_tim_lr_*`` methods).
* the settings it refuses (``_tim_check_config``): the safe vocabulary (its tensor-parallel form is not written yet)
  and dynamic context parallelism. Under static context parallelism CP rank 0 measures, and its data-parallel group
  holds only CP-rank-0 ranks.
The mixin's overrides call the parent's: the merge after a forward-only pass, over the data-parallel group, and the
end of the actor update:
VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine.forward_backward_batch
VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine.get_data_parallel_group
VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine.lr_scheduler_step
Each verl internal it reads is an entry of ``sources.VERL_MEGATRON_SOURCES``, named where it is used and checked
against the installed verl and megatron-core by ``tests/megatron_suite/test_megatron_sources.py``.
"""

from __future__ import annotations

import copy

import torch
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from tim_plugins.lr_scaling import CONTROLLER_STATE_KEY, restore_controller_state, store_controller_state

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

    # ------------------------------------------------------------------------------------------ LR decay
    # Megatron's OptimizerParamScheduler writes every param group's LR from its schedule at each step
    # (VERL_MEGATRON_SOURCES megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.step), and verl logs
    # param_groups[0]["lr"] as actor/lr (VERL_MEGATRON_SOURCES verl.utils.megatron.optimizer:get_megatron_last_lr).
    # The scale is written over the schedule's LR right before each optimizer step (the mixin's end of step), and
    # the controller's state is kept in the optimizer's param_groups[0], which verl's Megatron checkpoint saves and
    # restores (the optimizer's sharded state dict carries the param groups).
    # Only the output-holding ranks measure the step's k3 and get verl's grad norm, so the holders' decision is
    # handed to every rank (one all_gather_object per optimizer step): all model-parallel shards step with one LR,
    # and every rank's controller holds the same state (rank 0 saves the checkpoint's param groups).
    _tim_lr_controller = None
    _tim_lr_value = 1.0

    def _tim_lr_attach(self, controller) -> None:
        self._tim_lr_controller = controller
        restore_controller_state(self.optimizer, controller)  # a checkpoint loaded before configure
        self._tim_lr_stored = self.optimizer.param_groups[0].get(CONTROLLER_STATE_KEY)
        self._tim_lr_value = float(controller.scale)

    def _tim_lr_detach(self) -> None:
        self._tim_lr_controller = None
        self._tim_lr_value = 1.0
        self._tim_lr_write(1.0)

    def _tim_lr_sync(self) -> None:
        stored = self.optimizer.param_groups[0].get(CONTROLLER_STATE_KEY)
        if self._tim_lr_controller is not None and stored is not None and stored is not self._tim_lr_stored:
            restore_controller_state(self.optimizer, self._tim_lr_controller)  # verl's load_checkpoint since
            self._tim_lr_stored = self.optimizer.param_groups[0][CONTROLLER_STATE_KEY]

    def _tim_lr_apply(self, scale: float) -> None:
        controller = self._tim_lr_controller
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            mine = (self._tim_holds_outputs(), float(scale), controller.state_dict() if controller else None)
            everyone = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, mine)
            holds, scale, state = next(x for x in everyone if x[0])
            if controller is not None and not self._tim_holds_outputs():
                controller.load_state_dict(copy.deepcopy(state))
        self._tim_lr_value = float(scale)
        self._tim_lr_write(self._tim_lr_value)
        if controller is not None:
            store_controller_state(self.optimizer, controller)
            self._tim_lr_stored = self.optimizer.param_groups[0][CONTROLLER_STATE_KEY]

    def _tim_lr_scale(self) -> float:
        return self._tim_lr_value

    def _tim_lr_write(self, scale: float) -> None:
        """Every param group's LR: the schedule's (as its last step set it) times ``scale``."""
        # VERL_MEGATRON_SOURCES megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.get_lr
        for group in self.optimizer.param_groups:
            lr = self.lr_scheduler.get_lr(group) * scale
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    # ------------------------------------------------------------------------------------ per micro-batch
    # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.postprocess_micro_batch_func
    def postprocess_micro_batch_func(self, output, data, forward_only, loss_function, local_cp_size=None):
        if self._tim is None:
            return super().postprocess_micro_batch_func(output, data, forward_only, loss_function,
                                                        local_cp_size=local_cp_size)
        result = super().postprocess_micro_batch_func(output, data, forward_only, self._tim_wrap_loss(loss_function),
                                                      local_cp_size=local_cp_size)
        # the parent's model_output is prepare_model_outputs(output, data), i.e. ``output`` itself: verl's per-token
        # log_probs (jagged nested on data["input_ids"]); only the output rank measures (the mixin checks)
        # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.prepare_model_outputs
        self._tim_after_forward(data, self.prepare_model_outputs(output, data), forward_only)
        return result
