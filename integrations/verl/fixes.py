"""verl's words for the fixes (``tim_plugins.fixes``): each finding's knob as a Hydra override of ``main_ppo``, and
what reduces each part of the log-ratio. Data only: importing it imports no framework (the offline report reads it
with verl absent)."""

from __future__ import annotations

from tim_plugins.truncation import DEFAULT_MIN_P

__all__ = ["CAUSE_FIXES", "FINDING_FIXES", "FRAMEWORK", "NAME", "PART_FIXES", "RUNS_ON"]

FRAMEWORK = "verl"
NAME = "verl"
# verl samples with vLLM and trains a transformers model under FSDP.
RUNS_ON = ("vllm", "hf", "tim_plugins")

# {finding code: knob} (codes: tim_plugins.parity.findings.CODES). Hydra: `key=` for a key in verl's ppo_trainer
# config; `++key=` for one it lacks (`+key=` fails when the user has already added the key, `++` adds or overrides).
FINDING_FIXES = {
    "dtype-mismatch":
        "actor_rollout_ref.rollout.dtype=<bfloat16|float16|float32> with the actor in the same dtype: "
        "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=<bf16|fp16|fp32> (FSDP), or on a "
        "Megatron actor (--config-name=ppo_megatron_trainer, which has no float32) "
        "actor_rollout_ref.actor.megatron.dtype=<bfloat16|float16>",
    # verl's FSDP actor computes the lm_head at mixed_precision.param_dtype, the Megatron actor at megatron.dtype (no
    # fp32-head option): a vLLM head in another dtype is the mismatch, not its fix.
    "lm-head-precision-mismatch":
        "the actor has no fp32-head option (its lm_head runs in the model's dtype: FSDP mixed_precision.param_dtype, "
        "Megatron megatron.dtype, bf16 by default): keep vLLM's head in the model dtype (drop "
        "hf_overrides.head_dtype, or ++actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.head_dtype=model "
        "where no FP8 rollout needs the hf_overrides verl builds itself, which any engine_kwargs.vllm.hf_overrides "
        "replaces); "
        "for an fp32 head on both sides (FSDP only: Megatron has no float32), the whole model in fp32: "
        "actor_rollout_ref.rollout.dtype=float32 with "
        "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "logprobs-mode-not-processed":
        "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs",
    "sampler-truncation-unmatched":
        f"keep your sampling: ++tim.safe_vocab.min_p={DEFAULT_MIN_P:g} with "
        "'++actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors=[tim_plugins.integrations.vllm."
        "min_p:TIMMinPLogitsProcessor]' ++actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config."
        f"tim_min_p={DEFAULT_MIN_P:g} (the actor then applies the rollout's own truncation, min_p and "
        "actor_rollout_ref.rollout.top_p / top_k as you set them, with or without fused kernels); with top_p / "
        "top_k and no min-p pruning: ++tim.safe_vocab.enable=true alone (no logits processor)",
    "temperature-mismatch":
        "actor_rollout_ref.rollout.temperature=<T> (the actor divides by the same value)",
    # VERL_SOURCES verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ.generate_sequences (repetition_penalty=1.0)
    "sampler-penalties-unmatched":
        "verl's agent loop sends repetition_penalty=1.0 and no other penalty with every request (no "
        "actor_rollout_ref.rollout setting changes that): drop your own logits processors from "
        "actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors (tim-plugins' min-p processor is matched "
        "by the actor) and any penalty or logit bias a custom agent loop adds to its sampling_params",
    "quantized-rollout":
        "actor_rollout_ref.rollout.quantization=null "
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=auto",
    "prefix-caching-on":
        "actor_rollout_ref.rollout.enable_prefix_caching=False",
    "chunked-prefill-on":
        "actor_rollout_ref.rollout.enable_chunked_prefill=False",
    "cudagraph-on":
        "actor_rollout_ref.rollout.enforce_eager=True",
    "batch-invariance-off":
        "actor_rollout_ref.rollout.full_determinism=True (vLLM batch invariant: rollout side only)",
    # the audit's kernel families (parity.spec.attention_family): FLASH_ATTN is flash_attention_2's, the actor's
    # default; FLEX_ATTENTION is flex_attention's
    "attention-backend-mismatch":
        "the same kernel on both sides: ++actor_rollout_ref.model.override_config.attn_implementation="
        "flash_attention_2 with ++actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend=FLASH_ATTN, or "
        "++actor_rollout_ref.model.override_config.attn_implementation=flex_attention with "
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend=FLEX_ATTENTION",
    # vLLM picks its attention backend at start-up unless told: the composed config then does not say it
    "unknown-setting":
        "name each setting it lists in the overrides: vLLM's attention backend, else chosen at start-up, "
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend=FLASH_ATTN (the kernel of the actor's "
        "default flash_attention_2); the rollout's dtype (and its lm_head's) where auto follows a checkpoint the "
        "driver could not read: actor_rollout_ref.rollout.dtype=<bfloat16|float16|float32>, the actor's dtype",
}

PART_FIXES = {
    "staleness": "a lower actor_rollout_ref.actor.optim.lr, or fewer updates per batch: "
                 "actor_rollout_ref.actor.ppo_epochs=1 and actor_rollout_ref.actor.ppo_mini_batch_size=<B>, "
                 "B = data.train_batch_size (one optimizer step per batch)",
    "staleness_async": "fresher samples: fewer batches generated ahead (trainer.v1.colocate_async.num_warmup_batches, "
                       "trainer.v1.separate_async.num_warmup_batches), a lower "
                       "trainer.v1.sampler.max_off_policy_threshold (trajectories spanning more weight versions are "
                       "dropped), and in separate_async fewer updates per weight sync: a smaller "
                       "trainer.v1.separate_async.parameter_sync_step=<N> with "
                       "actor_rollout_ref.actor.ppo_mini_batch_size=<B/N> (verl requires data.train_batch_size = "
                       "B = N x ppo_mini_batch_size there; N=1: one update per sync)",
    "mismatch": "the parity fixes in the audit's fix column (rollout dtype, logprobs_mode, truncation), and "
                "`tim-plugins measure --compare`",
}

_SYNC = ("verl's weight sync (ActorRolloutRefWorker.update_weights after each step: the actor engine's "
         "get_per_tensor_param into the rollout's update_weights, loaded by the vLLM worker extension's "
         "update_weights_from_ipc) must write every tensor into the engine: check what wraps or filters either side "
         "(a custom worker_extension_cls, a patched load_weights, a LoRA / QAT / FP8 refit path), and with "
         "actor_rollout_ref.rollout.free_cache_engine=true that the weights are resumed before they are written; "
         "a checkpoint engine (actor_rollout_ref.rollout.checkpoint_engine.backend other than naive: "
         "separate_async's standalone replicas) must carry every tensor from the actor's send_weights to each replica's receive_weights")

# {cause code (tim_plugins.causes.CAUSES): knob}
CAUSE_FIXES = {
    "sync-noop": _SYNC + "; with a LoRA adapter sync (actor_rollout_ref.model.lora.merge=false) the old adapter must "
                         "be removed before add_lora: vLLM keeps the adapter it holds under the same id",
    "sync-tensors-stale": _SYNC + "; the tensors named were skipped (a name the engine's loader drops, a layer "
                                  "filtered out, an export that leaves a layer out)",
    "sync-precision": "write each tensor in the rollout's dtype: actor_rollout_ref.rollout.dtype is what vLLM runs "
                      "in, and a refit that casts some tensors (an FP8 / QAT export, "
                      "actor_rollout_ref.rollout.quantization) leaves those layers rounded (verl#7519)",
    "sync-tensors-missing": "the names get_per_tensor_param yields (the FSDP state dict's, the Megatron bridge's HF "
                            "export) must be the checkpoint's: a wrapped or renamed module needs its prefix "
                            "stripped before the sync",
    "sync-tensors-differ": _SYNC + "; values that are neither the actor's nor the previous ones point at a refit "
                                   "that wrote other numbers (a quantized refit beyond its scale, verl#7986; a shard "
                                   "into the wrong slice)",
    "sync-prefix-cache": "verl resets the rollout's prefix cache after update_weights (the vLLM server's "
                         "clear_kv_cache): a custom rollout, checkpoint engine or weight path must call it too, once "
                         "no request is in flight (vLLM keeps the cache while a request holds blocks: a partial "
                         "rollout's paused requests); or actor_rollout_ref.rollout.enable_prefix_caching=false",
    "probe-engine-unchanged": "check that every rollout server receives and loads the weights at each "
                              "update_weights (the checkpoint engine's transfer, a separate rollout server's reload)",
    "probe-engine-drift": _SYNC,
    "engine-stale": "keep ++tim.sync_check.enable=true (the default with the monitor) to see which tensors; then "
                    "check that the rollout reloads at every update_weights and that nothing else (a separate "
                    "rollout server, a checkpoint engine) serves the old weights",
    "sampler-constrained": "a constraint in the rollout's sampler (a logits processor or structured-output "
                           "setting passed to the vLLM server) is not applied by the actor: drop it and reward the "
                           "format instead; tokens an agent loop writes rather than samples need response_mask 0, as "
                           "tool output has",
    "floor-jump": "look at what changed at that step: the weight sync (tim/cause/sync_bad_tensors) and the "
                  "prefix-cache reset after it (the server's clear_kv_cache), the rollout server, the sampling "
                  "settings; with all of them in order, a policy that moves nats per token per step (actor/ppo_kl and "
                  "the loss exploding) raises the floor with it: a lower actor_rollout_ref.actor.optim.lr",
    "staleness": PART_FIXES["staleness"] + "; in tim_colocate_async / tim_separate_async, "
                 + PART_FIXES["staleness_async"],
    "truncation": FINDING_FIXES["sampler-truncation-unmatched"],
}
