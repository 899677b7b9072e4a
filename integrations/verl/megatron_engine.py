"""The Megatron actor engine: verl 0.9.1's Megatron LM-head engine with the tim hooks (``engine_mixin.TIMEngineMixin``),
registered through ``EngineRegistry``.

Registered under ``device="cuda", vendor="nvidia"`` for backend "megatron": verl registers its own
``MegatronEngineWithLMHead`` under the device-only key "cuda" and looks the (device, vendor) key up first
(``workers/engine/base.py`` ``EngineRegistry.get_engine_cls``), so every Megatron language-model engine verl builds on
NVIDIA CUDA is this class. Until ``tim_configure`` is called (only the tim trainer modes do, on the actor) every
override returns the parent's result untouched: numerics are stock verl's.

No verl class or module is patched (with fused kernels and the safe vocabulary, the GPT model instance's ``forward``
for one micro-batch, below). What is Megatron's own here:
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
* the safe vocabulary (``_lm_head_logits_processor``): verl's per-micro-batch logits processor, where the
  TP-sharded logits of the last stage meet the labels, on the old-log-prob and the training pass alike. Configured
  with the safe vocabulary it scales the logits as verl does, then computes the safe log-probs (and entropy) over
  the shards (``tim_plugins.safe_vocab_tp``: the row statistics reduced over the TP group, a backward without
  communication) and returns the safe set's fields beside them; ``postprocess_micro_batch_func`` takes those out of
  the output before verl's loss and layout see it and hands them to the mixin (``_tim_mb``: the boundary mask in
  verl's loss, ``tim/safe_vocab/*``).
* the safe vocabulary with verl's fused forward (``use_fused_kernels``: no logits exist, verl computes the log-probs
  from the last hidden states in Megatron's ``output_processor`` hook, megatron-core >= 0.18): for the micro-batch's
  forward only, the GPT model's ``forward`` (an instance attribute, undone on every exit) hands Megatron our output
  processor (``_FusedSafeHead``) in place of verl's. It applies Megatron's column-parallel mapping to the hidden
  states (the sequence-parallel gather, else ``copy_to_tensor_model_parallel_region``: the hidden gradient's TP
  parts are summed in backward, as for the output layer) and computes the safe log-probs and entropy from them and
  this TP rank's rows of the output weight in chunks (``tim_plugins.safe_vocab_tp.safe_linear_logprobs_vocab_parallel``:
  never the [N, V] logits, exact gradients); verl lays the log-probs and entropy out, and ``forward_step`` lays the
  safe set's fields out the same way (verl's ``postprocess_thd_engine``) for ``postprocess_micro_batch_func``. Where
  those hooks moved the feature ``verl_megatron_fused_safe_vocab`` is off: the safe vocabulary is switched off with
  one line and ``tim/diag/feature_off/*``, the rest runs.
* the engine's kept sets (``extra_fields``, carried from the rollout server): ``forward_step`` reads them once per
  micro-batch (``_tim_micro_batch_kept``), records the packing the GPT model is called with (``_ModelCall``), and the
  logits processor or the fused head lays them over its rows (bshd: each sample at the start of its row; thd: at its
  ``cu_seqlens_q_padded`` start) and replays them (``safe_vocab_tp.replay_logprobs_vocab_parallel`` and its
  hidden-state form) instead of recomputing the cut. With context parallelism, or sets that do not fit the rows, it
  recomputes and counts ``tim/diag/kept_sets_fallback``.
* the settings it refuses (``_tim_check_config``): dynamic context parallelism. Under static context parallelism CP
  rank 0 measures, and its data-parallel group holds only CP-rank-0 ranks.
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
import itertools
import sys

import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.utils import VocabUtility
from verl.utils import tensordict_utils as tu
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from tim_plugins.capabilities import check
from tim_plugins.lr_scaling import ControllerCheckpoint
from tim_plugins.patching import Patch
from tim_plugins.safe_head import kept_set_logprobs

from . import _plugin_import_ended
from .config import TIMVerlConfig
from .engine_mixin import TIMEngineMixin
from .micro_batch import place_kept
from .features import MEGATRON_FUSED_SAFE_VOCAB, MEGATRON_SYNC_CHECK, SYNC_CHECK

__all__ = ["TIMMegatronEngineWithLMHead"]

# The safe set's fields of a micro-batch in the logits processor's output (float, the log-probs' layout: verl lays
# out every entry alike), and the dtype each goes back to for the mixin.
_SAFE_FIELDS = {"tim_in_safe": ("in_safe", torch.bool), "tim_pruned_mass": ("pruned_mass", torch.float32),
                "tim_size": ("size", torch.long)}


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

    def _tim_fused(self) -> bool:
        """Whether verl's fused forward computes this engine's log-probs (verl turns the setting off at
        initialisation where it cannot apply: without remove-padding, for value models, with MTP)."""
        # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.forward_step
        return bool(self.engine_config.use_fused_kernels)

    def _tim_safe_vocab_feature(self) -> str | None:
        return MEGATRON_FUSED_SAFE_VOCAB.name if self._tim_fused() else None

    # a moved hook of either switches the weight-sync check off
    _TIM_SYNC_FEATURES = (SYNC_CHECK.name, MEGATRON_SYNC_CHECK.name)

    def _tim_features_off(self, config: TIMVerlConfig) -> tuple[str, ...]:
        wanted = [f for f, on in ((MEGATRON_FUSED_SAFE_VOCAB, config.safe_vocab.enabled and self._tim_fused()),
                                  (MEGATRON_SYNC_CHECK, config.sync_check.enable)) if on]
        off = []
        for feature in wanted:
            status = check(feature)
            if not status.available:
                print(status.warning(), file=sys.stderr)
                off.append(feature.name)
        return tuple(off)

    # ------------------------------------------------------------------------------------------ LR decay
    # Megatron's OptimizerParamScheduler writes every param group's LR from its schedule at each step
    # (VERL_MEGATRON_SOURCES megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.step), and verl logs
    # param_groups[0]["lr"] as actor/lr (VERL_MEGATRON_SOURCES verl.utils.megatron.optimizer:get_megatron_last_lr).
    # The scale is written over the schedule's LR before a global step's first optimizer step (the mixin's feed of the
    # controller; the scheduler steps once per global step, so the step's later optimizer steps keep it), and
    # the controller's state is kept in the optimizer's param_groups[0], which verl's Megatron checkpoint saves and
    # restores (the optimizer's sharded state dict carries the param groups).
    # Only the output-holding ranks measure the step's k3 and get verl's grad norm, so the holders' decision is
    # handed to every rank (one all_gather_object per global step): all model-parallel shards step with one LR,
    # and every rank's controller holds the same state (rank 0 saves the checkpoint's param groups).
    _tim_lr_checkpoint: ControllerCheckpoint | None = None
    _tim_lr_value = 1.0

    @property
    def _tim_lr_controller(self):
        return self._tim_lr_checkpoint.controller if self._tim_lr_checkpoint is not None else None

    def _tim_lr_attach(self, controller) -> None:
        self._tim_lr_checkpoint = ControllerCheckpoint(self.optimizer, controller)  # a checkpoint loaded before
        self._tim_lr_value = float(controller.scale)

    def _tim_lr_detach(self) -> None:
        if self._tim_lr_checkpoint is not None:
            self._tim_lr_checkpoint.detach()
        self._tim_lr_value = 1.0
        self._tim_lr_write(1.0)

    def _tim_lr_sync(self) -> None:
        if self._tim_lr_checkpoint is not None:
            self._tim_lr_checkpoint.sync()  # verl's load_checkpoint since the last step

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
        if self._tim_lr_checkpoint is not None:
            self._tim_lr_checkpoint.store()

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

    # ----------------------------------------------------------------------------------- safe vocabulary
    # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead._lm_head_logits_processor
    def _lm_head_logits_processor(self, logits, label, temperature, *, calculate_sum_pi_squared: bool,
                                  calculate_entropy: bool, distillation_use_topk: bool, distillation_only: bool,
                                  logits_processor_func, batch, data_format: str):
        kwargs = dict(calculate_sum_pi_squared=calculate_sum_pi_squared, calculate_entropy=calculate_entropy,
                      distillation_use_topk=distillation_use_topk, distillation_only=distillation_only,
                      logits_processor_func=logits_processor_func, batch=batch, data_format=data_format)
        if self._tim is None or self._tim_truncation is None:
            return super()._lm_head_logits_processor(logits, label, temperature, **kwargs)
        if distillation_use_topk or distillation_only:
            raise ValueError(
                f"{self._tim.safe_vocab.setting} with top-k distillation on the Megatron actor: "
                "the distillation loss reads the full-vocabulary student logits while the policy loss would read "
                "safe-vocabulary log-probs. Fix: drop +tim.safe_vocab.min_p / +tim.safe_vocab.enable, or turn the distillation off")
        if logits.shape[:2] != label.shape[:2]:
            raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(label.shape)}: verl's logits processor "
                             "expects the same leading [batch, sequence] shape")
        # the parent's scaling, in place in the logits' dtype (the same rounding as verl's own log-probs):
        # a padding position's temperature <= 0 becomes 1e-8
        temperature[temperature <= 0] = 1e-8
        logits.div_(temperature.unsqueeze(dim=-1).to(logits.dtype))
        ret = {}
        if calculate_sum_pi_squared:  # full-vocabulary, as the parent computes it
            # VERL_MEGATRON_SOURCES verl.utils.megatron.tensor_parallel:vocab_parallel_sum_pi_squared
            from verl.utils.megatron.tensor_parallel import vocab_parallel_sum_pi_squared

            ret["sum_pi_squared"] = vocab_parallel_sum_pi_squared(logits)
        # the shard's columns: Megatron's own split of the vocabulary (rank x partition width), over the TP group
        # VERL_MEGATRON_SOURCES megatron.core.tensor_parallel.utils:VocabUtility.vocab_range_from_per_partition_vocab_size
        # VERL_MEGATRON_SOURCES megatron.core.parallel_state:get_tensor_model_parallel_group
        # VERL_MEGATRON_SOURCES megatron.core.parallel_state:get_tensor_model_parallel_rank
        # VERL_MEGATRON_SOURCES megatron.core.parallel_state:get_tensor_model_parallel_world_size
        width = logits.shape[-1]
        start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(
            width, mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size())
        group = mpu.get_tensor_model_parallel_group()
        call = self._tim_call
        kept = _kept_rows(self._tim_kept, self._tim_pipeline, label.shape, data_format == "thd",
                          None if call is None else call.packed_seq_params)
        # logits already divided by the temperature above
        res = kept_set_logprobs(label.reshape(-1), self._tim_truncation, kept, logits=logits.reshape(-1, width),
                                group=group, vocab_start=int(start), compute_entropy=bool(calculate_entropy))
        shape = label.shape
        ret["log_probs"] = res.logprobs.view(shape)
        if calculate_entropy:
            ret["entropy"] = res.entropy.view(shape)
        ret["tim_in_safe"] = res.in_safe.view(shape).float()
        ret["tim_pruned_mass"] = res.pruned_mass.view(shape)
        ret["tim_size"] = res.size.view(shape).float()  # |S| <= V < 2^24: exact
        return ret

    def _tim_take_safe_fields(self, output) -> None:
        """The safe set's fields out of the processor's laid-out output (before verl's loss and outputs see it),
        into ``_tim_mb`` in the dtypes the mixin reads (jagged nested on the input ids, as the log-probs)."""
        if not isinstance(output, dict) or not any(k in output for k in _SAFE_FIELDS):
            return
        fields = {}
        for key, (name, dtype) in _SAFE_FIELDS.items():
            value = output.pop(key)
            if value.is_nested:
                value = torch.nested.nested_tensor_from_jagged(value.values().to(dtype), value.offsets())
            else:
                value = value.to(dtype)
            fields[name] = value
        self._tim_mb = fields

    _tim_call = None  # the model call of the micro-batch in flight (_ModelCall), where forward_step set one up

    # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.forward_step
    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        if self._tim is None or self._tim_truncation is None:
            return super().forward_step(batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        batch = next(batch_iter)  # handed back to verl's forward_step below, which takes one micro-batch
        batch_iter = itertools.chain([batch], batch_iter)
        # VERL_MEGATRON_SOURCES verl.utils.megatron_utils:unwrap_model
        from verl.utils.megatron_utils import unwrap_model

        unwrapped = unwrap_model(model)
        gpt = getattr(unwrapped, "language_model", unwrapped)  # verl's _get_patching_model: the GPT model
        # the engine's kept sets where the rollout carried them (read once per micro-batch, for either head), by the
        # model chunk that computes the log-probs alone: an earlier stage, or an earlier virtual chunk of the last
        # stage (forward_step runs once per chunk), has no use for them and would count a fallback again
        kept = self._tim_micro_batch_kept(batch) if getattr(gpt, "post_process", True) else None
        # VERL_MEGATRON_SOURCES megatron.core.parallel_state:get_context_parallel_world_size
        if kept is not None and mpu.get_context_parallel_world_size() > 1:
            # each CP rank holds a (zigzag) slice of every sequence; the sets are laid out over whole sequences
            self._tim_pipeline.count("kept_sets_fallback", detail="context parallelism: replay of the engine's kept "
                                     "sets is not implemented there; the trainer recomputes them")
            kept = None
        fused = self._tim_fused()
        if kept is None and not fused:
            return super().forward_step(batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        head = None
        if fused:
            want_entropy = bool(tu.get_non_tensor_data(batch, key="calculate_entropy", default=False))
            head = _FusedSafeHead(self._tim_truncation, want_entropy, kept, self._tim_pipeline)
        call = _ModelCall(head)
        self._tim_kept, self._tim_call = kept, call
        try:
            with Patch(gpt, "forward", call.forward_of):
                output, post = super().forward_step(batch_iter, model, logits_processor_func,
                                                    postprocess_micro_batch_func)
        finally:
            self._tim_kept = self._tim_call = None
        if head is None:
            return output, post
        if head.fields is None:
            if getattr(gpt, "post_process", False):  # the last stage computed log-probs without our head
                self._tim_pipeline.count("safe_vocab_fused_unapplied", detail="Megatron's output processor was not "
                                         "called with verl's fused head: these log-probs are the full vocabulary's")
            return output, post
        # the safe set's fields laid out as verl lays out the log-probs (jagged nested on the input ids), for
        # postprocess_micro_batch_func to take out before verl's loss sees the output
        # VERL_MEGATRON_SOURCES verl.models.mcore.util:postprocess_thd_engine
        # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine._get_context_parallel_layout
        from verl.models.mcore.util import postprocess_thd_engine

        data = post.keywords["data"]
        for key, value in head.fields.items():
            output[key] = postprocess_thd_engine(
                value, head.packed_seq_params, data["input_ids"], data["input_ids"].shape[0], post_process=True,
                local_cp_size=post.keywords.get("local_cp_size"),
                cp_layout=self._get_context_parallel_layout(unwrapped))
        return output, post

    # ------------------------------------------------------------------------------------ per micro-batch
    # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.postprocess_micro_batch_func
    def postprocess_micro_batch_func(self, output, data, forward_only, loss_function, local_cp_size=None):
        if self._tim is None:
            return super().postprocess_micro_batch_func(output, data, forward_only, loss_function,
                                                        local_cp_size=local_cp_size)
        self._tim_mb = None
        self._tim_take_safe_fields(output)
        result = super().postprocess_micro_batch_func(output, data, forward_only, self._tim_wrap_loss(loss_function),
                                                      local_cp_size=local_cp_size)
        # the parent's model_output is prepare_model_outputs(output, data), i.e. ``output`` itself: verl's per-token
        # log_probs (jagged nested on data["input_ids"]); only the output rank measures (the mixin checks)
        # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.prepare_model_outputs
        self._tim_after_forward(data, self.prepare_model_outputs(output, data), forward_only)
        return result


def _kept_rows(kept, pipeline, labels_shape, thd: bool, packed_seq_params):
    """A micro-batch's engine kept sets (``MicroBatchKeptSets``) over a head's rows ([b, s] bshd: each sample at the
    start of its row; [1, T] thd: each sample at its ``cu_seqlens_q_padded`` start), or None: recompute."""
    if kept is None:
        return None
    if not thd:
        return place_kept(kept, pipeline, labels_shape=labels_shape, packed=False)
    # VERL_MEGATRON_SOURCES verl.models.mcore.model_forward:gptmodel_forward_model_engine
    # VERL_MEGATRON_SOURCES verl.models.mcore.util:preprocess_thd_engine
    starts = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if starts is None:
        if pipeline is not None:
            pipeline.count("kept_sets_fallback", detail="a thd micro-batch without its packing "
                           "(packed_seq_params.cu_seqlens_q_padded): the trainer recomputes the kept set")
        return None
    return place_kept(kept, pipeline, labels_shape=labels_shape, packed=False, starts=starts[:-1])


class _FusedSafeHead:
    """Megatron's output processor for one fused forward (GPTModel.forward's ``output_processor``, megatron-core
    >= 0.18, called on the last pipeline stage with the decoder's hidden states), in place of verl's
    ``fused_output_processor``: the safe log-probs (and entropy) over the sampler's kept set, or over the engine's own
    kept sets where the micro-batch carries them, from the hidden states and this TP rank's rows of the output weight,
    chunked (``safe_vocab_tp``). Keeps the safe set's fields and the packing (``packed_seq_params``) for
    ``forward_step`` to lay them out."""

    def __init__(self, truncation, want_entropy: bool, kept=None, pipeline=None) -> None:
        self.truncation, self.want_entropy = truncation, want_entropy
        self.kept, self.pipeline = kept, pipeline  # the engine's kept sets (MicroBatchKeptSets): replayed if given
        self.fields: dict[str, torch.Tensor] | None = None
        self.packed_seq_params = None

    # VERL_MEGATRON_SOURCES megatron.core.models.gpt.gpt_model:GPTModel._postprocess
    def __call__(self, *, hidden_states, output_layer, output_weight, labels, context, config,
                 packed_seq_params=None, **_ignored):
        # VERL_MEGATRON_SOURCES megatron.core.tensor_parallel.mappings:gather_from_sequence_parallel_region
        # VERL_MEGATRON_SOURCES megatron.core.tensor_parallel.mappings:copy_to_tensor_model_parallel_region
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region)
        # VERL_MEGATRON_SOURCES verl.utils.model:CausalLMOutputForPPO
        from verl.utils.model import CausalLMOutputForPPO

        # Megatron's column-parallel output layer's input mapping: forward the whole sequence on every TP rank,
        # backward the sum of the ranks' parts of the hidden gradient
        if config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden_states)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden_states)
        weight = output_weight if output_weight is not None else output_layer.weight  # tied: the embedding's
        width = weight.shape[0]
        start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(
            width, mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size())
        rows = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])  # [s, b, H] -> the labels' [b, s] order
        if rows.shape[0] != labels.numel():
            raise ValueError(f"hidden states {tuple(hidden.shape)} and labels {tuple(labels.shape)}: Megatron's output "
                             "processor expects one label per position")
        # VERL_MEGATRON_SOURCES verl.models.mcore.model_forward_fused:FusedOutputProcessorContext
        temperature = float(context.temperature)
        group = mpu.get_tensor_model_parallel_group()
        kept = _kept_rows(self.kept, self.pipeline, labels.shape, True, packed_seq_params)  # verl's fused path: thd
        res = kept_set_logprobs(labels.reshape(-1), self.truncation, kept, hidden=rows, weight=weight,
                                temperature=temperature, group=group, vocab_start=int(start),
                                compute_entropy=self.want_entropy)
        shape = labels.shape
        self.fields = {"tim_in_safe": res.in_safe.view(shape).float(), "tim_pruned_mass": res.pruned_mass.view(shape),
                       "tim_size": res.size.view(shape).float()}
        self.packed_seq_params = packed_seq_params
        return CausalLMOutputForPPO(log_probs=res.logprobs.view(shape),
                                    entropy=None if res.entropy is None else res.entropy.view(shape))


class _ModelCall:
    """The GPT model's forward for one micro-batch (an instance attribute for that forward only): records the
    packing it is called with (``packed_seq_params``: where each sample's rows are in the thd layout, for the engine's
    kept sets) and, with fused kernels, hands Megatron ``head`` as the output processor in place of verl's."""

    def __init__(self, head: _FusedSafeHead | None) -> None:
        self.head = head
        self.packed_seq_params = None

    def forward_of(self, original):
        # VERL_MEGATRON_SOURCES verl.models.mcore.model_forward_fused:fused_forward_model_engine
        # VERL_MEGATRON_SOURCES megatron.core.models.gpt.gpt_model:GPTModel.forward
        def forward(*args, **kwargs):
            self.packed_seq_params = kwargs.get("packed_seq_params")
            if self.head is not None and kwargs.get("output_processor") is not None:
                kwargs["output_processor"] = self.head
            return original(*args, **kwargs)
        return forward


_plugin_import_ended()  # a plugin registration deferred while this module was half-imported (plugin.py)
