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
    "sampling_processors",
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
    "allowed_token_ids": None, "min_tokens": 0, "structured_outputs": None, "thinking_token_budget": None,
}
# vLLM's single-dash aliases of the engine arguments the reader knows (vllm.engine.arg_utils EngineArgs.add_cli_args);
# -O is its own case (``parse_engine_args``).
_SHORT_FLAGS = {"q": "quantization", "cc": "compilation_config", "ac": "attention_config",
                "tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size",
                "sc": "speculative_config"}
# CompilationConfig.mode by name (vLLM's CompilationMode: an IntEnum, 0 = not compiled) and, per optimization level,
# the cudagraph_mode vLLM fills in when none is given (vllm/config/vllm.py OPTIMIZATION_LEVEL_00.._03).
_COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")
_VLLM_COMPILE = 3
_CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
_CUDAGRAPH_BY_LEVEL = {0: "NONE", 1: "PIECEWISE", 2: "FULL_AND_PIECEWISE", 3: "FULL_AND_PIECEWISE"}
# CUDAGraphMode.without_piecewise: what vLLM falls back to when the model is not compiled piecewise.
_WITHOUT_PIECEWISE = {"PIECEWISE": "NONE", "FULL_AND_PIECEWISE": "FULL_DECODE_ONLY"}
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_engine_args(args: Any) -> dict:
    """Engine args from a dict, a JSON object string, or a vLLM CLI string ("--dtype bfloat16 --enforce-eager").

    Keys are returned with underscores. ``--no-<flag>`` sets the flag False; a flag without a value is True;
    values are parsed as JSON when they look like JSON, else kept as strings. As vLLM's parser does: ``-O<n>`` /
    ``-O <n>`` is ``--optimization-level <n>``, ``-cc`` / ``-q`` / ... are the long flags' aliases, and a dotted flag
    (``-cc.mode=0``, ``--compilation-config.cudagraph_mode NONE``) sets one key of that dict argument.
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
        if tok.startswith("-O") and tok != "-O" or tok == "-O" and i + 1 < len(tokens):
            # vLLM's FlexibleArgumentParser turns -O3, -O=3 and -O 3 into --optimization-level 3
            level = tok[3:] if tok[2:3] == "=" else tok[2:]
            if tok == "-O":
                level = tokens[i + 1]
                i += 1
            out["optimization_level"] = _optimization_level(level, tok)
            i += 1
            continue
        if _is_flag(tok) and not tok.startswith("--"):
            name, eq, value = tok[1:].partition("=")
            head, dot, rest = name.partition(".")
            if head not in _SHORT_FLAGS:
                raise ValueError(f"vLLM engine args: unexpected token {tok!r} in {text!r}; expected --name [value] "
                                 f"(short flags read: -O<level>, {', '.join('-' + k for k in _SHORT_FLAGS)})")
            tok = f"--{_SHORT_FLAGS[head]}{dot}{rest}{eq}{value}"
        if not tok.startswith("--"):
            if tok in ("vllm", "serve") or (i <= 2 and not out):  # `vllm serve MODEL ...`
                if tok not in ("vllm", "serve"):
                    out["model"] = tok
                i += 1
                continue
            raise ValueError(f"vLLM engine args: unexpected token {tok!r} in {text!r}; expected --name [value]")
        name, eq, value = tok[2:].partition("=")
        head, dot, rest = name.partition(".")
        key = head.replace("-", "_")
        has_value = i + 1 < len(tokens) and not _is_flag(tokens[i + 1])
        if dot:
            # a dotted flag sets one key of a dict argument; vLLM parses its value as JSON, else keeps the string
            if not eq:
                if not has_value:
                    raise ValueError(f"vLLM engine args: {tok!r} in {text!r} needs a value")
                value = tokens[i + 1]
                i += 1
            _set_nested(out, key, rest.split("."), _json_or_string(value), tok)
            i += 1
            continue
        if not eq:
            if has_value:
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
        # _parse_value reads "0" / "1" as booleans; a level is a number (--optimization-level 0)
        out[key] = _optimization_level(value, tok) if key == "optimization_level" else _parse_value(value)
        i += 1
    return out


def _is_flag(tok: str) -> bool:
    """A flag, not a value: it starts with '-' and is not a number (``--seed -1``)."""
    if not tok.startswith("-"):
        return False
    try:
        float(tok)
    except ValueError:
        return True
    return False


def _json_or_string(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _set_nested(out: dict, key: str, keys: list, value: Any, tok: str) -> None:
    node = out.get(key)
    if isinstance(node, str):
        node = _json_or_string(node)
    if node is None:
        node = {}
    if not isinstance(node, dict):
        raise ValueError(f"vLLM engine args: {tok!r} sets a key of --{key.replace('_', '-')}, which is {node!r}")
    node = dict(node)
    out[key] = node
    for part in keys[:-1]:
        child = node.get(part)
        node[part] = dict(child) if isinstance(child, dict) else {}
        node = node[part]
    node[keys[-1]] = value


def _optimization_level(value: Any, where: Any = None) -> int:
    """vLLM's OptimizationLevel (0-3) from an int or its digits."""
    level = value
    if isinstance(value, str) and value.strip().isdigit():
        level = int(value)
    if isinstance(level, bool) or not isinstance(level, int) or level not in _CUDAGRAPH_BY_LEVEL:
        raise ValueError(f"vLLM engine args: optimization_level={value!r}"
                         f"{'' if where is None else f' (from {where!r})'}: must be 0, 1, 2 or 3")
    return level


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


def _sampling_values(sampling: Any) -> dict:
    values = dict(VLLM_SAMPLING_DEFAULTS)
    if sampling is not None:
        if isinstance(sampling, Mapping):
            values.update(sampling)
        else:
            values.update({k: getattr(sampling, k) for k in VLLM_SAMPLING_DEFAULTS if hasattr(sampling, k)})
    return values


def sampling_fields(sampling: Any) -> dict:
    """PipelineSpec sampler fields from a `SamplingParams`, a dict of its fields, or None (vLLM defaults)."""
    values = _sampling_values(sampling)
    return {
        "temperature": values["temperature"], "top_p": values["top_p"], "top_k": values["top_k"],
        "min_p": 0.0 if values["min_p"] is None else values["min_p"],
        "repetition_penalty": values["repetition_penalty"], "presence_penalty": values["presence_penalty"],
        "frequency_penalty": values["frequency_penalty"],
        "logit_bias": bool(values["logit_bias"]) or bool(values["allowed_token_ids"]),
        "bad_words": bool(values["bad_words"]),
    }


def sampling_processors(sampling: Any) -> tuple:
    """The request's processing that no `PipelineSpec` field holds, as the rollout's ``custom_logits_processors``
    (the audit's sampler-penalties-unmatched: no trainer recomputes them): ``min_tokens=<n>`` (vLLM's built-in
    MinTokensLogitsProcessor masks the stop tokens until n tokens are out; it is not argmax invariant, so it runs
    before the processed log-probs are taken: VLLM_SOURCES vllm.v1.sample.sampler:Sampler.apply_logits_processors),
    ``structured_outputs`` (the grammar masks the logits; the label TRL's reader uses too) and
    ``thinking_token_budget=<n>`` (forces the end-of-thinking tokens once the budget is spent; -1 is vLLM's
    "unlimited", as None). Values are those of VLLM_SOURCES vllm.sampling_params:SamplingParams."""
    values = _sampling_values(sampling)
    out = []
    min_tokens = values["min_tokens"]
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"SamplingParams min_tokens={min_tokens!r}: must be an integer >= 0")
    if min_tokens > 0:
        out.append(f"min_tokens={min_tokens}")
    if values["structured_outputs"]:  # None (vLLM's default) or an empty dict: no constraint
        out.append("structured_outputs")
    budget = values["thinking_token_budget"]
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < -1:
            raise ValueError(f"SamplingParams thinking_token_budget={budget!r}: must be an integer >= 0, or -1 / "
                             "None for unlimited")
        if budget != -1:
            out.append(f"thinking_token_budget={budget}")
    return tuple(out)


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


def _graphs_and_compile(a: Mapping, device: str, env: Mapping[str, str]) -> tuple[bool, bool]:
    """(CUDA graphs captured, torch.compile on) as vLLM 0.31 resolves them from the engine args
    (VLLM_SOURCES vllm.config:VllmConfig, its __post_init__): enforce_eager turns both off; TORCH_COMPILE_DISABLE=1
    and VLLM_USE_BREAKABLE_CUDAGRAPH=1 set mode NONE; an unset compilation_config.mode is VLLM_COMPILE above
    optimization level 0, NONE at -O0; an unset cudagraph_mode is the level's (NONE at -O0, PIECEWISE at -O1,
    FULL_AND_PIECEWISE above); a piecewise cudagraph_mode without VLLM_COMPILE falls back without its piecewise part
    (PIECEWISE -> NONE); graphs are captured on GPUs only (VLLM_SOURCES vllm.config:CompilationConfig)."""
    if a.get("enforce_eager"):
        return False, False
    cc = a.get("compilation_config") or {}
    if isinstance(cc, str):
        cc = json.loads(cc)
    if not isinstance(cc, Mapping):
        raise ValueError(f"vLLM engine args: compilation_config={cc!r} must be a dict (or its JSON)")
    level = _optimization_level(2 if a.get("optimization_level") is None else a["optimization_level"])
    mode = _compilation_mode(cc.get("mode"))
    # breakable CUDA graphs run uncompiled but keep their graphs; vLLM also turns them on by itself for some
    # architectures (and GPUs under VLLM_BATCH_INVARIANT), which engine args do not tell: the live reader sees that
    breakable = env.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") == "1"
    if breakable or env.get("TORCH_COMPILE_DISABLE") == "1":
        mode = 0
    if mode is None:
        mode = _VLLM_COMPILE if level > 0 else 0
    graphs = cc.get("cudagraph_mode")
    graphs = _CUDAGRAPH_BY_LEVEL[level] if graphs is None else _cudagraph_mode(graphs)
    if mode != _VLLM_COMPILE and not breakable:
        graphs = _WITHOUT_PIECEWISE.get(graphs, graphs)
    return device == "cuda" and graphs != "NONE", mode != 0


def _compilation_mode(value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, str):
        name = value.strip().upper().rsplit(".", 1)[-1]  # "none", "CompilationMode.NONE"
        if name.isdigit():
            value = int(name)
        elif name in _COMPILATION_MODES:
            return _COMPILATION_MODES.index(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(_COMPILATION_MODES):
        raise ValueError(f"vLLM engine args: compilation_config mode={value!r}: must be 0-3 or one of "
                         f"{_COMPILATION_MODES}")
    return value


def _cudagraph_mode(value: Any) -> str:
    name = str(value).strip().upper().rsplit(".", 1)[-1]  # "none", "CUDAGraphMode.NONE"
    if name not in _CUDAGRAPH_MODES:
        raise ValueError(f"vLLM engine args: compilation_config cudagraph_mode={value!r}: must be one of "
                         f"{_CUDAGRAPH_MODES}")
    return name


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
    cudagraph, compiled = _graphs_and_compile(a, device, env)
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
    processing = sampling_processors(sampling)
    if processing:
        notes["custom_logits_processors"] = (f"SamplingParams {', '.join(processing)}: vLLM processes the logits "
                                             "the trainer scores unprocessed")
    quant = a.get("quantization")
    return PipelineSpec(
        side="rollout", framework=framework, device=device, dtype=dtype, lm_head_dtype=head,
        logprobs_mode=a["logprobs_mode"], **sampler, custom_logits_processors=processing,
        weight_quantization="none" if quant in (None, "", "none") else str(quant),
        kv_cache_dtype=a.get("kv_cache_dtype") or "auto",
        prefix_caching=bool(a["enable_prefix_caching"]), chunked_prefill=bool(a["enable_chunked_prefill"]),
        cudagraph=cudagraph, compile=compiled, batch_invariant=env.get("VLLM_BATCH_INVARIANT", "0") == "1",
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
