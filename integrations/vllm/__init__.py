"""vLLM adapter: all of tim-plugins' code that imports vLLM.

- ``tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor``: the safe-vocabulary (min-p) rule on every
  sampled request (``tim_plugins.rollout.vllm_min_p_config.vllm_engine_kwargs(min_p)`` builds the engine
  arguments), loaded by vLLM from its "<module>:<class>" name;
- ``tim_plugins.integrations.vllm.inject:TailNoiseLogitsProcessor``: the TIM injector, per request;
- ``.sampling``: ``SamplingParams`` for a core ``Truncation``, and the logprobs-mode check that pruning needs;
- ``.rollout``: an in-process engine and its rollouts as the core's ``RolloutBatch`` (``tim-plugins measure``);
- ``.parity_spec``: ``spec_from_llm``, a live engine's `PipelineSpec` (its resolved configuration and what its
  workers run; imports nothing of vLLM, so the TRL adapter reads its colocated engine with it).

Importing this package warns once when the installed vLLM is outside the tested range
(``tim_plugins._optional.SUPPORTED_RANGES``) and imports no vLLM module itself: each module above imports what it
needs, so a vLLM internal that moved (``.sources.VLLM_SOURCES``, checked per feature by ``.features`` and
``tim-plugins doctor``) disables only the module that needs it. What reads no vLLM object (engine arguments →
``PipelineSpec``: ``tim_plugins.parity.vllm_spec``; the min-p processor's settings) lives in the core, which the verl
adapter and the offline audit use without vLLM. An engine adapter: the trainer adapters (TRL, verl) may import it, it
imports no other adapter (``tests/test_layering.py``).
"""

from tim_plugins._optional import note_version

note_version("vllm")

__all__ = ["TIMMinPLogitsProcessor", "TailNoiseLogitsProcessor"]


def __getattr__(name: str):
    if name == "TIMMinPLogitsProcessor":
        from .min_p import TIMMinPLogitsProcessor

        return TIMMinPLogitsProcessor
    if name == "TailNoiseLogitsProcessor":
        from .inject import TailNoiseLogitsProcessor

        return TailNoiseLogitsProcessor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
