"""TRL's words for the fixes (``tim_plugins.fixes``): each finding's knob as a ``GRPOConfig`` field, a ``trl
vllm-serve`` flag or a ``TIMConfig`` option, and what reduces each part of the log-ratio in a GRPO or asynchronous
GRPO run. Data only: importing it imports no framework (the offline report reads it with TRL absent)."""

from __future__ import annotations

__all__ = ["CAUSE_FIXES", "FINDING_FIXES", "FRAMEWORK", "NAME", "PART_FIXES", "RUNS_ON"]

FRAMEWORK = "trl"
NAME = "TRL"
# TRL samples with vLLM or transformers' generate and trains a transformers model.
RUNS_ON = ("vllm", "hf", "tim_plugins")

# TRL builds the colocated LLM() itself, with a fixed argument list (trl/generation/vllm_generation.py): no
# GRPOConfig field reaches these engine arguments, so only server mode sets them.
_COLOCATE = ("colocate mode cannot set it (TRL builds LLM() with a fixed argument list that no GRPOConfig field "
             "reaches): run vllm_mode='server' with the `trl vllm-serve` above")

# {finding code: knob} (codes: tim_plugins.parity.findings.CODES)
FINDING_FIXES = {
    "dtype-mismatch":
        "run vLLM in the trainer's dtype: server mode `trl vllm-serve --dtype <trainer dtype>` (TRL passes no dtype "
        "to LLM(); vLLM's 'auto' runs fp32 checkpoints in bf16); " + _COLOCATE + ". GRPOConfig defaults to "
        "bf16=True over the float32 weights TRL loads a model path in, which no vLLM dtype reproduces: for the fp32 "
        "pair, GRPOConfig(bf16=False) with `trl vllm-serve --dtype float32`. bf16=True is not the fix: it "
        "autocasts the trainer's matmuls over its fp32 weights, norms and residual stream, which is not vLLM's bf16 "
        "model (the per-token gap stays: tests/test_trl_vllm_dtype_fix.py). For the bf16 pair, the trainer's "
        "weights in bf16: GRPOConfig(model_init_kwargs={'dtype': 'bfloat16'}) for a model given by name (or a model "
        "you load in torch.bfloat16 yourself), which colocate mode takes too, as vLLM's 'auto' runs bf16 (the "
        "optimizer then updates bf16 weights: updates below their resolution round away). A bf16 engine kept for "
        "its speed: "
        "correct the gap instead: TRL's vllm_importance_sampling_correction=True (its default), or "
        "TIMConfig(is_correction='token_tis') with vllm_importance_sampling_correction=False",
    "lm-head-precision-mismatch":
        "cast_lm_head_to_fp32=True plus the same head in vLLM: server mode append "
        "--hf-overrides '{\"head_dtype\": \"float32\"}' (forwarded to vllm serve); " + _COLOCATE,
    "logprobs-mode-not-processed":
        "colocate and `trl vllm-serve` set it; a plain `vllm serve` needs --logprobs-mode processed_logprobs",
    "sampler-truncation-unmatched":
        "keep your sampling: TIMConfig(safe_vocab=True) makes the trainer apply the sampler's own min_p, top_p and "
        "top_k as set in GRPOConfig (token ratio back to 1), with safe_vocab_min_p=None (its default: a "
        "safe_vocab_min_p other than GRPOConfig.min_p cuts another tail than the sampler); or top_p=1.0, top_k=0, "
        "min_p=None (the GRPO trainer itself applies no truncation; with use_vllm=False, transformers fills a None "
        "from the model's generation_config: where that sets a min_p, min_p=0.0)",
    "temperature-mismatch":
        "set the temperature once, GRPOConfig(temperature=T), and drop 'temperature' from generation_kwargs: TRL "
        "lays generation_kwargs over the sampler's settings (colocate, server mode and transformers generation "
        "alike), while the trainer divides by GRPOConfig.temperature",
    "sampler-penalties-unmatched":
        "repetition_penalty=1.0 and no penalties in generation_kwargs; with use_vllm=False, none of the "
        "transformers settings the audit names there either (no_repeat_ngram_size, bad_words_ids, suppress_tokens, "
        "begin_suppress_tokens, sequence_bias, min_new_tokens, min_length, forced_eos_token_id, typical_p, top_h, "
        "epsilon_cutoff, eta_cutoff, ...): drop them from generation_kwargs, as the GRPO trainer applies none of "
        "them and the safe vocabulary cuts at min_p, top_p and top_k only; no vllm_structured_outputs_regex (nor "
        "generation_kwargs['structured_outputs']): the trainer scores the unconstrained model, so reward the format "
        "instead. A setting the audit names that your generation_kwargs do not set comes from the model's "
        "generation_config (with use_vllm=False, transformers fills what TRL leaves None from it): its neutral value "
        "in generation_kwargs (e.g. {'no_repeat_ngram_size': 0, 'typical_p': 1.0}), or, for one without a neutral "
        "value (bad_words_ids, suppress_tokens, ...), model.generation_config.<key> = None before building the "
        "GRPOTrainer",
    "quantized-rollout":
        "do not load the policy with bitsandbytes 4-bit (TRL then sets quantization='bitsandbytes'); "
        "server mode: `trl vllm-serve` on an unquantized checkpoint, no --quantization forwarded to vllm serve, and "
        "--kv_cache_dtype auto (its default)",
    "prefix-caching-on":
        "server mode: `trl vllm-serve --enable_prefix_caching False`; " + _COLOCATE,
    "chunked-prefill-on":
        "server mode: append --no-enable-chunked-prefill (forwarded to vllm serve); " + _COLOCATE,
    "attention-backend-mismatch":
        "the same attention kernel on both sides: server mode append --attention-backend FLASH_ATTN (forwarded to "
        "vllm serve), and the trainer's model with attn_implementation='flash_attention_2' "
        "(GRPOConfig(model_init_kwargs={'attn_implementation': 'flash_attention_2'}) for a model given by name, "
        "from_pretrained(..., attn_implementation='flash_attention_2') for one you load); " + _COLOCATE,
    "cudagraph-on":
        "server mode: `trl vllm-serve --enforce_eager True`; " + _COLOCATE,
    "batch-invariance-off":
        "no GRPOConfig field: for a TIM-free baseline run, TIMCallback(trainer, TIMConfig(rollout='exact')) "
        "(the exact sampler: k3 reads 0; it replaces TRL's transformers generation, so it needs use_vllm=False "
        "and no truncation or penalty: top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0); with "
        "use_vllm=True, start `trl vllm-serve` (or, colocated, the training script) with VLLM_BATCH_INVARIANT=1 in "
        "its environment (GPUs with CC >= 8.0); `tim-plugins check-batch-invariance --model PATH` measures the "
        "trainer side",
    # what the audit cannot read from a GRPOConfig: the checkpoint's dtype (vLLM's 'auto' follows it) and the
    # attention backend vLLM picks at start-up
    "unknown-setting":
        "`tim-plugins audit --trl-config`: without --model, add --model PATH (the policy checkpoint, whose dtype "
        "vLLM's 'auto' follows); the attention backend vLLM picks at start-up is known to the live engine only: "
        "TIMCallback's audit at the start of training reads it (TIMConfig(parity_audit=True))",
}

PART_FIXES = {
    "staleness": "a lower GRPOConfig(learning_rate=...), or fewer updates per batch: GRPOConfig(num_iterations=1, "
                 "steps_per_generation=gradient_accumulation_steps) with generation_batch_size unset (TRL refuses "
                 "both); with AsyncGRPOTrainer (no num_iterations "
                 "there) a smaller AsyncGRPOConfig(max_staleness=...) and weight_sync_steps=1",
    "staleness_async": "fresher samples: a smaller AsyncGRPOConfig(max_staleness=...) (older samples are dropped), a "
                       "weight sync every step (weight_sync_steps=1), more micro-batches per step "
                       "(gradient_accumulation_steps: accelerate fetches one batch ahead, which trains one sync "
                       "later; the step's other batches are fetched after the sync)",
    "mismatch": "the parity fixes in the audit's fix column (dtype, lm_head precision, truncation), and `tim-plugins "
                "measure --compare` to find the setting that removes it",
}

_SYNC = ("TRL's weight sync (VLLMGeneration.sync_weights, before each generation after an optimizer step) must write "
         "every parameter into the engine: colocate, check what wraps sync_weights or the engine's load_weights "
         "(with vllm_enable_sleep_mode, the weights are woken first); server mode, that the server reloads "
         "(update_named_params) and resets its prefix cache; a rollout_func that samples from its own engine (not "
         "trainer.vllm_generation, which TRL syncs before calling it) must sync that engine itself")

# {cause code (tim_plugins.causes.CAUSES): knob}
CAUSE_FIXES = {
    "sync-noop": _SYNC,
    "sync-tensors-stale": _SYNC + "; the tensors named were skipped (a name the engine's loader drops, a layer "
                                  "filtered out)",
    "sync-precision": "write each tensor in the engine's dtype: a model loaded in one dtype and cast in parts (a "
                      "custom sync casting some tensors) leaves those layers rounded; TRL passes no dtype to LLM() in "
                      "colocate mode (vLLM follows config.json)",
    "sync-tensors-missing": "the names TRL sends (VLLMGeneration._fix_param_name_to_vllm: wrapper prefixes dropped) "
                            "must be the checkpoint's: a model wrapped or renamed after loading needs those prefixes "
                            "stripped",
    "sync-tensors-differ": _SYNC,
    "sync-prefix-cache": "TRL's VLLMGeneration.sync_weights ends with the engine's reset_prefix_cache (colocate: "
                         "llm.reset_prefix_cache(); server mode: vllm_client.reset_prefix_cache()): a wrapped or "
                         "custom sync (a rollout_func syncing its own engine) must keep that call, after the weights "
                         "are written and with no request in flight",
    "probe-engine-unchanged": "server mode: check that the weights TRL streams reach `trl vllm-serve` and are "
                              "loaded there (init_communicator, update_named_params; the server's weight-transfer "
                              "engine and its log), and that nothing reloads the model behind TRL's back",
    "probe-engine-drift": "server mode: check that every parameter TRL streams is loaded by `trl vllm-serve` under "
                          "its name and in its dtype (a layer the server's loader drops or filters keeps its old "
                          "weights); with a custom sync or rollout_func, that it sends every layer",
    "engine-stale": "colocate: keep TIMConfig(sync_check=True) to see which tensors; server mode: check that `trl "
                    "vllm-serve` receives the weights (init_communicator, update_named_params) and that nothing else "
                    "reloads the model; with vllm_importance_sampling_correction, TRL's own ratios read the same; "
                    "AsyncGRPOTrainer (which neither sync check nor probe reads): check that its weight transfer "
                    "(WeightTransferClient.send_weights, every weight_sync_steps) reaches and loads in the server",
    "sampler-constrained": "vllm_structured_outputs_regex (or generation_kwargs['structured_outputs'], a logits "
                           "processor in vLLM) constrains the sampler, not the trainer: drop it and reward the format "
                           "with a reward function instead; if you keep it, set vllm_importance_sampling_correction="
                           "False: TRL's correction weighs each sequence by the trainer's p of what the constraint "
                           "forced, and the loss of a constrained sequence vanishes; where the parity audit found "
                           "sampler-penalties-unmatched, the sampler's penalty moves confident tokens too: "
                           "repetition_penalty=1.0 and no penalties in generation_kwargs",
    "floor-jump": "look at what changed at that step: the weight sync (TIMConfig(sync_check=True) in colocate mode; "
                  "AsyncGRPOTrainer's weight transfer to its server) and the prefix-cache reset (GRPOTrainer: at the end "
                  "of sync_weights; AsyncGRPOTrainer: at the server's pause before the transfer), the "
                  "vLLM server, the sampling settings; with all of them in order, a policy that moves nats per "
                  "token per step (k3 and the loss exploding) raises the floor with it: a lower "
                  "GRPOConfig(learning_rate=...)",
    "staleness": PART_FIXES["staleness"],
    "truncation": FINDING_FIXES["sampler-truncation-unmatched"],
}
