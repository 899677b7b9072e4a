"""Rollout-side samplers: HF generation with processed log-probs, the exact sampler, the TIM injector."""
