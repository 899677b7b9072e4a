"""The vLLM internals (0.27 - 0.34) tim-plugins relies on, each named with what is assumed of it.

vLLM's custom logits processors live in ``vllm.v1`` modules (two interfaces, one per model runner), and what a
live engine runs is only readable from its configuration objects and its workers: all of it may change in any
release. So the range is pinned (``tim_plugins._optional.SUPPORTED_RANGES``, checked when this package is
imported), every use site names its entry here in a comment (``# VLLM_SOURCES <module>:<qualname>``), and
``tests/test_vllm_sources.py`` checks each assumption against the installed vLLM (signatures, statements in the
source, and behaviour where cheap). The V2 model runner runs custom logits processors from vLLM 0.31 on: its
entries are in ``VLLM_SINCE``; before that release the V2 runner refuses custom processors, so vLLM runs ours in
the V1 runner (the guard tests check both sides). vLLM 0.34 removed the V1 runner (its sampler, its logits-processor
interface, its model runner): those entries are in ``VLLM_UNTIL``, and from 0.34 on the V2 runner is the only one.
Users: this adapter (``min_p``, ``inject``, ``sampling``, ``rollout``, ``parity_spec``: the live engine reader), the
core's engine-argument reader ``tim_plugins.parity.vllm_spec`` (vLLM's defaults, as data), ``tim_plugins.truncation``
(vLLM's truncation order) and ``tim_plugins.apps.measure``.
"""

from __future__ import annotations

__all__ = ["VLLM_SINCE", "VLLM_SOURCES", "VLLM_UNTIL"]

_LP = "vllm.v1.sample.logits_processor"
_V2 = "vllm.v1.worker.gpu.sample.logits_processor"

# (module, qualified name) -> what is assumed of it (vLLM 0.31; an entry in VLLM_SINCE from that release on).
VLLM_SOURCES = {
    # --------------------------------------------------------------------- V1 model runner: logits processors
    (_LP, "LogitsProcessor"):
        "the V1 interface: __init__(vllm_config, device, is_pin_memory); apply(logits) on the whole batch "
        "[num_rows, V]; is_argmax_invariant(); update_state(batch_update); classmethod "
        "validate_params(sampling_params) raising ValueError on a bad request",
    (_LP, "BatchUpdate"):
        "batch_size; added (index, params, prompt_tok_ids, output_tok_ids); removed (index); moved (a, b, "
        "directionality)",
    (_LP + ".builtin", "process_dict_updates"):
        "(req_entries, batch_update, new_state(params, prompt_ids, output_ids) -> state | None) -> whether the "
        "dict changed: added rows get new_state (None removes them), removed rows are dropped, moved rows "
        "follow (a -> b, or swapped)",
    (_LP, "build_logitsprocs"):
        "the built-in processors (min tokens, logit bias, min-p) first, then the custom ones, each built as "
        "ctor(vllm_config, device, is_pin_memory)",
    (_LP, "_load_logitsprocs_by_fqcns"):
        "a processor named '<module>:<Class>' is imported and must subclass the V1 LogitsProcessor",
    (_LP, "AdapterLogitsProcessor"):
        "per-request wrapper: new_req_logits_processor(params) returns a callable or None; a callable of three "
        "parameters gets (prompt_ids, output_ids, logits row); apply() runs it on each active row",
    ("vllm.v1.sample.sampler", "Sampler.apply_logits_processors"):
        "non-argmax-invariant processors (the injector) run before the penalties, and (Sampler.forward) before "
        "sample() divides by the temperature",
    ("vllm.v1.sample.sampler", "Sampler.sample"):
        "temperature (greedy rows, T < _SAMPLING_EPS, divided by 1), then the argmax-invariant processors "
        "(built-in min-p first, then ours), then top-k/top-p; processed log-probs are taken after top-k/top-p",
    ("vllm.v1.sample.sampler", "_SAMPLING_EPS"):
        "1e-5: below it a request is sampled greedily and min-p is skipped",
    ("vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_top_p_pytorch"):
        "top-k, then top-p on the top-k-masked logits; with min-p before both, vLLM truncates min-p -> top-k -> "
        "top-p (Truncation(order='vllm'))",
    # --------------------------------------------------------------------- V2 model runner: logits processors
    (_V2, "LogitsProcessor"):
        "the V2 interface: __init__(vllm_config, req_states: LogitsProcRequestState); add_request(req_idx, "
        "sampling_params) -> bool (whether it modifies that request); apply_staged_writes(); apply(logits, ctx) "
        "on [num_rows, V] float32, rows mapped to request slots by ctx",
    (_V2, "LogitsProcRequestState"):
        "device and max_num_reqs (request slots are indices below it)",
    (_V2, "LogitsContext"):
        "expanded_idx_mapping ([rows] -> slot, on the device), idx_mapping_np ([requests] -> slot, on the host)",
    (_V2 + ".loader", "_load_v2_logitsprocs_by_fqcns"):
        "a processor named '<module>:<Class>' must subclass the V2 LogitsProcessor (so one class implementing "
        "both interfaces loads in either runner)",
    (_V2 + ".loader", "build_custom_logits_processors"):
        "ctor(vllm_config, LogitsProcRequestState.from_request_state(req_states)) for each custom class",
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler.apply_sampling_params"):
        "logit bias, penalties, bad words, then the custom processors (apply(logits, ctx)), then temperature, "
        "min-p and top-k/top-p; nothing runs for a batch where no request's add_request returned True",
    ("vllm.config", "VllmConfig._get_v2_model_runner_unsupported_features"):
        "() -> what the V2 runner cannot run in this configuration; before vLLM 0.31 (VLLM_SINCE) it lists "
        "'custom logits processors' when model_config.logits_processors is set, so use_v2_model_runner falls "
        "back to the V1 runner (a forced VLLM_USE_V2_MODEL_RUNNER=1 raises); from 0.31 on it does not",
    # --------------------------------------------------------------------- configuration objects
    ("vllm.config", "VllmConfig"):
        "additional_config (a dict, passed through from the engine args), model_config, cache_config, "
        "scheduler_config, compilation_config, device_config",
    ("vllm.config", "ModelConfig"):
        "dtype, head_dtype, logprobs_mode, quantization, logits_processors (the registered names or classes); "
        "vLLM >= 0.31: return_sampling_mask (default False; TRL's kept-set replay reads it on the live engine)",
    ("vllm.config.model", "_get_head_dtype"):
        "hf_overrides head_dtype: a dtype name -> that dtype for the lm_head, 'model' -> the model dtype, "
        "unset -> the model dtype for generative models",
    ("vllm.config.model", "_resolve_auto_dtype"):
        "dtype='auto': a float32 checkpoint runs in the platform's first supported dtype (bfloat16 on Ampere "
        "and later GPUs), other checkpoint dtypes are kept",
    ("vllm.config", "CacheConfig"):
        "fields cache_dtype (the KV-cache dtype, 'auto' = the model's) and enable_prefix_caching (resolved to a "
        "bool in a built engine)",
    ("vllm.config", "SchedulerConfig"):
        "field enable_chunked_prefill (resolved to a bool in a built engine)",
    ("vllm.config", "CompilationConfig"):
        "cudagraph_mode (a CUDAGraphMode whose str ends in NONE when off), mode (0 / NONE: not compiled)",
    ("vllm.config", "DeviceConfig"):
        "device_type: the engine's device kind ('cuda', 'cpu', ...)",
    ("vllm.engine.arg_utils", "EngineArgs"):
        "fields and defaults: dtype 'auto', logprobs_mode 'raw_logprobs', enforce_eager False, quantization "
        "None, kv_cache_dtype 'auto'; enable_prefix_caching / enable_chunked_prefill None, resolved on for a "
        "generative model; kv_cache_memory_bytes, hf_overrides, max_logprobs, logits_processors, "
        "additional_config exist",
    ("vllm.sampling_params", "SamplingParams"):
        "defaults temperature 1, top_p 1, top_k 0 (off), min_p 0, no penalties; extra_args (per-request dict "
        "for custom processors); flat_logprobs False, so each CompletionOutput.logprobs entry is a dict "
        "token_id -> Logprob(.logprob)",
    # --------------------------------------------------------------------- the live engine
    ("vllm.entrypoints.llm", "LLM.__init__"):
        "self.llm_engine: the engine (with .vllm_config and .model_config)",
    ("vllm.v1.engine.llm_engine", "LLMEngine.__init__"):
        "self.vllm_config (the resolved VllmConfig) and self.model_config = vllm_config.model_config",
    ("vllm.entrypoints.llm", "LLM.collective_rpc"):
        "(method: str | Callable, timeout=None, args=(), kwargs=None) -> one result per worker; a callable runs "
        "in each worker with the worker as its first argument",
    ("vllm.entrypoints.serve.dev.server_info.api_router", "show_server_info"):
        "GET /server_info?config_format=json (dev mode, what TRL's client asks) returns {'vllm_config': the "
        "VllmConfig dumped by pydantic in JSON mode}: model_config.{model, dtype, logprobs_mode, enforce_eager, "
        "quantization}, cache_config.{cache_dtype, enable_prefix_caching}, "
        "scheduler_config.enable_chunked_prefill, device_config.device",
    # --------------------------------------------------------------------- the weights (weights.VLLMWeights)
    ("vllm.model_executor.models.utils", "WeightsMapper._map_name_with_shard"):
        "(name) -> (vLLM name, shard id or None) or None (dropped): the model's hf_to_vllm_mapper, with the "
        "stacked names (q_proj -> qkv_proj, 'q'; gate_proj -> gate_up_proj, 0); before it, _map_name and the "
        "model's packed_modules_mapping {merged: [parts]}",
    ("vllm.model_executor.layers.linear", "LinearBase"):
        "tp_rank, tp_size; quant_method.apply(layer, x, bias=None) -> x @ W^T with the layer's effective weight "
        "(prepacked or quantized), input_size_per_partition for the local input width",
    ("vllm.model_executor.layers.linear", "ColumnParallelLinear"):
        "rows sharded over tp (weight and bias); MergedColumnParallelLinear.output_sizes (full sizes, a part's "
        "local rows at sum(output_sizes[:i]) // tp_size)",
    ("vllm.model_executor.layers.linear", "QKVParallelLinear"):
        "_get_shard_offset_mapping / _get_shard_size_mapping('q' | 'k' | 'v') (local rows), num_kv_head_replicas "
        "(k / v shard of rank r is r // replicas)",
    ("vllm.model_executor.layers.linear", "RowParallelLinear"):
        "columns sharded over tp, the bias whole",
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod"):
        "the quant_method of an unquantized linear layer (any other is a quantization scheme)",
    ("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding"):
        "shard_indices.org_vocab_start_index / org_vocab_end_index: the vocabulary rows this rank holds, from "
        "local row 0; rows past the vocabulary are padding",
    # --------------------------------------------------------------------- a LoRA adapter (lora_weights.LoRAReads)
    ("vllm.lora.model_manager", "LoRAModelManager"):
        "__init__ sets model.lora_manager = itself; .modules {module name: its LoRA layer}, .packed_modules_mapping "
        "{packed module: [parts]}, .lora_index_to_id (the adapter id in each slot, None where free)",
    ("vllm.lora.layers.base", "BaseLayerWithLoRA"):
        "every LoRA wrapper of a layer subclasses it; .base_layer: the wrapped layer, with the base weight",
    ("vllm.lora.layers.base_linear", "BaseLinearLayerWithLoRA"):
        "tp_size; lora_a_stacked / lora_b_stacked: one [max_loras, 1, rows, cols] buffer per part of a packed "
        "layer, the adapter of slot i at [i, 0, :r, :in] (lora_A) and [i, 0, :out, :r] (lora_B): what the forward "
        "computes with",
    ("vllm.lora.lora_weights", "LoRALayerWeights.optimize"):
        "lora_b *= scaling (in the adapter's dtype), then scaling = 1: the slot buffers hold lora_B scaled",
    ("vllm.lora.utils", "parse_fine_tuned_lora_name"):
        "(name, weights_mapper) -> (module name, is lora_A) for PEFT's base_model.model.<module>.lora_A.weight",
    ("vllm.model_executor.models.utils", "WeightsMapper"):
        "get_rename_mapper() (get_unstacked_mapper() before vLLM 0.31): the model's mapper of renames only, what "
        "vLLM's own adapter loader maps LoRA names with",
    # --------------------------------------------------------------------- the prefix cache (prefix_cache.py)
    ("vllm.v1.engine.core_client", "InprocClient"):
        "LLMEngine.__init__ sets .engine_core to it when the engine core runs in this process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0, which external_launcher sets); its .engine_core is the EngineCore",
    ("vllm.v1.engine.core", "EngineCore"):
        ".scheduler (the Scheduler); reset_prefix_cache() is the scheduler's",
    ("vllm.v1.core.sched.scheduler", "Scheduler"):
        ".kv_cache_manager (the KVCacheManager) whose reset_prefix_cache() LLM.reset_prefix_cache reaches",
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager"):
        ".enable_caching (prefix caching on), .block_pool (the BlockPool every KV cache group allocates from)",
    ("vllm.v1.core.block_pool", "BlockPool"):
        ".cached_block_hash_to_block (sized: one entry per block a new request can hit, and KV-cache group); "
        "reset_prefix_cache() empties it and returns True, or returns False and keeps it while a request holds blocks",
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"):
        "the V1 runner: a worker's .model_runner (CPU and GPU workers): .model (with .lm_head) and .attn_groups, "
        "lists of AttentionGroup whose .backend has get_name()",
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"):
        "the V2 runner (GPU workers where vLLM chooses it; every worker from vLLM 0.34 on, the CPU worker's "
        "CPUModelRunner subclassing it): .model (with .lm_head), set by load_model, and .attn_groups as in V1",
}

# Entries whose assumption holds from a vLLM release on (the guard tests check each exactly from then on): the V2
# model runner's custom logits processors. Before 0.31 the V2 logits-processor modules are absent, the V2 sampler
# runs no custom processor, and a configuration with one runs in the V1 runner
# (VllmConfig._get_v2_model_runner_unsupported_features).
VLLM_SINCE = {
    (_V2, "LogitsProcessor"): "0.31",
    (_V2, "LogitsProcRequestState"): "0.31",
    (_V2, "LogitsContext"): "0.31",
    (_V2 + ".loader", "_load_v2_logitsprocs_by_fqcns"): "0.31",
    (_V2 + ".loader", "build_custom_logits_processors"): "0.31",
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler.apply_sampling_params"): "0.31",
}

# Entries whose assumption holds before a vLLM release (the guard tests check that each is gone from then on): vLLM
# 0.34 removed the V1 model runner, with its sampler and its logits-processor interface. Each feature's hooks are
# checked only in the releases their entries hold in (``capabilities.Hook.since`` / ``until``).
_V1_UNTIL = "0.34"
VLLM_UNTIL = {
    (_LP, "LogitsProcessor"): _V1_UNTIL,
    (_LP, "BatchUpdate"): _V1_UNTIL,
    (_LP + ".builtin", "process_dict_updates"): _V1_UNTIL,
    (_LP, "build_logitsprocs"): _V1_UNTIL,
    (_LP, "_load_logitsprocs_by_fqcns"): _V1_UNTIL,
    (_LP, "AdapterLogitsProcessor"): _V1_UNTIL,
    ("vllm.v1.sample.sampler", "Sampler.apply_logits_processors"): _V1_UNTIL,
    ("vllm.v1.sample.sampler", "Sampler.sample"): _V1_UNTIL,
    ("vllm.v1.sample.sampler", "_SAMPLING_EPS"): _V1_UNTIL,
    ("vllm.config", "VllmConfig._get_v2_model_runner_unsupported_features"): _V1_UNTIL,
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"): _V1_UNTIL,
}
