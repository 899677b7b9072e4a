"""The weight-sync check on TRL's vLLM syncs (``tim_plugins.weight_sync``; the causes it names:
``tim_plugins.causes``).

Colocate mode: ``VLLMGeneration.sync_weights`` is wrapped on the trainer's own instance. While it runs, the engine
model's ``load_weights`` (the method TRL's sync writes through, and vLLM's ``reload_weights`` too) is wrapped to sample
what TRL streams into it; afterwards the engine's weights are read in-process
(``tim_plugins.integrations.vllm.weights.VLLMWeights``) and compared, and what the engine's prefix cache can still serve
is read (``integrations.vllm.prefix_cache``: TRL's sync ends with the cache's reset; blocks left are
``sync-prefix-cache``). Names TRL should have sent (the trainer's parameters under TRL's own name fix) and did not are
compared from the trainer's own tensors, so a sync that sends nothing is caught too. A PEFT (LoRA) model: TRL sends the
base model's parameters with the adapters merged, under the base model's names (``_peft_tensors``); an unsent one is
compared with its base weight plus each active adapter's delta, PEFT's own ``get_delta_weight``, as TRL's
``merge_adapter`` writes it (LoRA variants such as DoRA, and adapter biases, are not compared when unsent). FSDP or
ZeRO-3: the parameters are shards; what was streamed is compared, and a trainable parameter TRL did not stream is
named stale after an optimizer step (TRL 1.16's FSDP1 sync leaves out the root unit's parameters: the embeddings,
the final norm, the lm_head). The report goes to the pipeline (``StepPipeline.sync_checked``): the console line
at once, ``tim/cause/*`` at the next log, the probe's warn / raise / stop.

Server mode: the engine's weights live in another process and cannot be read; the lag-0 probe (``server_probe``:
the server's log-probs of a fixed batch after each sync) and the lag-0 rules of the per-token stream name a stale
server (``probe-*``, ``engine-stale``, ``floor-jump``).

A problem inside the check is counted (``tim/diag/sync_check_failed``) and never breaks the sync.
"""

from __future__ import annotations

import logging

from tim_plugins.patching import Patch
from tim_plugins.weight_sync import SyncCheck, SyncCheckConfig

__all__ = ["SyncWatch"]

logger = logging.getLogger("tim_plugins.trl")


class SyncWatch:
    """The check of one trainer's colocated vLLM engine at its weight syncs (owned by ``TIMCallback``)."""

    def __init__(self, trainer, pipeline, config: SyncCheckConfig) -> None:
        self.trainer, self.pipeline = trainer, pipeline
        # each rank reads its own shards of a tensor-parallel engine: sampled so that every shard holds some
        self.check = SyncCheck(config.for_tensor_parallel(getattr(trainer.args, "vllm_tensor_parallel_size", 1) or 1))
        self._reader = None
        self._local: dict | None = None

    def wrappers(self) -> list:
        # hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration.sync_weights
        return [(self.trainer.vllm_generation, "sync_weights", self._wrap)]

    def _wrap(self, original):
        def sync_weights(*args, **kwargs):
            record = self.check.begin(self.trainer.state.global_step)
            model = self._engine_model() if record is not None else None
            if model is None:
                return original(*args, **kwargs)
            try:
                names = self._expected()
                if names is not None:
                    record.expect(names)
                # VLLM_SOURCES-side: the model TRL's colocate sync writes through (engine_model)
                observe = Patch(model, "load_weights", lambda load: lambda weights, *a, **k: load(
                    record.observing(weights), *a, **k))
            except Exception as err:  # the check costs its own result, never the sync
                self.pipeline.count("sync_check_failed", detail=repr(err))
                return original(*args, **kwargs)
            try:
                result = original(*args, **kwargs)
            finally:
                observe.undo()
            try:
                report = self.check.finish(record, self._reader, local=self._local_tensor, prefix=self._prefix())
                unread = report.names("unread")
                if unread:
                    self.pipeline.count("sync_check_unread", len(unread),
                                        detail=f"tensors the vLLM engine's layout does not let us read: {unread[:4]}")
                self.pipeline.sync_checked(report)
            except Exception as err:
                self.pipeline.count("sync_check_failed", detail=repr(err))
            return result

        return sync_weights

    def _engine_model(self):
        """The colocated engine's model (and its reader, built once), or None (counted) when it is not in-process."""
        if self._reader is not None:
            return self._reader.model
        from tim_plugins.integrations.vllm.weights import VLLMWeights

        # hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration._init_vllm (self.llm)
        reader = VLLMWeights.from_llm(getattr(self.trainer.vllm_generation, "llm", None))
        if reader is None:
            self.pipeline.count("sync_check_unavailable", detail="the vLLM engine's model is not in this process")
            return None
        self._reader = reader
        return reader.model

    def _prefix(self):
        """What the engine's prefix cache can still serve after TRL's sync (its last step is the cache's reset), or
        None (counted) when it cannot be read."""
        from tim_plugins.integrations.vllm.prefix_cache import cached_prefix

        state = cached_prefix(getattr(self.trainer.vllm_generation, "llm", None))
        if state is None:
            self.pipeline.count("prefix_cache_unread", detail="the vLLM engine's prefix cache is not readable here")
        return state

    def _expected(self) -> list[str] | None:
        """The names TRL's sync sends (TRL's own name fix; a PEFT model's merged base parameters), or None. Where the
        parameters are shards (FSDP, ZeRO-3) the trainer's values are not compared: the names of its trainable
        parameters are expected all the same (a plain model whose names show: not FSDP1's flat parameters), so a
        sync that leaves some out names them stale after an optimizer step."""
        if self._local is None:
            t = self.trainer
            gen, model = t.vllm_generation, t.accelerator.unwrap_model(t.model)
            # transformers' Trainer.is_fsdp_enabled / is_deepspeed_enabled: sharded parameters
            sharded = getattr(t, "is_fsdp_enabled", False) or getattr(t, "is_deepspeed_enabled", False)
            # hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration._fix_param_name_to_vllm
            fix = getattr(gen, "_fix_param_name_to_vllm", lambda name, **kwargs: name)
            if sharded:
                self._local = _sharded_names(model, fix)
            elif hasattr(model, "peft_config"):
                self._local = _peft_tensors(model, fix)
            else:
                self._local = {fix(name): p for name, p in model.named_parameters()}
        return list(self._local) if self._local else None

    def _local_tensor(self, name: str):
        value = (self._local or {}).get(name)
        if callable(value):  # a PEFT base weight: merged with its adapters now
            value = value()
        return None if value is None or value.numel() == 0 else value.data


def _sharded_names(model, fix) -> dict:
    """{name TRL sends: None} for a sharded plain model's trainable parameters (no value: a shard is not the
    tensor); {} for a PEFT model, or where FSDP1 keeps flat parameters (``use_orig_params=False``: the names are not
    the model's). FSDP1 with ``use_orig_params=True`` names a parameter through its wrappers: their attribute,
    ``_fsdp_wrapped_module.``, is dropped as TRL's FSDP1 sync drops it (``extra_prefixes``)."""
    if hasattr(model, "peft_config"):
        return {}
    names = {}
    for name, param in model.named_parameters():
        if "_flat_param" in name:
            return {}
        if param.requires_grad:
            names[fix(name.replace("_fsdp_wrapped_module.", ""))] = None
    return names


def _peft_tensors(model, fix) -> dict:
    """{name TRL sends: the trainer's value of it} for a PEFT model: TRL merges the adapters into the base model for
    the sync and sends the base model's parameters under their base names, the adapters' own left out. The value is
    the parameter, a function computing a LoRA layer's merged weight, or None where the merge is not plain LoRA (a
    variant such as DoRA, an adapter bias): not compared when unsent."""
    # hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration.sync_weights (a PEFT model: merge_adapter, then
    # name.removeprefix("base_model.model.").replace(".base_layer", ""), names holding model.prefix and
    # "original_module" skipped, _fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."]); in
    # _iter_named_params from TRL 1.11)
    prefix = getattr(model, "prefix", "lora_")
    out = {}
    for name, param in model.named_parameters():
        sent = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if prefix in sent or "original_module" in sent:
            continue
        out[fix(sent, extra_prefixes=["modules_to_save.default."])] = _merged(model, name, param)
    return out


def _merged(model, name: str, param):
    """``param``, or its LoRA layer's merged value (what PEFT's ``merge`` writes for plain LoRA: the base weight plus
    each active, unmerged adapter's ``get_delta_weight``, in the weight's dtype), or None (a merge not modelled)."""
    owner, _, leaf = name.rpartition(".base_layer.")
    if not owner:
        return param
    layer = model.get_submodule(owner)
    if not hasattr(layer, "get_delta_weight") or getattr(layer, "merged", False):
        return param
    merged = set(getattr(layer, "merged_adapters", ()))
    adapters = [a for a in getattr(layer, "active_adapters", ()) if a in layer.lora_A and a not in merged]
    # a variant's merge is its own (PEFT's lora_variant; use_dora in releases before it), an adapter bias moves the bias
    if any(a in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(a)
           or getattr(layer, "lora_bias", {}).get(a) for a in adapters):
        return None
    if leaf != "weight" or not adapters:
        return param

    def value():
        import torch

        with torch.no_grad():
            out = param.data
            for a in adapters:
                out = out + layer.get_delta_weight(a).to(out.dtype)
        return out

    return value
