"""Settings of the vLLM min-p logits processor (``tim_plugins.integrations.vllm.min_p``); importable without vLLM.

They live in the core because two adapters read them: the vLLM processor, and the verl adapter, which builds and
checks the engine arguments verl forwards to vLLM (adapters never import each other).

Why a processor at all: frameworks that build ``vllm.SamplingParams`` themselves may not pass ``min_p`` (verl
0.9.1 sets only temperature/top_p/top_k, ``vllm_async_server.py`` ~L634). The processor applies the safe-vocabulary
rule to every request from an engine-level setting, and engine settings do reach vLLM: verl forwards
``actor_rollout_ref.rollout.engine_kwargs.vllm.*`` verbatim as ``vllm serve`` arguments.

Where the processor reads min_p (first match wins):
1. per request: ``SamplingParams(extra_args={"tim_min_p": x})`` (0 switches it off for that request);
2. per engine: ``additional_config={"tim_min_p": x}`` (``--additional-config '{"tim_min_p": x}'``);
3. the environment variable ``TIM_PLUGINS_MIN_P`` of the engine process;
4. otherwise 0 (off).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from tim_plugins.options import MIN_P_RULE, min_p_accepted  # the trainer side's rule, both adapters'

__all__ = [
    "PROCESSOR_FQCN", "CONFIG_KEY", "ENV_VAR", "check_min_p", "engine_min_p", "processor_min_p", "vllm_engine_kwargs",
]

# vLLM loads processors by "<module>:<class>" (``LLM(logits_processors=[...])``, ``--logits-processors``).
PROCESSOR_FQCN = "tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor"
# Key in vLLM's ``additional_config`` and in ``SamplingParams.extra_args``.
CONFIG_KEY = "tim_min_p"
ENV_VAR = "TIM_PLUGINS_MIN_P"


def check_min_p(value: Any, where: str) -> float:
    """``value`` as a float in [0, 1); raises ValueError quoting ``where``, the value, the rule and the fix."""
    try:  # a number, or its text (an environment variable, a command-line value)
        ok = not isinstance(value, bool) and min_p_accepted(float(value))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{where}={value!r}: min_p {MIN_P_RULE}. Fix: e.g. {CONFIG_KEY}=1e-4")
    return float(value)


def engine_min_p(additional_config: Mapping | None, env: Mapping[str, str] | None = None) -> float:
    """The engine-wide min_p: ``additional_config["tim_min_p"]``, else ``$TIM_PLUGINS_MIN_P``, else 0."""
    env = os.environ if env is None else env
    if additional_config and CONFIG_KEY in additional_config:
        return check_min_p(additional_config[CONFIG_KEY], f"additional_config[{CONFIG_KEY!r}]")
    if env.get(ENV_VAR, "").strip():
        return check_min_p(env[ENV_VAR].strip(), ENV_VAR)
    return 0.0


def processor_min_p(logits_processors: Any, additional_config: Any) -> float:
    """The min_p every request of an engine is cut at by this processor, read from its engine arguments (a server's
    /server_info, a CLI string's parse): ``additional_config["tim_min_p"]`` when ``logits_processors`` registers the
    processor, else 0 (the environment variable of another process cannot be read; a bad value counts as 0: the
    engine itself refuses it at start-up)."""
    if isinstance(logits_processors, str):
        logits_processors = [logits_processors]
    if PROCESSOR_FQCN not in {str(p) for p in (logits_processors or ())}:
        return 0.0
    if isinstance(additional_config, str):
        import json

        try:
            additional_config = json.loads(additional_config)
        except ValueError:
            return 0.0
    if not isinstance(additional_config, Mapping) or CONFIG_KEY not in additional_config:
        return 0.0
    try:
        return check_min_p(additional_config[CONFIG_KEY], CONFIG_KEY)
    except ValueError:
        return 0.0


def vllm_engine_kwargs(min_p: float) -> dict[str, Any]:
    """Engine arguments (``LLM(**kw)`` / ``AsyncEngineArgs``) that make every sampled request use ``min_p``."""
    return {"logits_processors": [PROCESSOR_FQCN],
            "additional_config": {CONFIG_KEY: check_min_p(min_p, "min_p")}}
