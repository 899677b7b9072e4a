"""Moved (#38): HF ``generate`` rollouts with processed log-probs patch transformers' internals to record them, so
they live in the HF adapter, ``tim_plugins.integrations.hf.rollout.generate_with_logprobs``. This module stays,
empty, so that the old import path fails with a message that names the new one."""

from __future__ import annotations

from tim_plugins._moved import moved_attribute

__all__: list[str] = []

_MOVED = {"generate_with_logprobs": "tim_plugins.integrations.hf.rollout"}


def __getattr__(name: str):
    moved_attribute(__name__, name, _MOVED)
