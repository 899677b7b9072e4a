"""What the verl adapter can do with the installed verl: one `Feature` per capability, each naming the
``VERL_SOURCES`` entries its hooks need. ``plugin.register`` checks them in every verl process: a feature whose
hook moved is not registered (one line on stderr with the reason and the fix); the others are. ``tim-plugins
doctor`` prints them. Importing this module imports nothing from verl.

The checks run when verl loads the plugin, before any engine, trainer or rollout server exists: no live object to
read. So what a class declares is read on the class (``fields``), and a source fragment stays only where the hook
relies on what a method does (the keys it fills, the call it makes), which shows only when verl runs it; each kept
one says so beside it.
"""

from __future__ import annotations

from tim_plugins._optional import SUPPORTED_RANGES
from tim_plugins.capabilities import Feature, check, registered_hooks

from .sources import VERL_MEGATRON_SOURCES, VERL_SOURCES

__all__ = ["ASYNC_LAG", "ENGINE", "FEATURES", "LEGACY_GUARD", "LR_DECAY", "MEGATRON_ENGINE",
           "MEGATRON_FUSED_SAFE_VOCAB", "MEGATRON_SYNC_CHECK", "ROLLOUT_KEPT_SETS", "ROLLOUT_SYNC_READS", "SAFE_VOCAB",
           "SYNC_CHECK", "SYNC_CHECK_DISAGGREGATED", "TRAINER_MODES", "megatron_features", "rollout_features",
           "verl_features"]

_TI = "verl.workers.engine.fsdp.transformer_impl"
_TB = "verl.trainer.ppo.v1.trainer_base"
_LOW, _HIGH = SUPPORTED_RANGES["verl"]
_FIX = f"pip install 'verl>={_LOW},<{_HIGH}' (the tested range), or report it with `tim-plugins doctor`'s output"


_hook = registered_hooks(VERL_SOURCES, "VERL_SOURCES")

# The FSDP actor engine subclass (engine.py): the monitor, the safe vocabulary and the boundary mask run in it.
ENGINE = Feature(
    "verl_engine", "monitor + safe vocabulary in verl's FSDP actor engine", "verl", needs=("verl",), extra="verl",
    fix=_FIX, hooks=(
        _hook(_TI, "FSDPEngineWithLMHead.prepare_model_outputs",
              params=("output", "output_args", "micro_batch", "logits_processor_func")),
        _hook(_TI, "FSDPEngineWithLMHead.forward_step", params=("micro_batch", "loss_function", "forward_only")),
        _hook(_TI, "FSDPEngine.forward_backward_batch", params=("data", "loss_function", "forward_only")),
        _hook(_TI, "FSDPEngine.get_data_parallel_group"),
        _hook("verl.workers.engine.base", "BaseEngine.train_batch", params=("data", "loss_function")),
        _hook("verl.workers.engine.base", "EngineRegistry.register",
              params=("model_type", "backend", "device", "vendor")),
        # the layout micro_batch.ResponseLayout reads on the device, as verl's own function reads it on the host
        _hook("verl.workers.utils.padding", "no_padding_2_padding"),
    ))

# The safe vocabulary in the FSDP engine (engine.py prepare_model_outputs): the logits as verl scales them, the
# output_args keys prepare_model_inputs fills, the packed padding verl strips. Off: the engine still measures; a
# configured safe vocabulary is switched off with one line (tim/diag/feature_off/verl_safe_vocab).
SAFE_VOCAB = Feature(
    "verl_safe_vocab", "safe vocabulary in verl's FSDP actor engine", "verl", needs=("verl",), extra="verl",
    fix=_FIX, hooks=(
        # fragments: the output_args keys it fills show only in a forward over a micro-batch
        _hook(_TI, "FSDPEngineWithLMHead.prepare_model_inputs", params=("micro_batch",),
              fragments=('output_args = {"temperature_is_one": temperature_is_one}',
                         'output_args["pad_size"] =', 'output_args["input_ids_rmpad_rolled"] =',
                         'output_args["temperature_rmpad"] =', 'output_args["temperature"] =')),
        _hook(_TI, "FSDPEngineWithLMHead.prepare_model_outputs",
              params=("output", "output_args", "micro_batch", "logits_processor_func")),
        _hook(_TI, "FSDPEngine._gather_and_unpad_packed", params=("tensor", "pad_size")),
        _hook(_TI, "_scale_logits_by_temperature"),
        # the fused head (use_fused_kernels=true): the forward it stands in for, and where the hidden states come from
        # (fragments: the model's forward runs only with a model and a batch)
        _hook("verl.models.transformers.dense_common", "forward_with_torch_backend",
              params=("input_ids", "attention_mask", "position_ids", "temperature", "shift_labels"),
              fragments=("hidden_states = outputs[0]", "vocab_weights=self.lm_head.weight")),
        _hook("verl.models.transformers.dense_common", "forward_base_model", fragments=("outputs = self.model(",)),
    ))

# The tim_* V1 trainer modes (trainer.py): the startup audit, the parity probe, checkpoint on stop.
TRAINER_MODES = Feature(
    "verl_trainer_modes", "tim_* trainer modes (audit, parity probe)", "verl", needs=("verl",), extra="verl",
    fix=_FIX, hooks=(
        _hook(_TB, "register_trainer"),
        _hook(_TB, "PPOTrainer._compute_old_log_prob", params=("batch", "metrics")),
        _hook(_TB, "PPOTrainer._update_actor", params=("batch", "metrics")),
        _hook(_TB, "PPOTrainer._compute_metrics", params=("batch", "metrics")),
        _hook(_TB, "PPOTrainer._init_resource_pool_mgr"),
    ))

# The optimizer route (optim.py) selected by actor.optim.optimizer_impl.
LR_DECAY = Feature(
    "verl_lr_decay", "length-triggered LR decay (actor.optim.optimizer_impl)", "verl", needs=("verl",),
    # a fragment: that build_optimizer imports the module optimizer_impl names shows only when it builds one
    extra="verl", fix=_FIX, hooks=(_hook("verl.workers.config.optimizer", "build_optimizer",
                                         fragments=("optimizer_impl",)),))

# The asynchronous modes' per-sample policy lag (trainer.py _tim_put_lag): verl's weight-version tags, carried to the
# workers as a TransferQueue field. Off: the async modes' tokens are counted (tim/diag/async_lag_unknown), not keyed.
ASYNC_LAG = Feature(
    "verl_async_lag", "policy lag of each sample in the asynchronous trainer modes", "verl", needs=("verl",),
    extra="verl", fix=_FIX, hooks=(
        # a fragment: the tags it reads exist only on a trained batch
        _hook(_TB, "PPOTrainer._compute_metrics", fragments=('tag["min_global_steps"]',)),
        _hook("transfer_queue", "kv_batch_put", params=("keys", "partition_id", "fields")),
    ))

_VR = "verl.workers.rollout.vllm_rollout.vllm_rollout"

# The weight-sync check's actor side (sync_check.py, worker.py): the engine's stream teed, the colocated sync awaited,
# the replica's server reached through the rollout's handle. Off: no sync check (tim/diag/feature_off/verl_sync_check);
# the named causes of the per-token stream stay.
SYNC_CHECK = Feature(
    "verl_sync_check", "weight-sync check of the colocated vLLM rollout", "verl", needs=("verl",), extra="verl",
    fix=_FIX, hooks=(
        _hook("verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights", params=("global_steps", "mode"),
              fragments=("self.actor.engine.get_per_tensor_param(", "await self.rollout.update_weights(")),
        _hook(_TI, "FSDPEngine.get_per_tensor_param", params=("layered_summon", "base_sync_done")),
        _hook(_VR, "ServerAdapter._ensure_server_handle", fragments=("self.server_handle = ray.get_actor(",)),
    ))

# The weight-sync check's disaggregated half (trainer.py _tim_read_disaggregated_syncs, worker.py tim_read_replicas):
# the driver finds the checkpoint managers of another backend than naive after _setup and, when one returns (every
# replica loaded), asks the actor ranks to read its replicas' servers. Off: those syncs are counted unread
# (tim/diag/sync_check_unavailable), as before; the colocated check is untouched.
SYNC_CHECK_DISAGGREGATED = Feature(
    "verl_sync_check_disaggregated", "weight-sync check of rollout replicas synced by a checkpoint engine", "verl",
    needs=("verl",), extra="verl", fix=_FIX, hooks=(
        _hook(_TB, "PPOTrainer._setup"),
        _hook("verl.checkpoint_engine.base", "CheckpointEngineManager", fragments=(
            "self.backend = config.backend", "self.replicas = replicas")),
        # fragments: that the manager returns only once the replicas have loaded shows only in a sync
        _hook("verl.checkpoint_engine.base", "CheckpointEngineManager.update_weights", params=("global_steps",),
              fragments=('if self.backend == "naive":', "actor_wg.update_weights(global_steps=global_steps, "
                         "mode=self.backend)", "rollout.update_weights(global_steps=global_steps)")),
        _hook("verl.utils.ray_utils", "auto_await"),
        _hook("verl.workers.rollout.replica", "RolloutReplica.server_handle"),
        _hook("verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights", params=("global_steps", "mode"),
              fragments=("per_tensor_param, _ = self.actor.engine.get_per_tensor_param()",
                         "await self.checkpoint_engine.send_weights(per_tensor_param")),
    ))

# The driver refuses a tim node under verl's legacy trainer (trainer.use_v1=false), which never reads it
# (plugin._guard_legacy_trainer): through the validate_config main_ppo calls on the composed config before it starts
# Ray and picks the trainer.
LEGACY_GUARD = Feature(
    "verl_legacy_guard", "tim settings refused under verl's legacy trainer (trainer.use_v1=false)", "verl",
    needs=("verl",), extra="verl", fix=_FIX, hooks=(_hook("verl.utils.config", "validate_config", params=("config",)),))

FEATURES = (ENGINE, SAFE_VOCAB, TRAINER_MODES, LR_DECAY, ASYNC_LAG, SYNC_CHECK, SYNC_CHECK_DISAGGREGATED,
            LEGACY_GUARD)

_VS = "verl.workers.rollout.vllm_rollout.vllm_async_server"

# The vLLM rollout server that carries vLLM's per-token kept sets into the batch (rollout.py). Its hooks live in
# verl's vLLM server module, which imports vLLM: checked when the rollout is built (plugin's replica loader, the
# process that imports vLLM anyway) and by the doctor, not on every `import verl`, so kept out of FEATURES (which
# the actor workers check). Off: verl's own vLLM replica (no kept sets; the trainer recomputes them).
ROLLOUT_KEPT_SETS = Feature(
    "verl_rollout_kept_sets", "vLLM's per-token kept sets (return_sampling_mask) carried into verl's batch", "verl",
    needs=("verl", "vllm"), extra="verl", fix=_FIX, hooks=(
        # fragments: what generate does with the engine's outputs shows only in a generation, and the replica's server
        # class is an instance attribute of a replica, which exists only after this check chose the loader
        _hook(_VS, "vLLMHttpServer.generate", params=("prompt_ids", "sampling_params", "request_id"),
              fragments=("generator = self.engine.generate(", "request_id=request_id,",
                         "async for output in generator:", "final_res = output",
                         "token_ids = final_res.outputs[0].token_ids", "extra_fields=extra_fields,")),
        _hook(_VS, "vLLMReplica.__init__", fragments=("self.server_class = ray.remote(vLLMHttpServer)",)),
        _hook("verl.workers.rollout.replica", "RolloutReplicaRegistry.register", params=("name", "loader")),
        _hook("verl.workers.rollout.replica", "_load_vllm"),
        # the reply's and vLLM's output classes: their declared fields, not their source text
        _hook("verl.workers.rollout.replica", "TokenOutput", fields=("extra_fields",)),
        _hook("vllm.outputs", "SamplingMask", fields=("token_ids",)),
        _hook("vllm.outputs", "CompletionOutput", fields=("sampling_mask",)),
    ))

# The weight-sync check's rollout side (rollout.py _SyncReads, worker_extension.py): vLLM's workers get verl's extension
# plus tim_read_weights, and the server returns their answers. Checked where the rollout is built, like the kept sets;
# off: verl's worker extension, and the actor counts the syncs it cannot read (tim/diag/sync_check_unavailable).
ROLLOUT_SYNC_READS = Feature(
    "verl_rollout_sync_reads", "the vLLM engine's weights read for the weight-sync check", "verl",
    needs=("verl", "vllm"), extra="verl", fix=_FIX, hooks=(
        _hook(_VS, "vLLMHttpServer._get_worker_extension_cls"),
        _hook(_VS, "vLLMHttpServer.launch_server",
              fragments=('"worker_extension_cls": self._get_worker_extension_cls()',)),
        _hook(_VS, "vLLMHttpServer.collective_rpc", fragments=("self.engine.collective_rpc(",)),
        _hook(_VS, "vLLMReplica.__init__", fragments=("self.server_class = ray.remote(vLLMHttpServer)",)),
        _hook("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension",
              fragments=("self.model_runner.model",)),
        _hook("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", params=("method", "timeout", "args", "kwargs")),
    ))

_TM = "verl.workers.engine.megatron.transformer_impl"
_megatron_hook = registered_hooks(VERL_MEGATRON_SOURCES, "VERL_MEGATRON_SOURCES")

# The Megatron actor engine subclass (megatron_engine.py): the monitor, the split, the dump, the safe vocabulary
# (its TP-sharded logits processor) and the LR decay run in it. Its module imports megatron-core (Python >= 3.12), which the verl extra does not install: without it the plugin
# registers no Megatron engine and says nothing (an FSDP user has no Megatron backend). Kept out of FEATURES, which
# hold wherever verl does. Fragments: what the micro-batch post-processing, the logits processor and the scheduler's
# step do shows only in a forward or an optimizer step, after the plugin registered the engine.
MEGATRON_ENGINE = Feature(
    "verl_megatron_engine", "monitor, safe vocabulary and LR decay in verl's Megatron actor engine", "verl",
    needs=("verl", "megatron"), fix=_FIX, hooks=(
        _megatron_hook(_TM, "MegatronEngineWithLMHead.postprocess_micro_batch_func",
                       params=("output", "data", "forward_only", "loss_function", "local_cp_size"),
                       fragments=("model_output = self.prepare_model_outputs(output, data)",
                                  "loss_function(model_output=model_output, data=data,")),
        _megatron_hook(_TM, "MegatronEngineWithLMHead.prepare_model_outputs", params=("output", "data")),
        _megatron_hook(_TM, "MegatronEngineWithLMHead._lm_head_logits_processor",
                       params=("logits", "label", "temperature", "calculate_sum_pi_squared", "calculate_entropy",
                               "distillation_use_topk", "distillation_only", "logits_processor_func", "batch",
                               "data_format"),
                       fragments=("logits.div_(temperature.unsqueeze(dim=-1).to(logits.dtype))",)),
        _megatron_hook("megatron.core.tensor_parallel.utils", "VocabUtility.vocab_range_from_per_partition_vocab_size",
                       params=("per_partition_vocab_size", "rank", "world_size")),
        _megatron_hook(_TM, "MegatronEngine.is_mp_src_rank_with_outputs"),
        _megatron_hook(_TM, "MegatronEngine.forward_backward_batch",
                       params=("data", "loss_function", "forward_only"),
                       fragments=("partial(self.postprocess_micro_batch_func,",)),
        _megatron_hook(_TM, "MegatronEngine.get_data_parallel_group"),
        _megatron_hook(_TM, "MegatronEngine.lr_scheduler_step"),
        _megatron_hook("verl.utils.megatron.optimizer", "get_megatron_last_lr", params=("optimizer",)),
        _megatron_hook("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.step",
                       params=("increment",), fragments=("param_group['lr'] = self.get_lr(param_group)",)),
        _megatron_hook("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.get_lr",
                       params=("param_group",)),
        _hook("verl.workers.engine.base", "BaseEngine.train_batch", params=("data", "loss_function")),
        _hook("verl.workers.engine.base", "EngineRegistry.register",
              params=("model_type", "backend", "device", "vendor")),
    ))


# The weight-sync check's tee on the Megatron engine's stream (engine_mixin.get_per_tensor_param; the rest of the check
# is SYNC_CHECK's). Checked when the engine is configured with the check on; off, the sync check alone is switched off
# (tim/diag/feature_off/verl_megatron_sync_check).
MEGATRON_SYNC_CHECK = Feature(
    "verl_megatron_sync_check", "weight-sync check of the Megatron actor engine's stream", "verl", needs=("verl",),
    fix="verl's Megatron backend with " + _FIX, hooks=(
        _megatron_hook(_TM, "MegatronEngine.get_per_tensor_param", params=("base_sync_done", "kwargs"),
                       fragments=("return per_tensor_param, peft_config",)),
    ))


_MF = "verl.models.mcore.model_forward_fused"
_GPT = "megatron.core.models.gpt.gpt_model"

# The safe vocabulary under the Megatron actor's use_fused_kernels=true (megatron_engine.py forward_step,
# _FusedSafeHead): Megatron's output_processor hook (megatron-core >= 0.18), through which verl's fused forward
# computes the log-probs, takes our head for the micro-batch. Checked when the engine is configured with both; off,
# the safe vocabulary is switched off with one line (tim/diag/feature_off/verl_megatron_fused_safe_vocab), the rest
# runs. Fragments: how the fused forward and the model's post-processing pass the output processor its inputs shows
# only in a forward (the check runs when the engine is configured, before its first).
MEGATRON_FUSED_SAFE_VOCAB = Feature(
    "verl_megatron_fused_safe_vocab", "safe vocabulary with fused kernels in verl's Megatron actor engine", "verl",
    needs=("verl", "megatron"),
    fix="pip install -U 'megatron-core>=0.18' (its output_processor hook), or report it with `tim-plugins doctor`'s "
        "output", hooks=(
        _megatron_hook(_TM, "MegatronEngineWithLMHead.forward_step",
                       params=("batch_iter", "model", "logits_processor_func", "postprocess_micro_batch_func"),
                       fragments=("batch: TensorDict = next(batch_iter)",
                                  "return output, partial(postprocess_micro_batch_func, data=batch, "
                                  "local_cp_size=local_cp_size)")),
        _megatron_hook(_TM, "MegatronEngine._get_context_parallel_layout", params=("unwrapped_model",)),
        _megatron_hook(_MF, "fused_forward_model_engine",
                       fragments=("output_processor=fused_output_processor,",
                                  "output_processor_context=FusedOutputProcessorContext(temperature=temperature),",
                                  "log_probs = output_orig.log_probs", "entropy = output_orig.entropy",
                                  "log_probs = postprocess_thd_engine(")),
        _megatron_hook(_MF, "FusedOutputProcessorContext", fields=("temperature",)),
        _megatron_hook("verl.models.mcore.util", "postprocess_thd_engine",
                       params=("output", "packed_seq_params", "input_ids", "batch_size", "post_process",
                               "local_cp_size", "cp_layout")),
        _megatron_hook("verl.utils.megatron_utils", "unwrap_model", params=("model",)),
        _megatron_hook("verl.utils.model", "CausalLMOutputForPPO", fields=("log_probs", "entropy")),
        _megatron_hook(_GPT, "GPTModel.forward", params=("output_processor", "output_processor_context")),
        _megatron_hook(_GPT, "GPTModel._postprocess",
                       fragments=("return output_processor(", "hidden_states=hidden_states,",
                                  "output_layer=self.output_layer,", "output_weight=output_weight,", "labels=labels,",
                                  "packed_seq_params=packed_seq_params,", "context=output_processor_context,",
                                  "config=self.config,")),
        _megatron_hook("megatron.core.tensor_parallel.mappings", "copy_to_tensor_model_parallel_region"),
        _megatron_hook("megatron.core.tensor_parallel.mappings", "gather_from_sequence_parallel_region"),
        _megatron_hook("megatron.core.tensor_parallel.utils", "VocabUtility.vocab_range_from_per_partition_vocab_size",
                       params=("per_partition_vocab_size", "rank", "world_size")),
    ))


def verl_features():
    """Every verl feature's status."""
    return [check(f) for f in FEATURES]


def rollout_features():
    """The tim rollout server's parts' status (imports verl's vLLM server, and so vLLM)."""
    return [check(ROLLOUT_KEPT_SETS), check(ROLLOUT_SYNC_READS)]


def megatron_features():
    """The Megatron engine's features' status (off, saying why, where megatron-core is not installed)."""
    return [check(MEGATRON_ENGINE), check(MEGATRON_FUSED_SAFE_VOCAB), check(MEGATRON_SYNC_CHECK)]
