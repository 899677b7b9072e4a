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
  and the training pass go through it. Where the micro-batch carries the rollout engine's own kept sets
  (``micro_batch.kept_sets_of_micro_batch``), they are replayed (``tim_plugins.replay``) instead of recomputed,
  in the logits path and the fused head alike. It sets the micro-batch's safe-set fields for the mixin.
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

from collections import OrderedDict

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from tim_plugins.patching import Patch
from tim_plugins.safe_head import kept_set_logprobs
from tim_plugins.safe_vocab import full_weight

from . import _plugin_import_ended
from .config import OPTIMIZER_IMPL, TIMVerlConfig
from .engine_mixin import TIMEngineMixin
from .micro_batch import padded_response, place_kept

__all__ = ["TIMFSDPEngineWithLMHead", "padded_response"]


# VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead
class TIMFSDPEngineWithLMHead(TIMEngineMixin, FSDPEngineWithLMHead):
    """verl's FSDP LM-head engine with tim-plugins' hooks (inactive until ``tim_configure``)."""

    def _tim_check_config(self, config: TIMVerlConfig) -> None:
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead (engine_config, model_config,
        # optimizer attributes)
        fused = self.engine_config.use_fused_kernels or self.model_config.use_fused_kernels
        if config.safe_vocab.enabled and fused and not hasattr(self._tim_lm_model(), "lm_head"):
            raise ValueError(
                f"{config.safe_vocab.setting} with use_fused_kernels=True on "
                f"{type(self._tim_lm_model()).__name__}, which has no lm_head: the safe vocabulary's fused head "
                "needs the model's final hidden states and lm_head weight. Fix: "
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
        if self._tim is None or self._tim_truncation is None or "log_probs" not in model_output:
            return model_output
        if isinstance(output, _SafeFusedOutput):  # the fused head below computed them: the parent has laid them out
            fields = {k: output.safe[k] for k in ("in_safe", "pruned_mass", "size")}
            self._tim_mb = {k: self._tim_as_nested(v, output_args, micro_batch, packed=output.packed)
                            for k, v in fields.items()}
            return model_output
        want_entropy = "entropy" in model_output
        logits, labels, packed = self._flat_scaled_logits(output, output_args, micro_batch)
        t = self._tim_truncation
        # the engine's own kept set per response token, at the row that predicts it (prompt and padding rows: the
        # whole vocabulary); the logits are already divided by the temperature, as the parent scales them, and their
        # rows are verl's packed layout in both paths (_flat_scaled_logits lays the padded one out so)
        kept = place_kept(self._tim_kept, self._tim_pipeline, labels_shape=labels.shape, packed=True)
        # the labels are the model's own input ids: no host read to range-check them per micro-batch
        res = kept_set_logprobs(labels, t, kept, logits=logits, compute_entropy=want_entropy, check_ids=False)
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

    def _tim_as_nested(self, value: torch.Tensor, output_args, micro_batch, *, packed: bool) -> torch.Tensor:
        """A per-position output of the model ([1, N + pad] packed, [B, L] padded) as the parent lays its log-probs
        out: jagged nested on the input ids."""
        input_ids = micro_batch["input_ids"]
        if packed:
            # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine._gather_and_unpad_packed
            value = self._gather_and_unpad_packed(value.squeeze(0), output_args["pad_size"])
        else:  # each row's first len(row) positions, without a host read of the lengths
            offsets = input_ids.offsets()
            total = input_ids.values().shape[0]
            rows = torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=offsets.device), offsets.diff(),
                                           output_size=total)
            value = value[rows, torch.arange(total, device=offsets.device) - offsets[:-1][rows]]
        return torch.nested.nested_tensor_from_jagged(value, input_ids.offsets())

    def _tim_lm_model(self):
        """The transformers model inside the FSDP wrapping (FSDP2 wraps in place; FSDP1 holds it in
        ``_fsdp_wrapped_module``) and, on a LoRA actor (``model.lora_rank > 0``), inside PEFT's ``PeftModel``
        (``get_base_model()``, whose ``forward`` ``PeftModel.forward`` reaches through the tuner's ``model.forward``):
        the object whose ``forward`` verl's fused kernels replaced, with the base model (``.model``) and ``lm_head``."""
        model = getattr(self.module, "_fsdp_wrapped_module", self.module)
        base = getattr(model, "get_base_model", None)
        return base() if callable(base) else model

    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.forward_step
    def forward_step(self, micro_batch, loss_function, forward_only):
        if self._tim is None:
            return super().forward_step(micro_batch, loss_function, forward_only)
        self._tim_mb = None
        # the engine's kept sets where the rollout carried them (read once per micro-batch, for either head)
        self._tim_kept = self._tim_micro_batch_kept(micro_batch) if self._tim_truncation is not None else None
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead (ulysses_sequence_parallel_size)
        if self._tim_kept is not None and getattr(self, "ulysses_sequence_parallel_size", 1) > 1:
            # each SP rank holds a slice of the packed sequence's logits; the sets are laid out over the whole one
            self._tim_pipeline.count("kept_sets_fallback", detail="Ulysses sequence parallelism: replay of the "
                                     "engine's kept sets is not implemented there; the trainer recomputes them")
            self._tim_kept = None
        head = None
        # VERL_SOURCES verl.utils.tensordict_utils:get_non_tensor_data (use_fused_kernels, calculate_entropy)
        if self._tim_truncation is not None and tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels",
                                                                       default=False):
            # the model's fused forward for this call only (an instance attribute over verl's class-level patch):
            # the safe vocabulary's chunked head instead of verl's FusedLinearForPPO
            want_entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
            use_remove_padding = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
            head = Patch(self._tim_lm_model(), "forward", lambda _: _SafeFusedForward(
                self._tim_lm_model(), self._tim_truncation, want_entropy, packed=use_remove_padding,
                kept=self._tim_kept, pipeline=self._tim_pipeline))
        try:
            loss, output = super().forward_step(micro_batch, self._tim_wrap_loss(loss_function), forward_only)
        finally:
            self._tim_kept = None
            if head is not None:
                head.undo()
        self._tim_after_forward(micro_batch, output["model_output"], forward_only)
        return loss, output


class _SafeFusedOutput(OrderedDict):
    """What ``_SafeFusedForward`` returns: the fields verl's fused branch reads (``log_probs``, ``entropy``, as
    verl's ``CausalLMOutputForPPO``) and the safe set's (``safe``), same shapes. An ``OrderedDict``, as
    transformers' ``ModelOutput`` is: FSDP1 rebuilds a module's output with ``torch.distributed.utils
    ._apply_to_tensors``, which keeps an OrderedDict's class but makes a plain dict of any other dict."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _SafeFusedForward:
    """The model's forward under ``use_fused_kernels``, with the safe vocabulary: the base model's final hidden
    states, then ``safe_linear_logprobs`` (chunked over tokens, never the [N, V] logits, exact gradients) with the
    full lm_head weight (an FSDP2 shard is gathered, differentiably). It takes the arguments verl's fused forward
    takes (VERL_SOURCES verl.models.transformers.dense_common:forward_with_torch_backend: temperature, shift_labels
    or the input ids rolled by one) and returns what verl's fused branch of ``prepare_model_outputs`` reads."""

    def __init__(self, model, truncation, want_entropy: bool, *, packed: bool, kept=None, pipeline=None) -> None:
        self.model, self.truncation, self.want_entropy, self.packed = model, truncation, want_entropy, packed
        self.kept = kept  # the engine's kept sets (micro_batch.MicroBatchKeptSets): replayed in place of truncation
        self.pipeline = pipeline  # where a placement that does not fit is counted

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, temperature: float = 1.0,
                 shift_labels=None, return_dict=True, use_cache=False, **kwargs):
        from torch.distributed.tensor import DTensor

        kwargs.pop("labels", None)
        # VERL_SOURCES verl.models.transformers.dense_common:forward_base_model (self.model(...)[0]: the hidden states)
        hidden = self.model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=use_cache, **kwargs)[0]
        labels = shift_labels if shift_labels is not None else torch.roll(input_ids, shifts=-1, dims=-1)
        # an FSDP2 shard (verl wraps an untied lm_head as a unit of its own, whose forward this never calls) is
        # gathered with its gradient averaged over the ranks, as FSDP2 reduces the others'
        weight = full_weight(self.model.lm_head.weight)
        if isinstance(hidden, DTensor):
            hidden = hidden.to_local()
        kept = place_kept(self.kept, self.pipeline, labels_shape=labels.shape, packed=self.packed)
        # the labels are the model's own input ids: no host read to range-check them per micro-batch
        res = kept_set_logprobs(labels, self.truncation, kept, hidden=hidden, weight=weight,
                                temperature=float(temperature), compute_entropy=self.want_entropy, check_ids=False)
        return _SafeFusedOutput(log_probs=res.logprobs, entropy=res.entropy, packed=self.packed,
                                safe={"in_safe": res.in_safe, "pruned_mass": res.pruned_mass, "size": res.size})


_plugin_import_ended()  # a plugin registration deferred while this module was half-imported (plugin.py)
