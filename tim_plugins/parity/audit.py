"""Static parity audit of two `PipelineSpec`s, and `enforce()`: apply the fixes that can be applied before
the engines start.

`audit(rollout, trainer)` compares what is known and never guesses: a check whose inputs are unknown is
skipped and reported once under ``unknown-setting``. `enforce(...)` returns new specs, the list of changes,
and the concrete patches (vLLM engine kwargs, vLLM sampling params, trainer settings) an adapter applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tim_plugins.parity.findings import CODES, Finding, ParityError, make_finding
from tim_plugins.parity.spec import PipelineSpec, attention_family

__all__ = [
    "audit",
    "enforce",
    "Change",
    "EnforceResult",
    "DEFAULT_FIXES",
    "FIXABLE",
    "has_errors",
    "rollout_processing_active",
    "GREEDY_T",
]

# vLLM treats temperatures below this as greedy and does not divide the logits (vllm/v1/sample/sampler.py).
GREEDY_T = 1e-5
_FLOAT_TOL = 1e-6

# Fixes applied by default: they change numerics, never the sampling distribution or memory footprint.
DEFAULT_FIXES = frozenset({
    "dtype-mismatch", "lm-head-precision-mismatch", "logprobs-mode-not-processed", "temperature-mismatch",
    "prefix-caching-on", "chunked-prefill-on", "cudagraph-on",
})
# Opt-in fixes (they change what is sampled or how much memory the engine needs) and how.
FIXABLE = DEFAULT_FIXES | {"sampler-truncation-unmatched", "sampler-penalties-unmatched", "quantized-rollout"}
_TRUNCATION_SIDES = ("rollout", "trainer")


def _effective_temperature(t: Optional[float]) -> Optional[float]:
    # Greedy rows are not divided by the temperature: their log-probs are those of T = 1.
    if t is None:
        return None
    return 1.0 if t < GREEDY_T else t


def _greedy(spec: PipelineSpec) -> bool:
    return spec.temperature is not None and spec.temperature < GREEDY_T


def _truncation(spec: PipelineSpec) -> dict:
    """{top_p, top_k, min_p} as the sampler applies them: a greedy rollout (temperature below vLLM's greedy threshold:
    vLLM's greedy requests, transformers' do_sample=False) cuts nothing, whatever its fields say (vLLM resets them,
    transformers applies its truncation warpers only when sampling); its log-probs are the full softmax at T=1."""
    if spec.side == "rollout" and _greedy(spec):
        return {"top_p": 1.0, "top_k": 0, "min_p": 0.0}
    return {"top_p": spec.top_p, "top_k": spec.top_k, "min_p": spec.min_p}


def _processing_checks(spec: PipelineSpec) -> dict[str, Optional[bool]]:
    """{field: whether it makes the sampler change the distribution (None: unknown)} of a rollout spec. A greedy
    rollout's truncation fields do not count: it cuts nothing."""
    cut = _truncation(spec)
    return {
        "temperature": None if spec.temperature is None
        else abs(_effective_temperature(spec.temperature) - 1.0) > _FLOAT_TOL,
        "top_p": None if cut["top_p"] is None else cut["top_p"] < 1.0,
        "top_k": None if cut["top_k"] is None else cut["top_k"] > 0,
        "min_p": None if cut["min_p"] is None else cut["min_p"] > 0.0,
        "repetition_penalty": None if spec.repetition_penalty is None
        else abs(spec.repetition_penalty - 1.0) > _FLOAT_TOL,
        "presence_penalty": None if spec.presence_penalty is None else spec.presence_penalty != 0.0,
        "frequency_penalty": None if spec.frequency_penalty is None else spec.frequency_penalty != 0.0,
        "logit_bias": spec.logit_bias, "bad_words": spec.bad_words,
        "custom_logits_processors": None if spec.custom_logits_processors is None
        else len(spec.custom_logits_processors) > 0,
    }


def rollout_processing_active(spec: PipelineSpec) -> Optional[bool]:
    """True when the sampler changes the distribution (temperature, truncation, penalties); None if unknown
    (``_processing_checks``)."""
    checks = _processing_checks(spec).values()
    if any(c is True for c in checks):
        return True
    return None if any(c is None for c in checks) else False


def _computes_in(spec: PipelineSpec) -> str:
    """What ``spec`` computes in, as the dtype finding says it: its dtype, or the autocast over it."""
    return spec.dtype if spec.autocast is None else f"{spec.autocast} autocast over {spec.dtype} weights"


def audit(rollout: PipelineSpec, trainer: PipelineSpec) -> list[Finding]:
    """Compare a rollout spec with a trainer spec; return findings sorted error → warning → info."""
    if rollout.side != "rollout" or trainer.side != "trainer":
        raise ValueError(
            f"audit(rollout, trainer) got sides ({rollout.side!r}, {trainer.side!r}); pass the rollout spec first "
            "and the trainer spec second, with side='rollout' / side='trainer'"
        )
    out: list[Finding] = []
    unknown: list[str] = []

    def known(name: str, *values: Any) -> bool:
        if any(v is None for v in values):
            unknown.append(name)
            return False
        return True

    # 1 dtype: the weights' dtype and the autocast over them (fp32 weights under bf16 autocast are neither a bf16
    # nor an fp32 model: embeddings, norms and the residual stream stay fp32, the matmuls run in bf16)
    if known("dtype", rollout.dtype, trainer.dtype) and \
            (rollout.dtype, rollout.autocast) != (trainer.dtype, trainer.autocast):
        r_dtype, t_dtype = _computes_in(rollout), _computes_in(trainer)
        out.append(make_finding("dtype-mismatch", "error", f"rollout computes in {r_dtype}, the trainer in {t_dtype}",
                                r_dtype, t_dtype))
    # 2 lm_head precision (reported separately: it can differ even when the body dtypes agree)
    r_head, t_head = rollout.effective_lm_head_dtype, trainer.effective_lm_head_dtype
    if known("lm_head_dtype", r_head, t_head) and r_head != t_head:
        out.append(make_finding("lm-head-precision-mismatch", "warning",
                                f"lm_head runs in {r_head} on the rollout side and {t_head} in the trainer",
                                r_head, t_head))
    # 3 logprobs mode (rollout only)
    processing = rollout_processing_active(rollout)
    if known("logprobs_mode", rollout.logprobs_mode):
        mode = rollout.logprobs_mode
        if mode.endswith("_logits"):
            out.append(make_finding("logprobs-mode-not-processed", "error",
                                    f"logprobs_mode={mode!r} returns logits, not log-probs", mode, "processed"))
        elif mode == "raw_logprobs":
            # Unknown processing stays an error: raw log-probs are only right when nothing processes the logits,
            # which the audit cannot tell here (it never guesses), and processed_logprobs is right either way.
            severity = "error" if processing is not False else "warning"
            if processing:
                why = "the sampler processes the logits (temperature/truncation/penalties)"
            elif processing is None:
                names = [n for n, c in _processing_checks(rollout).items() if c is None]
                why = (f"whether the sampler processes the logits is unknown ({', '.join(names)} not known); they "
                       "equal the processed log-probs only if it does not")
            else:
                why = "equal to processed today only because no sampler processing is active"
            out.append(make_finding("logprobs-mode-not-processed", severity,
                                    f"raw_logprobs are taken before sampler processing: {why}", mode, "processed"))
    # 4 truncation (a greedy rollout cuts nothing; its temperature is check 5's)
    r_cut, t_cut = _truncation(rollout), _truncation(trainer)
    diffs = {}
    for name in ("top_p", "top_k", "min_p"):
        r, t = r_cut[name], t_cut[name]
        if known(name, r, t) and (abs(r - t) > _FLOAT_TOL if isinstance(r, float) else r != t):
            diffs[name] = (r, t)
    if diffs:
        desc = ", ".join(f"{k} rollout={r} trainer={t}" for k, (r, t) in diffs.items())
        greedy = " (greedy rollout: it cuts nothing)" if _greedy(rollout) else ""
        out.append(make_finding("sampler-truncation-unmatched", "error",
                                f"sampler truncation differs between the sides: {desc}{greedy}",
                                {k: v[0] for k, v in diffs.items()}, {k: v[1] for k, v in diffs.items()}))
    # 5 temperature
    r_t, t_t = _effective_temperature(rollout.temperature), trainer.temperature
    if known("temperature", r_t, t_t) and abs(r_t - t_t) > _FLOAT_TOL * max(1.0, abs(t_t)):
        what = (f"rollout decodes greedily (T={rollout.temperature}: its log-probs are those of T=1)"
                if _greedy(rollout) else f"rollout samples at T={rollout.temperature}")
        out.append(make_finding("temperature-mismatch", "error", f"{what}, the trainer divides by T={t_t}",
                                rollout.temperature, t_t))
    # 6 penalties, logit bias, bad words, custom processors
    pen = {}
    for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        r, t = getattr(rollout, name), getattr(trainer, name)
        if known(name, r, t) and abs(r - t) > _FLOAT_TOL:
            pen[name] = (r, t)
    for name in ("logit_bias", "bad_words"):
        r, t = getattr(rollout, name), getattr(trainer, name)
        if known(name, r, t) and bool(r) != bool(t):
            pen[name] = (r, t)
    r_c, t_c = rollout.custom_logits_processors, trainer.custom_logits_processors
    if known("custom_logits_processors", r_c, t_c) and tuple(r_c) != tuple(t_c):
        pen["custom_logits_processors"] = (r_c, t_c)
    if pen:
        desc = ", ".join(f"{k} rollout={r} trainer={t}" for k, (r, t) in pen.items())
        out.append(make_finding("sampler-penalties-unmatched", "error",
                                f"sampler processing the trainer does not recompute: {desc}",
                                {k: v[0] for k, v in pen.items()}, {k: v[1] for k, v in pen.items()}))
    # 7 quantization
    quant = {}
    if known("weight_quantization", rollout.weight_quantization, trainer.weight_quantization) and \
            rollout.weight_quantization != "none" and rollout.weight_quantization != trainer.weight_quantization:
        quant["weights"] = (rollout.weight_quantization, trainer.weight_quantization)
    if known("kv_cache_dtype", rollout.kv_cache_dtype) and rollout.kv_cache_dtype not in ("auto", rollout.dtype):
        quant["kv_cache"] = (rollout.kv_cache_dtype, trainer.dtype)
    if quant:
        desc = ", ".join(f"{k} {r} (trainer {t})" for k, (r, t) in quant.items())
        out.append(make_finding("quantized-rollout", "error", f"quantized rollout: {desc}",
                                {k: v[0] for k, v in quant.items()}, {k: v[1] for k, v in quant.items()}))
    # 8-10 caches and graphs
    if known("prefix_caching", rollout.prefix_caching) and rollout.prefix_caching:
        out.append(make_finding("prefix-caching-on", "warning",
                                "prefix caching reuses KV computed in other batches (and stale after weight sync "
                                "unless reset)", True, trainer.prefix_caching))
    if known("chunked_prefill", rollout.chunked_prefill) and rollout.chunked_prefill:
        out.append(make_finding("chunked-prefill-on", "warning", "long prompts are prefilled in chunks",
                                True, trainer.chunked_prefill))
    graph_only = rollout.cudagraph is True and trainer.cudagraph is not True
    compile_only = rollout.compile is True and trainer.compile is not True
    if known("cudagraph", rollout.cudagraph) and known("compile", rollout.compile) or graph_only or compile_only:
        if graph_only or compile_only:
            what = " and ".join(n for n, v in (("CUDA graphs", graph_only), ("torch.compile", compile_only)) if v)
            out.append(make_finding("cudagraph-on", "warning", f"rollout runs {what}; the trainer does not",
                                    {"cudagraph": rollout.cudagraph, "compile": rollout.compile},
                                    {"cudagraph": trainer.cudagraph, "compile": trainer.compile}))
    # 11 batch invariance
    if known("batch_invariant", rollout.batch_invariant, trainer.batch_invariant):
        if not (rollout.batch_invariant and trainer.batch_invariant):
            half = rollout.batch_invariant or trainer.batch_invariant
            out.append(make_finding(
                "batch-invariance-off", "warning" if half else "info",
                ("only one side is batch invariant: bitwise parity still impossible" if half else
                 "neither side is batch invariant: a small k3 floor remains even with every other knob matched"),
                rollout.batch_invariant, trainer.batch_invariant))
    # 12 attention
    if known("attention_backend", rollout.attention_backend, trainer.attention_backend):
        fr, ft = attention_family(rollout.attention_backend), attention_family(trainer.attention_backend)
        if fr != ft:
            out.append(make_finding("attention-backend-mismatch", "warning",
                                    f"attention kernels differ: {rollout.attention_backend} vs "
                                    f"{trainer.attention_backend}", rollout.attention_backend,
                                    trainer.attention_backend))
    if unknown:
        names = sorted(set(unknown))
        out.append(make_finding("unknown-setting", "info", "not compared (unknown on one side): " + ", ".join(names),
                                [n for n in names if _is_unknown(rollout, n)],
                                [n for n in names if _is_unknown(trainer, n)]))
    order = {"error": 0, "warning": 1, "info": 2}
    codes = list(CODES)
    return sorted(out, key=lambda f: (order[f.severity], codes.index(f.code)))


def _is_unknown(spec: PipelineSpec, name: str) -> bool:
    if name == "lm_head_dtype":
        return spec.effective_lm_head_dtype is None
    return getattr(spec, name, None) is None


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)


@dataclass
class Change:
    """One setting `enforce()` changed: which side, which spec field, old → new, and the knob it maps to."""

    side: str
    field: str
    old: Any
    new: Any
    knob: str


@dataclass
class EnforceResult:
    """What `enforce()` did; `findings` is the audit after the changes. The three patches are the caller's to apply
    where it builds the engine (`vllm_spec.apply_engine_args`, docs/parity.md): no adapter applies them, since TRL
    and verl build their engines themselves."""

    rollout: PipelineSpec
    trainer: PipelineSpec
    changes: list = field(default_factory=list)
    findings: list = field(default_factory=list)
    vllm_engine_args: dict = field(default_factory=dict)  # merge into LLM(**kwargs) / engine args
    vllm_sampling_params: dict = field(default_factory=dict)  # merge into SamplingParams(**kwargs)
    trainer_settings: dict = field(default_factory=dict)  # trainer-side spec fields to apply (temperature, ...)

    @property
    def errors(self) -> list:
        return [f for f in self.findings if f.severity == "error"]


def enforce(
    rollout: PipelineSpec,
    trainer: PipelineSpec,
    *,
    fix: Optional[set] = None,
    truncation_side: str = "rollout",
    strict: bool = False,
) -> EnforceResult:
    """Apply the fixes that can be applied before the engines start; return the changes and the patches.

    Args:
        rollout, trainer: the two sides' specs (not modified; new specs are returned).
        fix: finding codes to fix; default `DEFAULT_FIXES` (numerics only: dtype → trainer dtype, lm_head
            precision → trainer's, processed log-probs, trainer temperature → rollout temperature, prefix caching
            / chunked prefill off, eager execution). Opt in to "sampler-truncation-unmatched" (see
            `truncation_side`), "sampler-penalties-unmatched" (penalties off on the rollout) and
            "quantized-rollout" (full-precision rollout): these change what is sampled or the memory needed.
        truncation_side: "rollout" turns rollout truncation off; "trainer" makes the trainer apply the rollout's
            top-p/top-k/min-p (only if the trainer adapter supports it). A greedy rollout cuts nothing whatever its
            settings: the trainer's truncation is turned off instead, either way.
        strict: raise `ParityError` if error-level findings remain after the fixes.
    """
    fix = set(DEFAULT_FIXES if fix is None else fix)
    unknown_codes = fix - FIXABLE
    if unknown_codes:
        raise ValueError(f"enforce(fix=...) got codes it cannot fix: {sorted(unknown_codes)}; fixable: {sorted(FIXABLE)}")
    if truncation_side not in _TRUNCATION_SIDES:
        raise ValueError(f"enforce(truncation_side={truncation_side!r}): must be one of {_TRUNCATION_SIDES}")
    before = {f.code for f in audit(rollout, trainer)}
    r_new: dict[str, Any] = {}
    t_new: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    changes: list[Change] = []

    def change(side: str, name: str, new: Any, knob: str) -> None:
        spec = rollout if side == "rollout" else trainer
        changes.append(Change(side, name, getattr(spec, name), new, knob))
        (r_new if side == "rollout" else t_new)[name] = new

    # an engine cannot autocast: against an autocast trainer the finding stays after the engine's dtype moves
    if "dtype-mismatch" in fix and "dtype-mismatch" in before and rollout.dtype != trainer.dtype:
        change("rollout", "dtype", trainer.dtype, f"vllm dtype={trainer.dtype!r}")
        engine["dtype"] = trainer.dtype
    if "lm-head-precision-mismatch" in fix:
        # Judged after the dtype fix: a head that follows the dtype may already match.
        head = trainer.effective_lm_head_dtype
        r_head = rollout.lm_head_dtype or r_new.get("dtype", rollout.dtype)
        if head is not None and r_head is not None and r_head != head:
            change("rollout", "lm_head_dtype", head, f"vllm hf_overrides={{'head_dtype': {head!r}}}")
            engine["hf_overrides"] = {"head_dtype": head}
    if "logprobs-mode-not-processed" in fix and "logprobs-mode-not-processed" in before:
        change("rollout", "logprobs_mode", "processed_logprobs", "vllm logprobs_mode='processed_logprobs'")
        engine["logprobs_mode"] = "processed_logprobs"
    if "temperature-mismatch" in fix and "temperature-mismatch" in before:
        target = _effective_temperature(rollout.temperature)
        change("trainer", "temperature", target, f"trainer temperature={target}")
    if "prefix-caching-on" in fix and "prefix-caching-on" in before:
        change("rollout", "prefix_caching", False, "vllm enable_prefix_caching=False")
        engine["enable_prefix_caching"] = False
    if "chunked-prefill-on" in fix and "chunked-prefill-on" in before:
        change("rollout", "chunked_prefill", False, "vllm enable_chunked_prefill=False")
        engine["enable_chunked_prefill"] = False
    if "cudagraph-on" in fix and "cudagraph-on" in before:
        # enforce_eager turns off both torch.compile and CUDA graphs (vllm/config/vllm.py).
        if rollout.cudagraph:
            change("rollout", "cudagraph", False, "vllm enforce_eager=True")
        if rollout.compile:
            change("rollout", "compile", False, "vllm enforce_eager=True")
        engine["enforce_eager"] = True
    if "sampler-truncation-unmatched" in fix and "sampler-truncation-unmatched" in before:
        r_cut = _truncation(rollout)
        for name in ("top_p", "top_k", "min_p"):
            r, t = r_cut[name], getattr(trainer, name)
            if r is None or t is None or r == t:
                continue
            # a greedy rollout cuts nothing whatever its settings: only the trainer can match it
            if truncation_side == "rollout" and not _greedy(rollout):
                change("rollout", name, getattr(trainer, name), f"vllm SamplingParams({name}={t})")
                sampling[name] = t
            else:
                change("trainer", name, r, f"trainer {name}={r}")
    if "sampler-penalties-unmatched" in fix and "sampler-penalties-unmatched" in before:
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            r, t = getattr(rollout, name), getattr(trainer, name)
            if r is not None and t is not None and abs(r - t) > _FLOAT_TOL:
                change("rollout", name, t, f"vllm SamplingParams({name}={t})")
                sampling[name] = t
        for name in ("logit_bias", "bad_words"):
            if getattr(rollout, name) and not getattr(trainer, name):
                change("rollout", name, False, f"vllm SamplingParams({name}=None)")
                sampling[name] = None
    if "quantized-rollout" in fix and "quantized-rollout" in before:
        if rollout.weight_quantization not in (None, "none") and rollout.weight_quantization != trainer.weight_quantization:
            change("rollout", "weight_quantization", "none", "vllm quantization=None")
            engine["quantization"] = None
        if rollout.kv_cache_dtype not in (None, "auto", rollout.dtype):
            change("rollout", "kv_cache_dtype", "auto", "vllm kv_cache_dtype='auto'")
            engine["kv_cache_dtype"] = "auto"

    new_rollout = rollout.replace(**r_new) if r_new else rollout.replace()
    new_trainer = trainer.replace(**t_new) if t_new else trainer.replace()
    findings = audit(new_rollout, new_trainer)
    result = EnforceResult(new_rollout, new_trainer, changes, findings, engine, sampling,
                           {k: v for k, v in t_new.items()})
    if strict and result.errors:
        lines = [f"  [{f.code}] {f.message}; fix: " + "; ".join(f"{k}: {v}" for k, v in f.fix.items())
                 for f in result.errors]
        raise ParityError("parity errors remain after enforce():\n" + "\n".join(lines), findings=result.errors)
    return result
