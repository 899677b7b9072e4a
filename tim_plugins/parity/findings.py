"""Parity findings: the stable codes, why each matters, and the knobs that fix it (one registry).

The README's parity section and the CLI table are rendered from `CODES`; tests check the README lists them.
Knob strings are exact. The registry holds the knobs in the core's own vocabulary (vLLM engine and sampling
arguments, transformers loading arguments, tim-plugins commands); a trainer framework's knobs (TRL `GRPOConfig`
fields, verl Hydra overrides) are its adapter's data (``tim_plugins.fixes``), merged into ``CodeInfo.fix``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tim_plugins.fixes import framework_fixes

__all__ = [
    "Finding", "CodeInfo", "CODES", "SEVERITIES", "FRAMEWORK_NAMES", "ParityError", "make_finding", "fix_for",
    "framework_name", "codes_markdown", "max_severity", "severity_counts",
]

SEVERITIES = ("error", "warning", "info")


class ParityError(RuntimeError):
    """Raised by strict `enforce()` and by a `ParityProbe` with action 'raise'; carries what tripped."""

    def __init__(self, message: str, findings: Optional[list] = None, trip: Any = None):
        super().__init__(message)
        self.findings = list(findings or [])
        self.trip = trip


@dataclass(frozen=True)
class CodeInfo:
    code: str
    title: str
    why: str
    knobs: dict = field(default_factory=dict)  # the core's vocabulary (vllm, hf, tim_plugins) -> knob(s)

    @property
    def fix(self) -> dict:
        """{vocabulary or framework: knob}: the core's knobs, then each installed adapter's (``tim_plugins.fixes``)."""
        merged = dict(self.knobs)
        for key, fixes in framework_fixes().items():
            if self.code in fixes.finding_fixes:
                merged[key] = fixes.finding_fixes[self.code]
        return merged


@dataclass
class Finding:
    """One parity problem: a stable `code`, a `severity`, both sides' values and the knobs that fix it."""

    code: str
    severity: str
    message: str
    rollout_value: Any = None
    trainer_value: Any = None
    fix: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}; known codes: {sorted(CODES)}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding.severity={self.severity!r}: must be one of {SEVERITIES}")

    def to_dict(self) -> dict:
        return {
            "code": self.code, "severity": self.severity, "message": self.message,
            "rollout": _jsonable(self.rollout_value), "trainer": _jsonable(self.trainer_value), "fix": dict(self.fix),
        }


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


_C = CodeInfo
CODES: dict[str, CodeInfo] = {c.code: c for c in (
    _C("dtype-mismatch", "rollout and trainer run different weight dtypes",
       "bf16 vs fp32 moves every logit by ~1e-2 relative; measured max |Δlog p| 0.26 on a tiny Qwen2 (vLLM bf16 "
       "vs HF fp32) against 4.6e-5 when both run fp32. The largest source of TIM in most stacks.",
       {"vllm": "LLM(dtype=<trainer dtype>) / --dtype"}),
    _C("lm-head-precision-mismatch", "the lm_head (logits) runs in different precision on the two sides",
       "The logits' rounding enters every token's log-prob directly; matching precision matters more than fp32 "
       "on one side only (TRL cast_lm_head_to_fp32 changes the trainer but nothing passes it to vLLM).",
       {"vllm": "LLM(hf_overrides={'head_dtype': 'float32'}) (or 'model' to follow dtype)"}),
    _C("logprobs-mode-not-processed", "rollout log-probs are not those of the distribution sampled from",
       "vLLM's default raw_logprobs are taken before temperature, penalties and top-k/top-p: the ratio is then "
       "off by the processing itself (measured 0.63 max |Δ| at T=0.7, top-p 0.9), and *_logits modes are not "
       "log-probs at all.",
       {"vllm": "LLM(logprobs_mode='processed_logprobs') / --logprobs-mode processed_logprobs"}),
    _C("sampler-truncation-unmatched", "rollout truncates (top-p/top-k/min-p) but the trainer does not",
       "Processed rollout log-probs are renormalised over the kept set, the trainer's over the full vocabulary: "
       "every token's ratio is biased by the kept mass, and tokens the trainer would prune get -inf on one side "
       "(TRL #6789, verl #6240).",
       {"vllm": "SamplingParams(top_p=1.0, top_k=0, min_p=0.0), or keep the truncation and apply it in the "
                "trainer too (tim_plugins.safe_vocab)"}),
    _C("temperature-mismatch", "the trainer divides logits by a different temperature than the sampler",
       "A temperature gap shifts every log-prob systematically (TRL #4159: ratio ~2 at T != 1).",
       {"vllm": "SamplingParams(temperature=T) equal to the trainer's T"}),
    _C("sampler-penalties-unmatched", "penalties / logit bias / bad words / custom processors on the rollout only",
       "Repetition, presence and frequency penalties, logit bias and allowed tokens, bad-words masks, minimum "
       "lengths, structured outputs, thinking budgets and custom logits processors change the sampled distribution "
       "in ways the trainer never recomputes.",
       {"vllm": "SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, "
                "logit_bias=None, allowed_token_ids=None, bad_words=None, min_tokens=0, structured_outputs=None, "
                "thinking_token_budget=None), no logits_processors"}),
    _C("quantized-rollout", "the rollout runs quantized weights or a quantized KV cache",
       "fp8/int8 weights or KV cache change every logit (INT8 rollouts reach max token |Δp| = 1.0 on "
       "Qwen2.5-32B); the trainer computes in full precision.",
       {"vllm": "LLM(quantization=None, kv_cache_dtype='auto')"}),
    _C("prefix-caching-on", "rollout reuses cached KV for shared prefixes",
       "Cached prefix KV was computed in another batch/chunk shape than a fresh prefill, and a cache not reset "
       "after a weight sync serves stale keys/values from the previous policy (the weight-sync check reads a "
       "colocated engine's cache after each sync: sync-prefix-cache).",
       {"vllm": "LLM(enable_prefix_caching=False) (or reset_prefix_cache() after every weight sync)"}),
    _C("chunked-prefill-on", "rollout splits long prefills into chunks",
       "A chunked prefill reduces attention in another order than the trainer's single pass over the sequence.",
       {"vllm": "LLM(enable_chunked_prefill=False)"}),
    _C("cudagraph-on", "rollout runs CUDA graphs / torch.compile while the trainer runs eager",
       "Graphs pad decode batches to capture sizes and compiled graphs fuse ops (e.g. fused_add_rms_norm on the "
       "fp32 sum): kernel choice and rounding then differ from the trainer's eager forward.",
       {"vllm": "LLM(enforce_eager=True) / --enforce-eager, or LLM(optimization_level=0) / -O0, or "
                "LLM(compilation_config={'mode': 0, 'cudagraph_mode': 'NONE'}) / -cc.mode=0 -cc.cudagraph_mode=NONE "
                "(cudagraph_mode='NONE' alone still compiles)"}),
    _C("batch-invariance-off", "log-probs depend on the batch they are computed in",
       "Batch-size-dependent reductions (GEMM split-K, attention splits) make the same sequence score "
       "differently in another batch: bitwise parity (k3 == 0) is impossible; expect a ~1e-5..1e-3 k3 floor.",
       {"vllm": "VLLM_BATCH_INVARIANT=1 (GPUs with CC >= 8.0, FLASH_ATTN/TRITON_ATTN/FLEX_ATTENTION backends)",
        "tim_plugins": "tim-plugins measure --rollout exact (exact sampler) for a TIM-free baseline; "
                       "tim-plugins check-batch-invariance --model PATH to measure the trainer side"}),
    _C("attention-backend-mismatch", "rollout and trainer use different attention kernels",
       "Different attention algorithms (paged flash vs sdpa vs eager) accumulate in different orders.",
       {"vllm": "LLM(attention_config={'backend': 'FLASH_ATTN'}) / vllm serve --attention-backend FLASH_ATTN",
        "hf": "from_pretrained(..., attn_implementation='flash_attention_2')"}),
    _C("unknown-setting", "a setting could not be read on one side: its check was skipped",
       "The audit never guesses: an unknown value cannot be compared. Pass the value explicitly or read the "
       "spec from a live engine.",
       {"tim_plugins": "tim-plugins audit: --model PATH (the checkpoint dtype behind dtype=auto), the engine "
                       "argument in --vllm-args (e.g. --attention-backend FLASH_ATTN), the trainer's in --trainer-* "
                       "flags; Python: fill the field in PipelineSpec (or read it from the live engine: "
                       "spec_from_llm)"}),
)}


# The core's vocabularies, as a reader names them (a trainer framework's name is its adapter's ``NAME``).
FRAMEWORK_NAMES = {"vllm": "vLLM", "hf": "transformers", "tim_plugins": "tim-plugins"}
# What a vocabulary runs on: when a code has no knob of its own, the knobs of these apply to it.
_RUNS_ON = {"vllm": ("tim_plugins",), "hf": ("tim_plugins",)}


def framework_name(key: str) -> str:
    """How a reader names the key of a fix: the core's vocabularies, an adapter's ``NAME``, else the key."""
    fixes = framework_fixes().get(key)
    return fixes.name if fixes else FRAMEWORK_NAMES.get(key, key)


def fix_for(fix: dict, framework: Optional[str] = None) -> str:
    """The knob of ``fix`` (a finding's ``{framework: knob}``) for a run in ``framework``: its own knob when the
    registry lists one; else the knobs of what it runs on (a trainer framework's adapter says: TRL and verl run on
    vLLM, transformers, tim-plugins), each named; else every knob, each named."""
    if framework in fix:
        return fix[framework]
    adapter = framework_fixes().get(framework or "")
    runs_on = adapter.runs_on if adapter else _RUNS_ON.get(framework or "", ())
    keys = [k for k in runs_on if k in fix] or list(fix)
    return "; ".join(_named(k, fix[k]) for k in keys)


def _named(key: str, knob: str) -> str:
    """``name: knob``; a tim-plugins knob that is a tim-plugins command reads as itself ("tim-plugins measure ...",
    not "tim-plugins: tim-plugins measure ...")."""
    name = framework_name(key)
    return knob if key == "tim_plugins" and knob.startswith(name + " ") else f"{name}: {knob}"


def make_finding(code: str, severity: str, message: str, rollout_value: Any = None,
                 trainer_value: Any = None, fix: Optional[dict] = None) -> Finding:
    """A Finding with the registry's knobs (or the given ones)."""
    return Finding(code=code, severity=severity, message=message, rollout_value=rollout_value,
                   trainer_value=trainer_value, fix=dict(CODES[code].fix if fix is None else fix))


def severity_counts(findings: list) -> dict[str, int]:
    """{severity: number of findings}, every severity present (0 when none)."""
    return {level: sum(f.severity == level for f in findings) for level in SEVERITIES}


def max_severity(findings: list) -> Optional[str]:
    for level in SEVERITIES:
        if any(f.severity == level for f in findings):
            return level
    return None


def codes_markdown() -> str:
    """Markdown documentation of every code (rendered into the README's parity section)."""
    lines = []
    for info in CODES.values():
        lines.append(f"- **`{info.code}`**: {info.title}. {info.why}")
        for framework, knob in info.fix.items():
            lines.append(f"  - {framework}: `{knob}`" if "`" not in knob else f"  - {framework}: {knob}")
    return "\n".join(lines)
