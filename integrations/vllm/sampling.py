"""vLLM ``SamplingParams`` for a core `Truncation` (min-p, top-k, top-p), and the check that the engine's log-probs
can be compared with the trainer's safe-vocabulary log-probs (imports vLLM at import time).

vLLM truncates in the order min-p → top-k → top-p (VLLM_SOURCES vllm.v1.sample.sampler:Sampler.sample and
VLLM_SOURCES vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p_pytorch): the Truncation must say
``order="vllm"`` so the trainer (``tim_plugins.truncation``, ``tim_plugins.safe_vocab``) truncates the same way.
"""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams

from tim_plugins.truncation import Truncation

__all__ = ["PRUNING_LOGPROBS_MODES", "validate_vllm_pruning", "vllm_sampling_kwargs", "make_vllm_sampling_params",
           "check_vllm_engine"]

# vLLM's only logprobs mode whose values are renormalised over the kept set (raw_* are taken before truncation).
PRUNING_LOGPROBS_MODES = ("processed_logprobs",)


def validate_vllm_pruning(trunc: Truncation, logprobs_mode: str) -> None:
    """Refuse truncation or a temperature with log-probs that were not taken after them (renormalised over the kept
    set, at the temperature).

    Raises:
        ValueError: quoting the mode, the rule and the fix.
    """
    if trunc.order != "vllm":
        raise ValueError(
            f"order={trunc.order!r}: vLLM applies min_p, then top_k, then top_p; build the Truncation with "
            "order='vllm' so the trainer truncates in the same order"
        )
    # processed log-probs are taken after the temperature and the truncation, raw_* before both (VLLM_SOURCES
    # vllm.v1.sample.sampler:Sampler.sample): T != 1 alone makes raw_* another distribution than the one sampled
    # (the parity audit's logprobs-mode-not-processed)
    if (trunc.active or trunc.temperature != 1.0) and logprobs_mode not in PRUNING_LOGPROBS_MODES:
        raise ValueError(
            f"logprobs_mode={logprobs_mode!r} with temperature={trunc.temperature}, min_p={trunc.min_p}, "
            f"top_p={trunc.top_p}, top_k={trunc.top_k}: vLLM reports raw_* log-probs before the temperature and the "
            "truncation, so they are not the distribution that was sampled and cannot match the trainer's safe "
            "log-probs. Fix: start the engine with LLM(..., logprobs_mode='processed_logprobs') (server: "
            "--logprobs-mode processed_logprobs)"
        )


def vllm_sampling_kwargs(trunc: Truncation, **extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` implementing ``trunc`` (``extra`` is passed through)."""
    overlap = {"temperature", "min_p", "top_p", "top_k"} & set(extra)
    if overlap:
        raise ValueError(
            f"{sorted(overlap)} given twice: they come from the Truncation; set them there, not in extra kwargs"
        )
    # top_k=0 is off: VLLM_SOURCES vllm.sampling_params:SamplingParams
    kwargs = {"temperature": float(trunc.temperature), "min_p": float(trunc.min_p), "top_p": float(trunc.top_p),
              "top_k": int(trunc.k)}
    kwargs.update(extra)
    return kwargs


def make_vllm_sampling_params(trunc: Truncation, *, logprobs_mode: str, **extra: Any) -> SamplingParams:
    """``vllm.SamplingParams`` for ``trunc``, after checking that the engine's ``logprobs_mode`` allows pruning.

    ``extra`` goes to SamplingParams (e.g. ``max_tokens``, ``seed``, ``logprobs=0``).
    """
    validate_vllm_pruning(trunc, logprobs_mode)
    return SamplingParams(**vllm_sampling_kwargs(trunc, **extra))


def check_vllm_engine(llm, trunc: Truncation) -> str:
    """Read a live ``vllm.LLM``'s logprobs mode and validate ``trunc`` against it; returns the mode."""
    # VLLM_SOURCES vllm.entrypoints.llm:LLM.__init__ (llm_engine) and vllm.config:ModelConfig (logprobs_mode)
    mode = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "logprobs_mode", None)
    if mode is None:
        raise ValueError(
            f"cannot read logprobs_mode from {type(llm).__name__}: pass the engine's mode to "
            "validate_vllm_pruning(trunc, logprobs_mode) instead"
        )
    mode = getattr(mode, "value", mode)
    validate_vllm_pruning(trunc, str(mode))
    return str(mode)
