"""Rollout `PipelineSpec` read from a live `vllm.LLM`: what the engine resolved and what its workers run.

It reads vLLM's internals: the engine's resolved configuration (``llm.llm_engine.vllm_config`` and its model, cache,
scheduler, compilation and device configs) and, through ``llm.collective_rpc(fn)`` (public), what each worker
actually runs: its model runner's parameters, ``lm_head`` and attention groups' backends, and the batch-invariance
switch in the worker's environment. Each of these is an entry of ``VLLM_SOURCES`` (``.sources``, guarded by
``tests/test_vllm_sources.py``), named where it is read; vLLM versions outside the tested range are noted in the
spec. So it lives in this adapter, not the core (which keeps the engine-argument reader and the spec,
``tim_plugins.parity.vllm_spec``). It imports nothing of vLLM (it reads the engine's attributes): the TRL adapter,
which drives vLLM engines, imports it without needing vLLM installed.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from tim_plugins.parity.spec import PipelineSpec
from tim_plugins.parity.vllm_spec import sampling_fields, sampling_processors, with_processor_min_p

__all__ = ["engine_args_from_server_info", "spec_from_llm"]


def _worker_numerics(worker: Any) -> dict:
    """Runs inside each vLLM worker (collective_rpc): what the model really computes with.

    VLLM_SOURCES vllm.v1.worker.gpu_model_runner:GPUModelRunner (model_runner.model, .lm_head, .attn_groups), and
    VLLM_SOURCES vllm.v1.worker.gpu.model_runner:GPUModelRunner (the V2 runner: the same attributes)."""
    out: dict[str, Any] = {"batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"}
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    if model is not None:
        params = list(model.parameters())
        out["dtype"] = str(params[0].dtype) if params else None
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        out["lm_head_dtype"] = str(weight.dtype) if weight is not None and weight.numel() > 0 else None
    backends = set()
    for groups in getattr(runner, "attn_groups", None) or []:
        for group in groups:
            backend = getattr(group, "backend", None)
            if backend is not None and hasattr(backend, "get_name"):
                backends.add(backend.get_name())
    out["attention_backends"] = sorted(backends)
    return out


def spec_from_llm(llm: Any, *, sampling: Any = None, framework: str = "vllm") -> PipelineSpec:
    """Rollout spec read from a live `vllm.LLM` (resolved config + what the workers report)."""
    # VLLM_SOURCES vllm.entrypoints.llm:LLM.__init__ (llm_engine)
    # VLLM_SOURCES vllm.v1.engine.llm_engine:LLMEngine.__init__ (vllm_config)
    # VLLM_SOURCES vllm.config:VllmConfig, and the fields read below:
    # VLLM_SOURCES vllm.config:ModelConfig
    # VLLM_SOURCES vllm.config:CacheConfig
    # VLLM_SOURCES vllm.config:SchedulerConfig
    # VLLM_SOURCES vllm.config:CompilationConfig
    # VLLM_SOURCES vllm.config:DeviceConfig
    vc = llm.llm_engine.vllm_config
    mc, cc, sc, comp = vc.model_config, vc.cache_config, vc.scheduler_config, vc.compilation_config
    device = getattr(getattr(vc, "device_config", None), "device_type", None)
    # VLLM_SOURCES vllm.entrypoints.llm:LLM.collective_rpc
    reports = llm.collective_rpc(_worker_numerics)
    first = reports[0] if reports else {}
    notes = {"workers": json.dumps(reports)}
    untested = _untested_vllm()
    if untested:
        notes["vllm_version"] = untested
    if len({json.dumps(r, sort_keys=True) for r in reports}) > 1:
        notes["warning"] = "workers report different numerics"
    backends = first.get("attention_backends") or []
    attention = backends[0] if len(backends) == 1 else (",".join(backends) if backends else None)
    head_cfg = str(mc.head_dtype)
    procs = getattr(mc, "logits_processors", None) or ()
    if procs:
        notes["logits_processors"] = f"registered (active per request only if activated): {[str(p) for p in procs]}"
    # VLLM_SOURCES vllm.config:VllmConfig (additional_config)
    sampler = with_processor_min_p(sampling_fields(sampling), [str(p) for p in procs],
                                   getattr(vc, "additional_config", None), notes)
    # min_tokens, structured outputs, a thinking budget: per-request processing the trainer does not recompute
    processing = sampling_processors(sampling)
    if processing:
        notes["custom_logits_processors"] = (f"SamplingParams {', '.join(processing)}: vLLM processes the logits "
                                             "the trainer scores unprocessed")
    cudagraph_mode = str(getattr(comp, "cudagraph_mode", "NONE")).upper()
    compile_mode = getattr(comp, "mode", 0)
    return PipelineSpec(
        side="rollout", framework=framework, device=device,
        dtype=first.get("dtype") or str(mc.dtype),
        lm_head_dtype=first.get("lm_head_dtype") or head_cfg,
        logprobs_mode=str(mc.logprobs_mode), **sampler, custom_logits_processors=processing,
        weight_quantization="none" if mc.quantization is None else str(mc.quantization),
        kv_cache_dtype=str(cc.cache_dtype), prefix_caching=bool(cc.enable_prefix_caching),
        chunked_prefill=bool(sc.enable_chunked_prefill),
        cudagraph=not cudagraph_mode.endswith("NONE"),
        compile=int(getattr(compile_mode, "value", compile_mode) or 0) != 0,
        batch_invariant=bool(first.get("batch_invariant")), attention_backend=attention,
        source="live vLLM engine (vllm_config + collective_rpc)", notes=notes,
    )


def _untested_vllm() -> Optional[str]:
    """A note when the installed vLLM is outside the tested range (the fields read above may have moved)."""
    from tim_plugins._optional import SUPPORTED_RANGES, is_supported_version, package_version

    if is_supported_version("vllm") is not False:
        return None
    low, high = SUPPORTED_RANGES["vllm"]
    return f"vllm {package_version('vllm')} is outside the tested range >={low},<{high}: fields read may have moved"


def engine_args_from_server_info(info: dict) -> tuple[dict, str]:
    """(engine args, device) from a vLLM server's /server_info?config_format=json reply (``info``: its
    'vllm_config' tree); a field the reply leaves out stays unknown (absent). Raises KeyError without the configs."""
    # VLLM_SOURCES vllm.entrypoints.serve.dev.server_info.api_router:show_server_info
    model, cache, sched = info["model_config"], info["cache_config"], info["scheduler_config"]
    dtype = model.get("dtype")
    args = {
        "model": model.get("model"), "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "logprobs_mode": model.get("logprobs_mode"), "enforce_eager": model.get("enforce_eager"),
        "quantization": model.get("quantization"), "kv_cache_dtype": cache.get("cache_dtype"),
        "enable_prefix_caching": cache.get("enable_prefix_caching"),
        "enable_chunked_prefill": sched.get("enable_chunked_prefill"),
        # a processor registered at start-up (--logits-processors) and its engine-wide settings (--additional-config):
        # tim-plugins' min-p processor cuts every request at additional_config["tim_min_p"]
        "logits_processors": model.get("logits_processors"), "additional_config": info.get("additional_config"),
    }
    device = str((info.get("device_config") or {}).get("device") or "cuda")
    return {k: v for k, v in args.items() if v is not None}, device
