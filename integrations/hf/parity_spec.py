"""Trainer or rollout `PipelineSpec` from a live transformers model (dtype, lm_head dtype, attention kernel).

In the HF adapter, not the core (``tim_plugins.parity.spec`` keeps the framework-neutral `PipelineSpec`), because
the attention kernel is only readable from a private attribute of transformers' config
(``.sources.TRANSFORMERS_SOURCES``). Imports nothing of transformers: it reads the model's attributes.
"""

from __future__ import annotations

from typing import Any, Optional

from tim_plugins.parity.spec import PipelineSpec

__all__ = ["spec_from_hf_model"]


def spec_from_hf_model(
    model: Any,
    *,
    side: str = "trainer",
    temperature: Optional[float] = 1.0,
    top_p: Optional[float] = 1.0,
    top_k: Optional[int] = 0,
    min_p: Optional[float] = 0.0,
    framework: str = "hf",
    **overrides: Any,
) -> PipelineSpec:
    """Read dtype, lm_head dtype and attention implementation from a live transformers model.

    The sampler arguments say what this side applies to its logits (defaults: temperature 1, no truncation,
    no penalties, as a plain trainer forward). The trainer runs eager, without KV/prefix caches, and is not
    batch invariant unless told otherwise through ``overrides``.
    """
    params = list(model.parameters())
    dtype = str(params[0].dtype) if params else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_dtype = str(head.weight.dtype) if head is not None and getattr(head, "weight", None) is not None else None
    config = getattr(model, "config", None)
    # TRANSFORMERS_SOURCES transformers.configuration_utils:PreTrainedConfig._attn_implementation
    attn = getattr(config, "_attn_implementation", None) if config is not None else None
    device = params[0].device.type if params else None
    quant = getattr(config, "quantization_config", None) if config is not None else None
    values = dict(
        side=side, framework=framework, device=device, dtype=dtype, lm_head_dtype=head_dtype,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=False, bad_words=False,
        custom_logits_processors=(), weight_quantization="none" if quant is None else _quant_name(quant),
        kv_cache_dtype="auto", prefix_caching=False, chunked_prefill=False, cudagraph=False, compile=False,
        batch_invariant=False, attention_backend=attn, source=f"{type(model).__name__} (live)",
    )
    values.update(overrides)
    return PipelineSpec(**values)


def _quant_name(quant: Any) -> str:
    if isinstance(quant, dict):
        return str(quant.get("quant_method", "quantized"))
    return str(getattr(quant, "quant_method", "quantized"))
