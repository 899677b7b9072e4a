"""Deprecated alias of ``tim_plugins.integrations.vllm.min_p`` (the vLLM adapter), removed in the next release.

``"tim_plugins.rollout.vllm_min_p:TIMMinPLogitsProcessor"`` still loads in vLLM's ``logits_processors``: it is
the adapter's class itself.
"""

from tim_plugins.rollout._moved import moved_to

__all__ = ["TIMMinPLogitsProcessor"]

__getattr__ = moved_to(__name__, "tim_plugins.integrations.vllm.min_p", tuple(__all__))
