"""Normalised descriptions of the two sides of an RL pipeline: the rollout engine and the trainer.

A `PipelineSpec` says what one side does to produce a token's log-prob: weight dtype, lm_head precision,
which distribution the log-prob is taken from, sampler processing, kernels and caches. Readers in
`vllm_spec.py` (vLLM engine args), the adapters' ``parity_spec`` modules (`integrations/hf`: a live transformers
model; `integrations/vllm`: a live engine; `integrations/trl`: GRPOConfig + model; `integrations/verl`: composed
Hydra config) fill it in; `audit()` compares two of them.

Every field is Optional: ``None`` means *unknown*, and the audit skips a check whose inputs are unknown
(it reports them under the ``unknown-setting`` code instead of guessing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from tim_plugins._config import field_help

__all__ = [
    "PipelineSpec",
    "normalize_dtype",
    "normalize_attention_backend",
    "attention_family",
    "normalize_top_k",
    "LOGPROBS_MODES",
    "SIDES",
]

SIDES = ("rollout", "trainer")
# vLLM's names (vllm/config/model.py LogprobsMode); the trainer side is always "processed" by construction
# (it recomputes log-probs of the distribution it differentiates), so the field is rollout-only.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")

_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32", "f32": "float32", "torch.float32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16", "torch.float16": "float16",
    "float64": "float64", "fp64": "float64", "double": "float64", "torch.float64": "float64",
}


def normalize_dtype(value: Any) -> Optional[str]:
    """'bf16' / torch.bfloat16 / 'bfloat16' → 'bfloat16'; None or 'auto' → None (unknown until resolved)."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("", "auto", "none", "null"):
        return None
    if text not in _DTYPE_ALIASES:
        raise ValueError(
            f"unknown dtype {value!r}: expected one of float32/fp32, bfloat16/bf16, float16/fp16/half, or auto"
        )
    return _DTYPE_ALIASES[text]


# Attention kernels grouped into families: two sides in the same family run the same algorithm (still not
# bitwise equal across engines); different families reduce in a different order.
_ATTENTION_FAMILIES = {
    "flash": ("flash_attn", "flash_attention_2", "flash_attention_3", "flash_attention_4", "fa2", "fa3",
              "flash_attn_mla", "vllm_flash_attn", "kernels-community/flash-attn", "kernels-community/vllm-flash-attn3"),
    "flex": ("flex_attention",),
    "triton": ("triton_attn", "triton_mla"),
    "flashinfer": ("flashinfer", "flashinfer_mla"),
    "sdpa": ("sdpa", "torch_sdpa"),
    "eager": ("eager",),
    "cpu": ("cpu_attn",),
}


def normalize_attention_backend(value: Any) -> Optional[str]:
    """Lower-case the backend name ('FLASH_ATTN' → 'flash_attn'); None/'auto' → None."""
    if value is None:
        return None
    text = str(value).strip().lower()
    return None if text in ("", "auto", "none", "null") else text


def attention_family(value: Any) -> Optional[str]:
    name = normalize_attention_backend(value)
    if name is None:
        return None
    for family, names in _ATTENTION_FAMILIES.items():
        if name in names:
            return family
    return name


def normalize_top_k(value: Any) -> Optional[int]:
    """vLLM uses 0 or -1 for 'off' depending on the release, HF None/0: all map to 0 (off)."""
    if value is None:
        return None
    k = int(value)
    return 0 if k <= 0 else k


@dataclass
class PipelineSpec:
    """What one side (rollout engine or trainer) does to turn weights into a token's log-prob.

    ``None`` = unknown. Sampler fields on the trainer side describe what the trainer *applies when it
    recomputes log-probs* (e.g. TRL and verl divide by the temperature but apply no top-p/top-k: top_p=1.0,
    top_k=0, min_p=0.0).
    """

    side: str = field(default="rollout", metadata=field_help("'rollout' or 'trainer'"))
    framework: Optional[str] = field(default=None, metadata=field_help("vllm, hf, trl, verl-fsdp, ... (display)"))
    device: Optional[str] = field(default=None, metadata=field_help("cpu / cuda; some findings only apply on GPUs"))
    dtype: Optional[str] = field(default=None, metadata=field_help("weight/compute dtype: float32|bfloat16|float16"))
    lm_head_dtype: Optional[str] = field(
        default=None, metadata=field_help("lm_head (logits) precision; None = same as dtype when dtype is known")
    )
    autocast: Optional[str] = field(
        default=None, metadata=field_help("the dtype an autocast region runs the matmuls in over `dtype` weights "
                                          "(TRL's bf16=True over fp32 weights); None = none")
    )
    logprobs_mode: Optional[str] = field(
        default=None, metadata=field_help("rollout only: vLLM logprobs_mode (raw_logprobs|processed_logprobs|...)")
    )
    temperature: Optional[float] = field(default=None, metadata=field_help("logits are divided by this"))
    top_p: Optional[float] = field(default=None, metadata=field_help("nucleus truncation; 1.0 = off"))
    top_k: Optional[int] = field(default=None, metadata=field_help("top-k truncation; 0 = off (-1 normalised to 0)"))
    min_p: Optional[float] = field(default=None, metadata=field_help("min-p truncation; 0.0 = off"))
    repetition_penalty: Optional[float] = field(default=None, metadata=field_help("1.0 = off"))
    presence_penalty: Optional[float] = field(default=None, metadata=field_help("0.0 = off"))
    frequency_penalty: Optional[float] = field(default=None, metadata=field_help("0.0 = off"))
    logit_bias: Optional[bool] = field(default=None, metadata=field_help("a logit bias / allowed-token list is set"))
    bad_words: Optional[bool] = field(default=None, metadata=field_help("bad-words masking is set"))
    custom_logits_processors: Optional[tuple] = field(
        default=None, metadata=field_help("names of custom logits processors active on this side (() = none)")
    )
    weight_quantization: Optional[str] = field(
        default=None, metadata=field_help("'none' or the scheme (fp8, int8, awq, gptq, bitsandbytes, ...)")
    )
    kv_cache_dtype: Optional[str] = field(default=None, metadata=field_help("'auto' (= dtype) or fp8, fp8_e4m3, ..."))
    prefix_caching: Optional[bool] = field(default=None, metadata=field_help("KV of shared prefixes reused"))
    chunked_prefill: Optional[bool] = field(default=None, metadata=field_help("long prefills split into chunks"))
    cudagraph: Optional[bool] = field(default=None, metadata=field_help("CUDA graphs captured (padded batch sizes)"))
    compile: Optional[bool] = field(default=None, metadata=field_help("torch.compile / fused custom ops in use"))
    batch_invariant: Optional[bool] = field(
        default=None, metadata=field_help("log-probs independent of batch composition (VLLM_BATCH_INVARIANT, ...)")
    )
    attention_backend: Optional[str] = field(default=None, metadata=field_help("FLASH_ATTN, sdpa, CPU_ATTN, ..."))
    source: str = field(default="", metadata=field_help("where the values were read (display only)"))
    notes: dict = field(default_factory=dict, metadata=field_help("free-form provenance per field (display only)"))

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ValueError(f"PipelineSpec.side={self.side!r}: must be one of {SIDES}")
        self.dtype = normalize_dtype(self.dtype)
        self.lm_head_dtype = normalize_dtype(self.lm_head_dtype)
        self.autocast = normalize_dtype(self.autocast)
        if self.autocast is not None and self.autocast == self.dtype:  # autocast to the weights' own dtype: none
            self.autocast = None
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"PipelineSpec.logprobs_mode={self.logprobs_mode!r}: must be one of {LOGPROBS_MODES} or None"
            )
        self.top_k = normalize_top_k(self.top_k)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, float(value))
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"PipelineSpec.temperature={self.temperature}: must be >= 0")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"PipelineSpec.top_p={self.top_p}: must be in (0, 1]")
        # the engines' own range (a described sampler; a min-p of ours is tim_plugins.options.MIN_P_RULE's)
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"PipelineSpec.min_p={self.min_p}: must be in [0, 1]")
        if self.custom_logits_processors is not None:
            self.custom_logits_processors = tuple(str(x) for x in self.custom_logits_processors)
        if self.weight_quantization is not None:
            self.weight_quantization = str(self.weight_quantization).lower()
            if self.weight_quantization in ("", "null"):
                self.weight_quantization = "none"
        if self.kv_cache_dtype is not None:
            self.kv_cache_dtype = str(self.kv_cache_dtype).lower()
        self.attention_backend = normalize_attention_backend(self.attention_backend)

    @property
    def effective_lm_head_dtype(self) -> Optional[str]:
        return self.lm_head_dtype if self.lm_head_dtype is not None else self.dtype

    def replace(self, **changes: Any) -> "PipelineSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PipelineSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown PipelineSpec fields {unknown}; known: {sorted(names)}")
        return cls(**data)
