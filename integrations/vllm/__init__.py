"""vLLM adapter: tim-plugins' logits processors, loaded by vLLM from their "<module>:<class>" names.

- ``tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor``: the safe-vocabulary (min-p) rule on every
  sampled request (``tim_plugins.rollout.vllm_min_p_config.vllm_engine_kwargs(min_p)`` builds the engine
  arguments);
- ``tim_plugins.integrations.vllm.inject:TailNoiseLogitsProcessor``: the TIM injector, per request.

Importing this package imports vLLM.
"""

from .inject import TailNoiseLogitsProcessor
from .min_p import TIMMinPLogitsProcessor

__all__ = ["TIMMinPLogitsProcessor", "TailNoiseLogitsProcessor"]
