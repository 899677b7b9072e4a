"""Deprecated alias of ``tim_plugins.integrations.vllm.inject`` (the vLLM adapter), removed in the next release."""

from tim_plugins.rollout._moved import moved_to

__all__ = ["TailNoiseLogitsProcessor", "EXTRA_ARGS_KEY"]

__getattr__ = moved_to(__name__, "tim_plugins.integrations.vllm.inject", tuple(__all__))
