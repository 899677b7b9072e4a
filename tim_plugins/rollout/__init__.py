"""Rollout-side samplers: the processed-log-prob recorder, the exact sampler, the TIM injector (HF ``generate``
with the recorder patches transformers' internals: ``tim_plugins.integrations.hf``)."""
