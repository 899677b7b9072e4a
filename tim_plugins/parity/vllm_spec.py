"""Rollout `PipelineSpec` from vLLM engine arguments (dict, JSON or CLI string) and sampling parameters.

Plain data in, plain data out: it reads no vLLM object and imports nothing of vLLM, so it lives in the core and
works offline (``tim-plugins audit --vllm-args``, the TRL and verl adapters' readers of the engine arguments they
pass). The reader of a live `LLM` reads vLLM's internals (its resolved configuration and its workers), so it lives in
the vLLM adapter: ``tim_plugins.integrations.vllm.parity_spec.spec_from_llm``. Defaults below are vLLM 0.31's
(VLLM_SOURCES vllm.engine.arg_utils:EngineArgs and VLLM_SOURCES vllm.sampling_params:SamplingParams).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any, Mapping, Optional

from tim_plugins.parity.spec import PipelineSpec, normalize_dtype

__all__ = [
    "VLLM_ENGINE_DEFAULTS",
    "VLLM_SAMPLING_DEFAULTS",
    "checkpoint_dtype_from_path",
    "parse_engine_args",
    "spec_from_engine_args",
    "apply_engine_args",
    "resolve_auto_dtype",
    "sampling_fields",
    "with_processor_min_p",
]

# Engine defaults that matter for parity (vLLM 0.31). Prefix caching and chunked prefill are on by default
# (EngineArgs leaves them None and the engine resolves them on for generative models).
VLLM_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "auto", "logprobs_mode": "raw_logprobs", "enable_prefix_caching": True,
    "enable_chunked_prefill": True, "enforce_eager": False, "quantization": None, "kv_cache_dtype": "auto",
    "hf_overrides": None, "attention_backend": None, "compilation_config": None, "logits_processors": None,
}
VLLM_SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "bad_words": None,
    "allowed_token_ids": None,
}
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_engine_args(args: Any) -> dict:
    """Engine args from a dict, a JSON object string, or a vLLM CLI string ("--dtype bfloat16 --enforce-eager").

    Keys are returned with underscores. ``--no-<flag>`` sets the flag False; a flag without a value is True;
    values are parsed as JSON when they look like JSON, else kept as strings.
    """
    if args is None:
        return {}
    if isinstance(args, Mapping):
        return {str(k).replace("-", "_"): v for k, v in args.items()}
    text = str(args).strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"vLLM engine args {text[:80]!r}... look like JSON but do not parse: {err}") from err
        return parse_engine_args(data)
    out: dict[str, Any] = {}
    tokens = shlex.split(text)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            if tok in ("vllm", "serve") or (i <= 2 and not out):  # `vllm serve MODEL ...`
                if tok not in ("vllm", "serve"):
                    out["model"] = tok
                i += 1
                continue
            raise ValueError(f"vLLM engine args: unexpected token {tok!r} in {text!r}; expected --name [value]")
        name, eq, value = tok[2:].partition("=")
        key = name.replace("-", "_")
        if not eq:
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value = tokens[i + 1]
                i += 1
            elif key.startswith("no_"):
                out[key[3:]] = False
                i += 1
                continue
            else:
                out[key] = True
                i += 1
                continue
        out[key] = _parse_value(value)
        i += 1
    return out


def _parse_value(value: str) -> Any:
    low = value.lower()
    if low in _BOOL_WORDS:
        return _BOOL_WORDS[low]
    if low in ("none", "null"):
        return None
    if value[:1] in "{[" or value.replace(".", "", 1).replace("-", "", 1).isdigit():
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def resolve_auto_dtype(checkpoint_dtype: Any) -> Optional[str]:
    """What vLLM's dtype='auto' runs on GPUs: fp32 checkpoints are downcast to bf16, others kept
    (VLLM_SOURCES vllm.config.model:_resolve_auto_dtype)."""
    ckpt = normalize_dtype(checkpoint_dtype)
    if ckpt is None:
        return None
    return "bfloat16" if ckpt == "float32" else ckpt


def checkpoint_dtype_from_path(model: Any) -> Optional[str]:
    """The dtype a checkpoint folder's config.json names (``dtype``, or the older ``torch_dtype``), else None."""
    if not model:
        return None
    cfg = Path(str(model)) / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text())
    return data.get("dtype") or data.get("torch_dtype")


def sampling_fields(sampling: Any) -> dict:
    """PipelineSpec sampler fields from a `SamplingParams`, a dict of its fields, or None (vLLM defaults)."""
    values = dict(VLLM_SAMPLING_DEFAULTS)
    if sampling is not None:
        if isinstance(sampling, Mapping):
            values.update(sampling)
        else:
            values.update({k: getattr(sampling, k) for k in VLLM_SAMPLING_DEFAULTS if hasattr(sampling, k)})
    return {
        "temperature": values["temperature"], "top_p": values["top_p"], "top_k": values["top_k"],
        "min_p": 0.0 if values["min_p"] is None else values["min_p"],
        "repetition_penalty": values["repetition_penalty"], "presence_penalty": values["presence_penalty"],
        "frequency_penalty": values["frequency_penalty"],
        "logit_bias": bool(values["logit_bias"]) or bool(values["allowed_token_ids"]),
        "bad_words": bool(values["bad_words"]),
    }


def with_processor_min_p(fields: dict, logits_processors: Any, additional_config: Any, notes: dict) -> dict:
    """``fields`` (``sampling_fields``) with tim-plugins' min-p processor folded in: registered with an engine-wide
    ``additional_config["tim_min_p"]``, it cuts every request there, and the larger of it and the request's min_p
    wins (``tim_plugins.integrations.vllm.min_p``). Notes it in ``notes`` (edited in place)."""
    from tim_plugins.rollout.vllm_min_p_config import CONFIG_KEY, PROCESSOR_FQCN, processor_min_p

    cut = processor_min_p(logits_processors, additional_config)
    if cut <= 0:
        return fields
    notes["logits_processors"] = (f"{PROCESSOR_FQCN} with additional_config[{CONFIG_KEY!r}]={cut:g}: every request "
                                  f"is cut at min_p {max(cut, fields['min_p']):g} (the larger of it and the "
                                  f"request's min_p={fields['min_p']:g})")
    return dict(fields, min_p=max(cut, fields["min_p"]))


def _cudagraph_off(compilation_config: Any) -> Optional[bool]:
    if compilation_config is None:
        return None
    if isinstance(compilation_config, str):
        compilation_config = json.loads(compilation_config)
    mode = compilation_config.get("cudagraph_mode") if isinstance(compilation_config, Mapping) else None
    return None if mode is None else str(mode).upper() == "NONE"


def spec_from_engine_args(
    args: Any,
    *,
    sampling: Any = None,
    checkpoint_dtype: Any = None,
    device: str = "cuda",
    env: Optional[Mapping[str, str]] = None,
    framework: str = "vllm",
) -> PipelineSpec:
    """Rollout spec from vLLM engine args (dict / JSON / CLI string) and sampling params.

    Args:
        args: engine args; unspecified ones take vLLM 0.31 defaults (`VLLM_ENGINE_DEFAULTS`).
        sampling: `SamplingParams` or dict of its fields (default: vLLM defaults).
        checkpoint_dtype: the checkpoint's dtype, to resolve dtype='auto' (else read from <model>/config.json).
        device: "cuda" or "cpu" (CUDA graphs exist only on GPUs; the CPU backend always uses CPU_ATTN).
        env: environment the engine will see (default os.environ), for VLLM_BATCH_INVARIANT.
    """
    given = parse_engine_args(args)
    a = dict(VLLM_ENGINE_DEFAULTS)
    a.update(given)
    env = os.environ if env is None else env
    notes: dict[str, str] = {}
    if str(a["dtype"]).lower() == "auto":
        ckpt = checkpoint_dtype if checkpoint_dtype is not None else checkpoint_dtype_from_path(a.get("model"))
        dtype = resolve_auto_dtype(ckpt)
        notes["dtype"] = (f"dtype=auto with a {ckpt} checkpoint → {dtype}" if dtype else
                          "dtype=auto and the checkpoint dtype is unknown (fp32/bf16 checkpoints run bf16)")
    else:
        dtype = normalize_dtype(a["dtype"])
    hf_overrides = a.get("hf_overrides") or {}
    if isinstance(hf_overrides, str):
        hf_overrides = json.loads(hf_overrides)
    head = hf_overrides.get("head_dtype")  # VLLM_SOURCES vllm.config.model:_get_head_dtype
    head = None if head in (None, "model") else head
    eager = bool(a["enforce_eager"])
    graph_off = _cudagraph_off(a.get("compilation_config"))
    attn_cfg = a.get("attention_config") or {}
    if isinstance(attn_cfg, str):
        attn_cfg = json.loads(attn_cfg)
    attention = a.get("attention_backend") or attn_cfg.get("backend")
    if attention is None and device == "cpu":
        attention = "CPU_ATTN"
    procs = a.get("logits_processors") or ()
    if procs:
        notes["logits_processors"] = f"registered (active per request only if activated): {list(procs)}"
    sampler = with_processor_min_p(sampling_fields(sampling), procs, a.get("additional_config"), notes)
    quant = a.get("quantization")
    return PipelineSpec(
        side="rollout", framework=framework, device=device, dtype=dtype, lm_head_dtype=head,
        logprobs_mode=a["logprobs_mode"], **sampler, custom_logits_processors=(),
        weight_quantization="none" if quant in (None, "", "none") else str(quant),
        kv_cache_dtype=a.get("kv_cache_dtype") or "auto",
        prefix_caching=bool(a["enable_prefix_caching"]), chunked_prefill=bool(a["enable_chunked_prefill"]),
        cudagraph=False if (eager or device != "cuda" or graph_off) else True,
        compile=not eager, batch_invariant=env.get("VLLM_BATCH_INVARIANT", "0") == "1",
        attention_backend=attention, source="vLLM engine args", notes=notes,
    )


def apply_engine_args(args: Any, patch: Mapping[str, Any]) -> dict:
    """Merge an `EnforceResult.vllm_engine_args` patch into engine args (hf_overrides merged key by key)."""
    out = parse_engine_args(args)
    for key, value in patch.items():
        if key == "hf_overrides" and isinstance(out.get(key), Mapping):
            merged = dict(out[key])
            merged.update(value)
            out[key] = merged
        else:
            out[key] = value
    return out
