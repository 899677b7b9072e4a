"""vLLM adapter: all of tim-plugins' code that imports vLLM.

- ``tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor``: the safe-vocabulary (min-p) rule on every
  sampled request (``tim_plugins.rollout.vllm_min_p_config.vllm_engine_kwargs(min_p)`` builds the engine
  arguments), loaded by vLLM from its "<module>:<class>" name;
- ``tim_plugins.integrations.vllm.inject:TailNoiseLogitsProcessor``: the TIM injector, per request;
- ``.sampling``: ``SamplingParams`` for a core ``Truncation``, and the logprobs-mode check that pruning needs;
- ``.rollout``: an in-process engine and its rollouts as the core's ``RolloutBatch`` (``tim-plugins measure``).

Importing this package imports vLLM, and fails with the fix when the installed vLLM is outside the tested range
(``tim_plugins._optional.SUPPORTED_RANGES``; the vLLM internals relied on are listed in ``.sources.VLLM_SOURCES``).
The vLLM readers the other adapters share (engine arguments or a live engine → ``PipelineSpec``:
``tim_plugins.parity.vllm_spec``; the min-p processor's settings) import nothing of vLLM and live in the core.
"""

from tim_plugins._optional import check_version_range

check_version_range("vllm")

from .inject import TailNoiseLogitsProcessor  # noqa: E402
from .min_p import TIMMinPLogitsProcessor  # noqa: E402

__all__ = ["TIMMinPLogitsProcessor", "TailNoiseLogitsProcessor"]
