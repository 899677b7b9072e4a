"""The verl 0.9.1 internals the verl adapter relies on, each named with what is assumed of it.

verl has no public hook for what the adapter does (safe-vocabulary log-probs, the boundary mask, the monitor in
the actor engine, the LR decay inside the optimizer, the driver-side trainer modes), so the adapter subclasses
verl's classes and overrides or calls methods that verl may change in any release: the range is pinned
(``tim_plugins._optional.SUPPORTED_RANGES``, checked by ``plugin.register``), every use site names its entry
here in a comment (``# VERL_SOURCES <module>:<qualname>``), and ``tests/verl_suite/test_verl_sources.py`` checks
each assumption against the installed verl (signatures, statements in the source, and behaviour where cheap).

Importing this module imports nothing from verl.
"""

from __future__ import annotations

__all__ = ["VERL_SOURCES", "VERL_MEGATRON_SOURCES", "VERL_CONFIG_KEYS", "VERL_MEGATRON_CONFIG_KEYS",
           "VERL_OPTIONAL_CONFIG_KEYS"]

_TI = "verl.workers.engine.fsdp.transformer_impl"
_TB = "verl.trainer.ppo.v1.trainer_base"

# (module, qualified name) -> what the adapter assumes of it (verl 0.9.1). A qualified name "" is the module.
VERL_SOURCES = {
    # ---------------------------------------------------------------------------------- actor engine (engine.py)
    (_TI, "FSDPEngineWithLMHead"):
        "the FSDP/FSDP2 language-model engine, registered by verl for device cuda/npu without a vendor; "
        "TIMFSDPEngineWithLMHead subclasses it; it sets self.engine_config and self.model_config (both with "
        "use_fused_kernels), self.optimizer (the optimizer built from optim.optimizer_impl) and "
        "self.ulysses_sequence_parallel_size (set in FSDPEngine._init_device_mesh; > 1: each SP rank holds a slice of "
        "the packed logits)",
    (_TI, "FSDPEngineWithLMHead.prepare_model_inputs"):
        "fills output_args: temperature_is_one (host-scalar temperature 1); with use_remove_padding "
        "input_ids_rmpad_rolled (labels, packed), temperature_rmpad (per token) and pad_size (static + SP "
        "padding at the tail of the packed sequence); without it input_ids_rmpad_rolled and temperature ([B])",
    (_TI, "FSDPEngineWithLMHead.prepare_model_outputs"):
        "(output, output_args, micro_batch, logits_processor_func) -> dict; reads the non-tensor keys "
        "use_remove_padding (default True), use_fused_kernels and calculate_entropy; packed: output.logits "
        "[1, N+pad, V] (a DTensor under TP) / temperature_rmpad, log-probs of input_ids_rmpad_rolled, padding "
        "stripped by _gather_and_unpad_packed(x, output_args['pad_size']); padded: output.logits [B, L, V] / "
        "temperature[:, None, None], rows cut to micro_batch['input_ids'] lengths; log_probs (and entropy when "
        "calculate_entropy) as jagged nested tensors on micro_batch['input_ids'].offsets(); fused kernels give "
        "output.log_probs without logits; output.logits itself is left unscaled",
    (_TI, "_scale_logits_by_temperature"):
        "out of place: logits / temperature.clamp(min=1e-8).to(logits.dtype); the logits untouched when the "
        "temperature is a host scalar 1 (the engine's safe-vocab logits are scaled exactly so)",
    ("verl.models.transformers.dense_common", "forward_with_torch_backend"):
        "the model's forward under use_fused_kernels (installed on the model class by apply_monkey_patch): takes "
        "temperature (a float) and shift_labels (the rolled labels, packed) besides the model inputs, runs "
        "forward_base_model for the hidden states and FusedLinearForPPO(hidden, self.lm_head.weight, labels, T); "
        "returns an object with log_probs and entropy of the input ids' shape (the engine's safe fused head returns "
        "the same for one call, as an instance attribute over the class's)",
    ("verl.models.transformers.dense_common", "forward_base_model"):
        "self.model(input_ids=, attention_mask=, position_ids=, ...)[0] are the final hidden states (after the last "
        "norm) the fused head projects with self.lm_head.weight",
    (_TI, "FSDPEngine._gather_and_unpad_packed"):
        "(tensor, pad_size) -> the packed values of the whole sequence: all-gathered over Ulysses SP, the "
        "pad_size tail dropped (tensor[:-pad_size] without SP)",
    (_TI, "FSDPEngineWithLMHead.forward_step"):
        "(micro_batch, loss_function, forward_only) -> (loss, {'model_output', 'loss', 'metrics'}); calls "
        "prepare_model_outputs(..., logits_processor_func=loss_function) (the distillation path calls it with "
        "student_logits=, data=), then loss_function(model_output=, data=micro_batch, dp_group=) on the same "
        "micro_batch object; model_output detached in the returned dict",
    (_TI, "FSDPEngine.forward_backward_batch"):
        "(data, loss_function, forward_only=False); the loss normaliser batch_num_tokens is data['loss_mask'] "
        "summed over DP before the micro-batch loop (so a response_mask edited per micro-batch does not change "
        "it); calls forward_step once per micro-batch",
    (_TI, "FSDPEngine.is_mp_src_rank_with_outputs"):
        "() -> True on Ulysses SP local rank 0 (or without SP): the rank whose outputs the worker collects",
    (_TI, "FSDPEngine.optimizer_step"):
        "() -> the gradient norm before clipping, on every rank (clip_grad_norm_ reduces over the sharded mesh); "
        "train_batch reports it only on the rank with outputs (the LR decay's grad_norm signal reads this)",
    (_TI, "FSDPEngine.lr_scheduler_step"):
        "() -> the scheduler's LR of param group 0 after lr_scheduler.step() (logged by the worker as lr)",
    (_TI, "FSDPEngine.get_data_parallel_group"):
        "() -> the DP process group (the Ulysses mesh's dp dim, else WORLD); the monitor merges over it",
    ("verl.trainer.distillation.losses", "get_distillation_loss_settings"):
        "(loss_name) -> the loss's registered settings, .use_topk a bool (ValueError for an unknown name); the "
        "trainer passes distillation_use_topk = that use_topk to the actor when distillation.enabled",
    ("verl.workers.engine.base", "BaseEngine.train_batch"):
        "(data, loss_function): zero_grad, forward_backward_batch(forward_only=False), optimizer_step; the FSDP "
        "engine does not override it (one call per mini-batch, so one optimizer step)",
    ("verl.workers.engine.base", "BaseEngine.infer_batch"):
        "(data, loss_function=None): forward_backward_batch(forward_only=True) under no_grad (old-log-prob and "
        "reference passes)",
    ("verl.workers.engine.base", "BaseEngine.disable_adapter"):
        "() -> a context manager that disables the LoRA adapters for its duration (nullcontext on the base class; "
        "the FSDP and Megatron engines override it); the engine mixin wraps it to switch its safe vocabulary off",
    ("verl.workers.engine_workers", "TrainingWorker.infer_batch"):
        "pops the non-tensor key no_lora_adapter (the trainer's _compute_ref_log_prob sets it when ref_in_actor: a "
        "LoRA actor scores the reference) and runs engine.infer_batch inside engine.disable_adapter() when it is "
        "set: the only caller of disable_adapter on the actor",
    ("verl.workers.engine_workers", "TrainingWorker.train_mini_batch"):
        "update_lr_scheduler is set only on the last mini-batch of a step, so the engine's lr_scheduler_step runs "
        "once per step, after its last train_batch",
    ("verl.workers.engine_workers", "TrainingWorker.train_batch"):
        "engine.train_batch(data, loss_function=self.loss_fn), then lr = engine.lr_scheduler_step() when "
        "update_lr_scheduler, logged as metrics['lr'] (actor/lr); sets use_remove_padding / use_fused_kernels "
        "non-tensor defaults",
    ("verl.utils.tensordict_utils", "get_non_tensor_data"):
        "(data, key, default) -> the unwrapped non-tensor value, default when absent",
    ("verl.workers.utils.padding", "no_padding_2_padding"):
        "(tensor, data) -> [B, max_response_len] response-aligned values of a packed/nested per-token tensor "
        "(values[offset - resp_len - 1 : offset - 1] per row, zero-padded), read from data['prompts'] / "
        "data['responses'] lengths",
    ("verl.workers.utils.losses", "ppo_loss"):
        "(config, model_output, data, dp_group) reads model_output['log_probs'] and data['response_mask'] (after "
        "select(...).to_padded_tensor(), which pads a nested mask to its max_seqlen) as the loss mask, and "
        "normalises by data['batch_num_tokens']",
    # ---------------------------------------------------------------------------------- registration (plugin.py)
    ("verl", ""):
        "import verl loads every entry point of the verl.plugins group (VERL_USE_EXTERNAL_PLUGINS=auto, the "
        "default), logging a failing one at DEBUG level only",
    ("verl.workers.engine.base", "EngineRegistry.register"):
        "(model_type, backend, device, vendor) stores the class under (device, vendor), or device when vendor is "
        "None; asserts that the key is new",
    ("verl.workers.engine.base", "EngineRegistry.get_engine_cls"):
        "(model_type, backend): device/vendor from the platform (VERL_ENGINE_DEVICE / VERL_ENGINE_VENDOR "
        "override them); the (device, vendor) key is looked up before the device-only key",
    ("verl.workers.config.actor", "FSDPActorConfig.__post_init__"):
        "copies actor.strategy into its engine config (fsdp_config), whose strategy is the backend the worker builds "
        "the actor's engine for (EngineRegistry.new(backend=engine_config.strategy), engine_workers.py); the veomni "
        "and torchtitan actor configs take their engine from their own node (strategy veomni / torchtitan), whatever "
        "actor.strategy says; model_engine (dp, megatron, torchtitan, veomni) picks the actor config",
    ("verl.utils.checkpoint.checkpoint_manager", "BaseCheckpointManager.should_save_optimizer"):
        "'optimizer' in checkpoint.save_contents (None: verl's default [model, optimizer, extra]); likewise "
        "should_load_optimizer with load_contents: the optimizer state, param_groups included, is saved and loaded "
        "only then (FSDP and Megatron checkpoint managers)",
    ("verl.plugin.platform.platform_cuda", "PlatformCUDA.vendor_name"):
        "'nvidia' on CUDA (device 'cuda'); ROCm reports device 'cuda', vendor 'amd' (verl's own engine there)",
    # ---------------------------------------------------------------------------------- driver (trainer.py)
    (_TB, "TRAINER_REGISTRY"):
        "name -> PPOTrainer subclass, filled by importing verl.trainer.ppo.v1 (sync, colocate_async, "
        "separate_async); main_ppo picks get_trainer_cls(config.trainer.v1.trainer_mode)",
    (_TB, "register_trainer"):
        "register_trainer(name)(cls) stores a PPOTrainer subclass, refusing a name taken by another class",
    (_TB, "PPOTrainer.__init__"):
        "(config); sets self.trainer_mode = config.trainer.v1.trainer_mode, then compares self.trainer_mode with "
        "'sync' (replay buffer, prompt refill, TransferQueue checkpoints) and reads config.trainer.v1[trainer_mode]",
    ("verl.utils.skip.rollout_skip", "RolloutTqSkip.__init__"):
        "(local_config, global_config) reads OmegaConf.select(global_config, "
        "f'trainer.v1.{global_config.trainer.v1.trainer_mode}.parameter_sync_step', default=1): the mode's node "
        "under the configured name (a tim mode's included); SkipManager.init(self.config) builds it in fit",
    (_TB, "PPOTrainer._init_resource_pool_mgr"):
        "() fills self.role_worker_mapping: ray.remote(ActorRolloutRefWorker) behind Role.ActorRollout / "
        "Role.ActorRolloutRef (or Role.Actor, with Role.RefPolicy separate), ray.remote(TrainingWorker) behind "
        "Role.Critic; _setup calls it before spawning the worker groups",
    ("verl.trainer.ppo.utils", "Role"):
        "enum with Actor, ActorRollout, ActorRolloutRef, RefPolicy, Critic",
    (_TB, "PPOTrainer._compute_old_log_prob"):
        "(batch, metrics) -> batch; asks the actor for log-probs with calculate_entropy=True (the reference pass "
        "asks without); in bypass mode computes nothing (old_log_probs := rollout_log_probs)",
    (_TB, "PPOTrainer._compute_ref_log_prob"):
        "asks the reference for log-probs with calculate_entropy=False",
    (_TB, "PPOTrainer._compute_metrics"):
        "(batch, metrics, timing_raw, global_steps, epoch); fit calls it once per step after the update, the "
        "checkpoint and validation and before logger.log(data=metrics), the same dict (the trainer mode leaves in it "
        "the tim/* metrics of the default log, tim_plugins.log_keys): it adds the step's data metrics "
        "(critic/score/mean, response_length/mean, ...) to metrics in place; it reads each sample's "
        "batch.tags[i]['min_global_steps'] / ['max_global_steps'] (the weight versions a trajectory was sampled "
        "across) and logs trajectory_staleness = (global_steps - 1) - max_global_steps",
    ("transfer_queue", "kv_batch_put"):
        "(keys=, partition_id=, fields=TensorDict [len(keys)]) adds per-sample fields to stored samples; a worker "
        "method given the batch's KVBatchMeta (fields None or naming the field) receives every field all of its "
        "samples have, split with the batch over DP ranks, mini- and micro-batches",
    ("verl.trainer.ppo.rollout_corr_helper", "compute_rollout_correction_and_add_to_batch"):
        "writes its rejection (algorithm.rollout_correction.rollout_rs) into batch.batch['response_mask']; the V1 "
        "trainer calls it in PPOTrainer._compute_advantage, which PPOTrainer._step_once runs after the old-log-prob "
        "pass (_compute_old_log_prob) and before the actor update (_update_actor): the LR decay reads the step's "
        "response lengths in that pass, before the rejection",
    ("verl.trainer.ppo.padding_utils", "upsample_batch_to_divisible_size"):
        "appends synthetic no-op samples (tag is_padding) to make a batch divisible; their response_mask is all "
        "zero (construct_minimal_padding_template), while every real response has at least one token",
    (_TB, "PPOTrainer.step"):
        "(metrics, timing_raw) -> batch; one global step: for trigger_idx in range(self.parameter_sync_step) sets "
        "self.local_trigger_step = trigger_idx and runs one actor update (_step_once: old-log-prob pass, update) on a "
        "sample of train_batch_size // parameter_sync_step; each update's metrics go to their own dict, combined into "
        "the step's by verl's MetricsAggregator (a key only the last update has keeps its value)",
    (_TB, "PPOTrainer._update_actor"):
        "(batch, metrics) -> batch; one actor_rollout_wg.update_actor call per step",
    (_TB, "PPOTrainer.fit"):
        "per step: is_last_step computed before the step, _save_checkpoint() when save_freq > 0 and (is_last_step "
        "or global_steps % save_freq == 0), then on_step_end(); the loop stops once global_steps > "
        "total_training_steps, returning after the last step without calling on_train_end",
    (_TB, "PPOTrainer.on_train_begin"):
        "() a hook fit calls once, after _load_checkpoint set global_steps to the resumed checkpoint's step (0 without "
        "one) and `self.global_steps += 1`, before the loop's first step (the async modes' own add warmup prompts)",
    (_TB, "PPOTrainer._save_checkpoint"):
        "() writes the checkpoint of the current global_steps",
    # ---------------------------------------------------------------------- legacy trainer guard (plugin.py)
    ("verl.utils.config", "validate_config"):
        "(config, use_reference_policy, use_critic) -> None, a module global that main_ppo and main_ppo_v0 import by "
        "name after `import verl` loaded the plugins (so they bind the plugin's wrapper)",
    ("verl.trainer.main_ppo", "main"):
        "the Hydra entry point: validate_config(config=config, ...) on the composed config, then `if "
        "config.trainer.use_v1:` the V1 TaskRunner, else main_ppo_v0's (the legacy trainer, which reads no tim node), "
        "both before ray.init",
    # ---------------------------------------------------------------------------------- workers (worker.py)
    ("verl.workers.engine_workers", "ActorRolloutRefWorker"):
        "the actor/rollout/ref worker: self.config is the actor_rollout_ref node; init_model (ONE_TO_ALL) builds "
        "self.actor (a TrainingWorker whose .engine comes from EngineRegistry) when the role holds the actor",
    ("verl.single_controller.base.decorator", "register"):
        "register(dispatch_mode=...) marks the method (MAGIC_ATTR with dispatch_mode, execute_mode, blocking); the "
        "worker group binds every marked method of the worker class; Dispatch.ONE_TO_ALL returns one result per "
        "rank",
    # ---------------------------------------------------------------------------------- optimizer (optim.py)
    ("verl.workers.config.optimizer", "build_optimizer"):
        "(parameters, config): getattr(importlib.import_module(config.optimizer_impl), config.optimizer)"
        "(parameters, lr=, weight_decay=, betas= for Adam-like names)",
    (_TI, "FSDPEngine._build_lr_scheduler"):
        "a LambdaLR (constant or cosine with warmup), which rewrites every param group's lr on each step",
    # ---------------------------------------------------------------------------------- kept sets (rollout.py)
    ("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer.generate"):
        "(prompt_ids, sampling_params, request_id, ...) -> TokenOutput: awaits self.engine.generate(prompt=, "
        "sampling_params=, request_id=request_id, ...) (request_id by keyword) to its last RequestOutput, returns "
        "final_res.outputs[0].token_ids with extra_fields (a dict it builds per call, returned as is); drops the "
        "completion's sampling_mask",
    ("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMReplica.__init__"):
        "sets self.server_class = ray.remote(vLLMHttpServer), the actor class launch_servers starts per node",
    ("verl.workers.rollout.replica", "RolloutReplicaRegistry.register"):
        "(name, loader) stores a zero-argument loader returning the replica class, replacing one of the same name; "
        "get(name) calls it when the rollout is built (rollout.name=vllm -> the 'vllm' entry)",
    ("verl.workers.rollout.replica", "_load_vllm"):
        "verl's own loader for 'vllm' (returns vLLMReplica); the plugin's loader falls back to it",
    ("verl.workers.rollout.replica", "TokenOutput"):
        "the server's reply: token_ids, log_probs, extra_fields (a dict carried unchanged through the agent loop "
        "into AgentLoopOutput.extra_fields and the V1 trainer's extra_fields field, one dict per sample)",
    ("vllm.outputs", "CompletionOutput"):
        "token_ids and sampling_mask (None unless the engine runs with return_sampling_mask)",
    ("vllm.outputs", "SamplingMask"):
        "token_ids: one list of kept token ids per generated token",
    # ---------------------------------------------------------------------------------- weight-sync check
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights"):
        "(global_steps=None, mode='auto'), registered ONE_TO_ALL non-blocking (every rank, awaited by the "
        "checkpoint manager's update_weights): mode 'auto' resolves to rollout.checkpoint_engine.backend; 'naive' "
        "(colocated; the sync and colocate_async trainer modes force it) calls self.actor.engine."
        "get_per_tensor_param(layered_summon=, base_sync_done=True) and awaits self.rollout.update_weights(that "
        "generator, peft_config=, ...), which returns once the engine has loaded every bucket; any other mode sends "
        "the generator through the checkpoint engine (the rollout loads in other workers)",
    (_TI, "FSDPEngine.get_per_tensor_param"):
        "(layered_summon=False, base_sync_done=False, **kwargs) -> (generator of (HF name, full tensor), peft_config "
        "or None): the stream every weight sync sends the rollout (LoRA adapters: peft_config set)",
    ("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter._ensure_server_handle"):
        "() -> whether this rank holds its replica's vLLM server (rollout rank 0 of the replica); when it does, "
        "self.server_handle is the server's Ray actor handle afterwards",
    ("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer._get_worker_extension_cls"):
        "() -> the qualified name of vLLM's worker_extension_cls (verl's vLLMColocateWorkerExtension), read by "
        "launch_server into the engine args",
    ("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer.collective_rpc"):
        "awaits self.engine.collective_rpc(method=, timeout=, args=, kwargs=) and drops the workers' results; "
        "self.engine is vLLM's AsyncLLM",
    ("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension"):
        "mixed into each vLLM worker (the process holding the model); self.model_runner.model is the model "
        "update_weights_from_ipc loads the buckets into, self.model_runner.vllm_config.model_config.dtype its dtype",
    # the disaggregated sync (a checkpoint engine other than naive: separate_async's standalone replicas)
    (_TB, "PPOTrainer._setup"):
        "builds the trainer's checkpoint managers as attributes (self.checkpoint_manager, backend forced to naive); "
        "a mode's own _setup calls it and then adds its own (separate_async: self.standalone_checkpoint_manager, of "
        "the configured backend, over its standalone replicas)",
    ("verl.trainer.ppo.v1.trainer_separate_async", "PPOTrainerSeparateAsync._init_resource_pool_mgr"):
        "calls PPOTrainer's, then puts ray.remote(DetachActorWorker) (an ActorRolloutRefWorker subclass with "
        "save_model_to_cpu / restore_model_from_cpu, which its old-log-prob pass calls) behind the actor role",
    ("verl.checkpoint_engine.base", "CheckpointEngineManager"):
        "holds backend (the configured checkpoint engine's name) and replicas (the RolloutReplica list it syncs, "
        "changed in place by add_replicas / remove_replicas)",
    ("verl.checkpoint_engine.base", "CheckpointEngineManager.update_weights"):
        "(global_steps=None), auto_await: with a backend other than naive it has the actor group send "
        "(actor_wg.update_weights(mode=backend)) and every replica's workers receive and load "
        "(rollout.update_weights, CheckpointEngineWorker), waits for both, and returns: every replica holds the "
        "weights then",
    ("verl.utils.ray_utils", "auto_await"):
        "wraps an async function so that a plain call runs it (asyncio.run, or in a thread inside a running loop) "
        "and a call from a coroutine returns the coroutine to await",
    ("verl.workers.rollout.replica", "RolloutReplica.server_handle"):
        "the replica's (first) server's Ray actor handle: the server the colocated sync reads through the rollout's "
        "own handle",
    ("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc"):
        "(method, timeout=None, args=(), kwargs=None) -> the list of every worker's result (a method name: a "
        "method of the worker, its extension's included)",
    # ---------------------------------------------------------------------------------- vLLM rollout (config.py)
    ("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer.launch_server"):
        "engine_kwargs.vllm (None values dropped) is forwarded verbatim to vllm serve, after verl's own args",
    ("verl.trainer.ppo.v1.agent_loop_tq", "AgentLoopWorkerTQ.generate_sequences"):
        "the request's sampling params are temperature, top_p, top_k, logprobs and repetition_penalty=1.0 (fixed, "
        "whatever the rollout config says): no min_p reaches vLLM",
}

_TM = "verl.workers.engine.megatron.transformer_impl"

# The Megatron actor engine's (megatron_engine.py) entries: importing their module needs megatron-core (Python >=
# 3.12), which the verl suite's environment does not hold, so they are checked by the Megatron suite
# (tests/megatron_suite/test_megatron_sources.py, .venv-megatron) and kept apart from VERL_SOURCES, whose every entry
# the verl suite resolves.
VERL_MEGATRON_SOURCES = {
    (_TM, "MegatronEngine.get_per_tensor_param"):
        "(base_sync_done=False, **kwargs) -> (generator of (HF name, full tensor) through the bridge's export, "
        "peft_config or None): the stream every weight sync sends the rollout",
    (_TM, "MegatronEngineWithLMHead"):
        "the Megatron language-model engine, registered by verl for backend megatron under the device-only key "
        "cuda; TIMMegatronEngineWithLMHead subclasses it",
    (_TM, "MegatronEngineWithLMHead.postprocess_micro_batch_func"):
        "(output, data, forward_only, loss_function, local_cp_size=None), bound by forward_backward_batch as "
        "partial(self.postprocess_micro_batch_func, forward_only=, loss_function=) and called once per micro-batch "
        "on every rank of the last pipeline stage with data=the micro-batch; model_output = "
        "prepare_model_outputs(output, data); calls loss_function(model_output=, data=, dp_group=) when a loss is "
        "given",
    (_TM, "MegatronEngineWithLMHead.prepare_model_outputs"):
        "(output, data) -> output unchanged: a dict with log_probs (and entropy when calculate_entropy), jagged "
        "nested on data['input_ids'], equal on every TP rank (vocab_parallel_log_probs_from_logits reduces over TP)",
    (_TM, "MegatronEngine.is_mp_src_rank_with_outputs"):
        "() -> TP rank 0 and last pipeline stage and CP rank 0 (and DP rank 0 under dynamic CP): the rank whose "
        "outputs verl keeps",
    (_TM, "MegatronEngine.forward_backward_batch"):
        "(data, loss_function, forward_only=False); the loss normaliser batch_num_tokens is data['loss_mask'] "
        "summed over DP before the micro-batches; returns the outputs on the last pipeline stage",
    (_TM, "MegatronEngine.get_data_parallel_group"):
        "() -> mpu.get_data_parallel_group(): the ranks with this rank's TP/PP/CP coordinates (under dynamic CP "
        "the DPxCP plane)",
    (_TM, "MegatronEngine._build_tf_config"):
        "the model computes in the engine config's dtype (self.param_dtype = PrecisionType.to_dtype("
        "self.engine_config.dtype): actor.megatron.dtype, which McoreEngineConfig limits to bfloat16 and float16): "
        "the trainer dtype the parity audit reads for a Megatron actor",
    (_TM, "MegatronEngine.lr_scheduler_step"):
        "() -> get_megatron_last_lr(optimizer) after lr_scheduler.step(1) (logged by the worker as lr)",
    ("verl.utils.megatron.optimizer", "get_megatron_last_lr"):
        "(optimizer) -> optimizer.param_groups[0]['lr'] (what lr_scheduler_step returns: actor/lr)",
    ("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.step"):
        "(increment): num_steps += increment, then every param group's 'lr' = get_lr(group) (a float, or a tensor "
        "filled in place), overwriting what was there",
    ("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.get_lr"):
        "(param_group) -> the group's scheduled LR at the current num_steps (what step() wrote last)",
    # the safe vocabulary (megatron_engine.py _lm_head_logits_processor)
    (_TM, "MegatronEngineWithLMHead._lm_head_logits_processor"):
        "(logits, label, temperature, *, calculate_sum_pi_squared, calculate_entropy, distillation_use_topk, "
        "distillation_only, logits_processor_func, batch, data_format) -> dict of per-position tensors of label's "
        "shape; logits [B, S, V/TP] (bshd) or [1, T, V/TP] (thd), this TP rank's vocabulary shard, divided in place "
        "by temperature (<= 0 set to 1e-8) in the logits' dtype; the forward functions lay out every entry of the "
        "dict like the log-probs (jagged nested on the input ids)",
    ("verl.utils.megatron.tensor_parallel", "vocab_parallel_sum_pi_squared"):
        "(vocab_parallel_logits) -> sum of squared probabilities over the TP-sharded vocabulary, non-destructive",
    ("megatron.core.tensor_parallel.utils", "VocabUtility.vocab_range_from_per_partition_vocab_size"):
        "(per_partition_vocab_size, rank, world_size) -> (rank * width, rank * width + width): the columns of the "
        "vocabulary TP rank `rank` holds (vocab_parallel_cross_entropy's own split)",
    ("megatron.core.parallel_state", "get_tensor_model_parallel_group"):
        "() -> the TP process group the vocabulary is split over",
    ("megatron.core.parallel_state", "get_tensor_model_parallel_rank"):
        "() -> this rank's index in the TP group (its vocabulary shard)",
    ("megatron.core.parallel_state", "get_tensor_model_parallel_world_size"):
        "() -> the number of vocabulary shards",
    # the safe vocabulary with verl's fused forward (megatron_engine.py forward_step, _FusedSafeHead)
    (_TM, "MegatronEngineWithLMHead.forward_step"):
        "(batch_iter, model, logits_processor_func, postprocess_micro_batch_func): takes one micro-batch with "
        "next(batch_iter); unless use_fused_kernels it binds _lm_head_logits_processor (partial with the keyword "
        "flags) as the logits processor of the engine's forward; with use_fused_kernels (engine_config's; per-batch "
        "values must match it) verl's fused forward computes the log-probs without the processor; returns (output, "
        "partial(postprocess_micro_batch_func, data=batch, local_cp_size=local_cp_size))",
    (_TM, "MegatronEngine._get_context_parallel_layout"):
        "(unwrapped_model) -> 'zigzag' or 'contiguous': the CP layout the fused forward lays its outputs out with",
    ("verl.models.mcore.model_forward_fused", "fused_forward_model_engine"):
        "the fused forward of the engine (megatron-core >= 0.18): calls the model with output_processor="
        "fused_output_processor and output_processor_context=FusedOutputProcessorContext(temperature=T), packed thd "
        "labels (the input ids rolled by one), then lays out output.log_probs (and .entropy when calculate_entropy) "
        "with postprocess_thd_engine",
    ("verl.models.mcore.model_forward_fused", "FusedOutputProcessorContext"):
        "dataclass with temperature: float, the fused forward's uniform temperature",
    ("verl.models.mcore.util", "postprocess_thd_engine"):
        "(output [1, T] packed per position, packed_seq_params, input_ids nested, batch_size, post_process, "
        "local_cp_size, cp_layout) -> jagged nested [B, j] on input_ids (all-gathered over CP)",
    ("verl.utils.megatron_utils", "unwrap_model"):
        "(model) -> the module inside Megatron's wrappers (DDP, Float16Module)",
    ("verl.utils.model", "CausalLMOutputForPPO"):
        "transformers ModelOutput with log_probs and entropy: what the fused forward reads from the model's output",
    ("megatron.core.models.gpt.gpt_model", "GPTModel.forward"):
        "(..., output_processor=None, output_processor_context=None): passed on to _postprocess",
    ("megatron.core.models.gpt.gpt_model", "GPTModel._postprocess"):
        "on the last stage, with an output_processor: returns output_processor(hidden_states= [s, b, H] (sequence-"
        "parallel-scattered when sequence_parallel), output_layer=, output_weight= (the shared embedding when tied, "
        "else None), labels= [b, s], packed_seq_params=, context=output_processor_context, config=, ...) in place of "
        "the output layer and loss",
    # the engine's kept sets replayed (megatron_engine.py forward_step, _kept_rows)
    ("verl.models.mcore.model_forward", "gptmodel_forward_model_engine"):
        "the engine forward (remove-padding, thd): calls the model with packed_seq_params= (cu_seqlens_q_padded: "
        "each sample's first row, the sequences padded one by one), then the logits processor with the labels laid "
        "out the same way (preprocess_thd_engine, rolled by one)",
    ("verl.models.mcore.util", "preprocess_thd_engine"):
        "packs the micro-batch's sequences one after another, each padded to the TP/CP alignment: "
        "PackedSeqParams(cu_seqlens_q_padded=each sample's first row, ...)",
    ("megatron.core.parallel_state", "get_context_parallel_world_size"):
        "() -> the CP size: > 1 splits every sequence over CP ranks (replay then recomputes)",
    ("megatron.core.tensor_parallel.mappings", "copy_to_tensor_model_parallel_region"):
        "(input) -> input in forward, all-reduce of the gradient over TP in backward: the output layer's input "
        "mapping without sequence parallelism",
    ("megatron.core.tensor_parallel.mappings", "gather_from_sequence_parallel_region"):
        "(input) -> all-gather along the sequence over TP in forward, reduce-scatter (sum) of the gradient in "
        "backward: the output layer's input mapping with sequence parallelism",
}

# Config keys (dotted, in verl's composed ppo_trainer config) that composed.check_composed_config, trainer.py and
# parity_spec.py read; each must exist in verl's defaults (tests/verl_suite/test_verl_sources.py composes them).
VERL_CONFIG_KEYS = (
    "trainer.use_v1", "trainer.v1.trainer_mode", "trainer.save_freq",
    "actor_rollout_ref.actor.optim.optimizer_impl", "actor_rollout_ref.actor.optim.optimizer",
    "actor_rollout_ref.model.use_fused_kernels", "actor_rollout_ref.actor.use_fused_kernels",
    "actor_rollout_ref.model.override_config", "actor_rollout_ref.actor.use_torch_compile",
    "actor_rollout_ref.actor.fsdp_config.model_dtype",
    "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.logprobs_mode",
    "actor_rollout_ref.rollout.calculate_log_probs", "actor_rollout_ref.rollout.engine_kwargs.vllm",
    "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.top_p", "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.dtype", "actor_rollout_ref.rollout.enable_prefix_caching",
    "actor_rollout_ref.rollout.enable_chunked_prefill", "actor_rollout_ref.rollout.enforce_eager",
    "actor_rollout_ref.rollout.quantization", "actor_rollout_ref.rollout.full_determinism",
    "actor_rollout_ref.model.path", "actor_rollout_ref.actor.fsdp_config.use_torch_compile",
    "actor_rollout_ref.actor.strategy", "model_engine", "actor_rollout_ref.actor.checkpoint.save_contents",
    "actor_rollout_ref.actor.checkpoint.load_contents",
    "algorithm.rollout_correction.bypass_mode", "actor_rollout_ref.rollout.multi_turn.enable",
    "distillation.enabled", "distillation.distillation_loss.loss_mode",
)
# Keys parity_spec.py reads of a Megatron actor, in verl's composed ppo_megatron_trainer config (the same test)
# and composed.py of its checkpoint
VERL_MEGATRON_CONFIG_KEYS = ("actor_rollout_ref.actor.megatron.dtype",
                             "actor_rollout_ref.actor.checkpoint.save_contents",
                             "actor_rollout_ref.actor.checkpoint.load_contents")
# Keys the adapter reads that verl's defaults leave out (users add them with "+"); the adapter then assumes verl's
# own fallback: mixed_precision absent -> bf16 autocast (transformer_impl.py), repetition_penalty: verl's agent
# loops send 1.0 whatever it says (AgentLoopWorkerTQ.generate_sequences above).
VERL_OPTIONAL_CONFIG_KEYS = ("actor_rollout_ref.actor.fsdp_config.mixed_precision",
                             "actor_rollout_ref.rollout.repetition_penalty")
