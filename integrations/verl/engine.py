"""The FSDP actor engine: verl 0.9.1's FSDP LM-head engine with the tim hooks (``engine_mixin.TIMEngineMixin``),
registered through ``EngineRegistry``.

Registered under ``device="cuda", vendor="nvidia"``: verl looks the (device, vendor) key up before its own
device-only entry (``workers/engine/base.py`` ``EngineRegistry.get_engine_cls``), so every FSDP/FSDP2 language-model
engine verl builds on NVIDIA CUDA is this class (other vendors, e.g. ROCm's "amd", and NPUs keep verl's engine).
Until ``tim_configure`` is called (only the tim trainer modes do, on the actor) every override returns the parent's
result untouched: numerics are stock verl's.

No verl object is patched (the only change to verl's state is the registry entry). What is FSDP's own here:
* ``prepare_model_outputs``: after the parent, recomputes log-probs (and entropy) as safe-vocabulary log-probs
  (``tim_plugins.safe_vocab``) from ``output.logits`` scaled as the parent scales them; both the old-log-prob pass
  and the training pass go through it. It sets the micro-batch's safe-set fields for the mixin.
* ``forward_step``: the mixin's per-micro-batch calls around verl's (``_tim_wrap_loss``, ``_tim_after_forward``).
* the LR decay's optimizer route (``optim.py``, ``optimizer_impl``), the mixin's default.
Everything else (measurement, split, merge, end of step) is the mixin's, shared with the Megatron engine.
It reads verl internals to do so: the ``output_args`` keys ``temperature_is_one``, ``temperature_rmpad``,
``input_ids_rmpad_rolled``, ``pad_size`` and ``temperature`` (filled by ``prepare_model_inputs``), the non-tensor
batch keys ``use_remove_padding`` and ``use_fused_kernels``, and the private ``_gather_and_unpad_packed``. Each is an
entry of ``sources.VERL_SOURCES``, named in a comment where it is used and checked against the installed verl by
``tests/verl_suite/test_verl_sources.py``; the safe vocabulary's hooks are the feature ``features.SAFE_VOCAB``.
"""

from __future__ import annotations

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from tim_plugins.safe_vocab import safe_logprobs_from_logits

from .config import OPTIMIZER_IMPL, TIMVerlConfig
from .engine_mixin import TIMEngineMixin, padded_response

__all__ = ["TIMFSDPEngineWithLMHead", "padded_response"]


# VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead
class TIMFSDPEngineWithLMHead(TIMEngineMixin, FSDPEngineWithLMHead):
    """verl's FSDP LM-head engine with tim-plugins' hooks (inactive until ``tim_configure``)."""

    def _tim_check_config(self, config: TIMVerlConfig) -> None:
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead (engine_config, model_config,
        # optimizer attributes)
        if config.safe_vocab.enabled and (self.engine_config.use_fused_kernels or self.model_config.use_fused_kernels):
            raise ValueError(
                f"tim.safe_vocab.min_p={config.safe_vocab.min_p!r} with use_fused_kernels=True: fused kernels return "
                "log-probs without logits, so the safe vocabulary cannot be applied. Fix: "
                "actor_rollout_ref.model.use_fused_kernels=false")
        if config.lr_decay.enable and not hasattr(self.optimizer, "tim_configure"):
            raise ValueError(
                f"tim.lr_decay.enable=true but the actor optimizer is {type(self.optimizer).__module__}."
                f"{type(self.optimizer).__name__}: the decay acts inside the optimizer's step(). Fix: "
                f"actor_rollout_ref.actor.optim.optimizer_impl={OPTIMIZER_IMPL} "
                "actor_rollout_ref.actor.optim.optimizer=AdamW")

    # ------------------------------------------------------------------------------------ safe vocabulary
    def _flat_scaled_logits(self, output, output_args, micro_batch) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """([N, V] logits / T, [N] labels, packed?) exactly as the parent sees them before log_softmax."""
        from torch.distributed.tensor import DTensor

        # VERL_SOURCES verl.utils.tensordict_utils:get_non_tensor_data (use_remove_padding, default True as the
        # parent reads it); the output_args keys below:
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_inputs
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_outputs
        # and the scaling: VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:_scale_logits_by_temperature
        use_remove_padding = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        unit = output_args.get("temperature_is_one", False)
        if use_remove_padding:
            logits = output.logits.squeeze(0)
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            if not unit:
                logits = logits / output_args["temperature_rmpad"].clamp(min=1e-8).to(logits.dtype).unsqueeze(-1)
            return logits, output_args["input_ids_rmpad_rolled"], True
        logits = output.logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        if not unit:
            t = output_args["temperature"].clamp(min=1e-8).to(logits.dtype)
            logits = logits / t.view(-1, 1, 1)
        # each row's first len(row) positions, packed, without a host read of the lengths
        input_ids = micro_batch["input_ids"]
        offsets = input_ids.offsets()
        total = input_ids.values().shape[0]
        rows = torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=offsets.device), offsets.diff(),
                                       output_size=total)
        cols = torch.arange(total, device=offsets.device) - offsets[:-1][rows]
        return logits[rows, cols], output_args["input_ids_rmpad_rolled"], False

    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_outputs
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        if self._tim is None or not self._tim.safe_vocab.enabled or "log_probs" not in model_output:
            return model_output
        # VERL_SOURCES verl.utils.tensordict_utils:get_non_tensor_data (use_fused_kernels)
        if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
            raise ValueError("tim.safe_vocab needs logits; set actor_rollout_ref.model.use_fused_kernels=false")
        want_entropy = "entropy" in model_output
        logits, labels, packed = self._flat_scaled_logits(output, output_args, micro_batch)
        # the labels are the model's own input ids: no host read to range-check them per micro-batch
        res = safe_logprobs_from_logits(logits, labels, min_p=self._tim.safe_vocab.min_p,
                                        compute_entropy=want_entropy, check_ids=False)
        fields = {"log_probs": res.logprobs, "in_safe": res.in_safe, "pruned_mass": res.pruned_mass,
                  "size": res.size}
        if want_entropy:
            fields["entropy"] = res.entropy
        cu_seqlens = micro_batch["input_ids"].offsets()
        nested = {}
        for key, value in fields.items():
            if packed:  # drop the SP / bucket padding exactly as the parent does for its log-probs
                # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine._gather_and_unpad_packed
                value = self._gather_and_unpad_packed(value, output_args["pad_size"])
            nested[key] = torch.nested.nested_tensor_from_jagged(value, cu_seqlens)
        model_output["log_probs"] = nested["log_probs"]
        if want_entropy:
            model_output["entropy"] = nested["entropy"]
        self._tim_mb = {k: nested[k] for k in ("in_safe", "pruned_mass", "size")}
        return model_output

    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.forward_step
    def forward_step(self, micro_batch, loss_function, forward_only):
        if self._tim is None:
            return super().forward_step(micro_batch, loss_function, forward_only)
        self._tim_mb = None
        loss, output = super().forward_step(micro_batch, self._tim_wrap_loss(loss_function), forward_only)
        self._tim_after_forward(micro_batch, output["model_output"], forward_only)
        return loss, output
