"""The study's configuration, its arms, and the degradation rule (fixed before any run).

Every arm shares one GRPO recipe; an arm chooses the rollout engine, the mismatch magnitude, the cell of the
harm sweep it belongs to (completion budget L, learning rate, gradient clipping, task variant) and which
mitigations the TIM callback switches on. Each mismatched arm names its **control**: the zero-mismatch arm on
the same sampler code path (TRL's HF generation with the TIM injector in place at scale 0) in the same cell,
run with the same seeds, so every comparison is paired by seed.

Scenarios:
- ``main``: L = ``budget``; exact sampler, the control, real bf16 and fp16 rollouts (a low-precision copy of
  the policy generates), and the injected mismatch with the profile measured on a real model (SmolLM2-135M
  bf16 vs fp32, ``measured_profile_smollm2.json``) at ``magnitudes`` × that engine.
- ``length``: the control and ``curve_magnitudes`` at each other budget in ``lengths``.
- ``update``: the control and ``curve_magnitudes`` at L = ``budget`` with the LR × ``high_lr_factor`` and no
  gradient clipping (a larger update).
- ``surge``: the ``chain_stop`` task whose reward comes to favour length at step ``surge_after``: the control
  and ``surge_magnitude``, each with and without the length-triggered LR decay.
- ``mitigation``: each of ``mitigations`` on ``mitigation_cell`` (an arm name: the strongest harm found),
  paired with that arm itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from tim_plugins._config import field_help

__all__ = ["StudyConfig", "Arm", "build_arms", "SCENARIOS", "MITIGATIONS", "degradation_rule", "collapse_rule",
           "PROFILE_FILE"]

SCENARIOS = ("main", "length", "update", "surge", "mitigation")
MITIGATIONS = ("token_tis", "seq_mis", "icepop", "safe_vocab", "lr_decay")
PROFILE_FILE = "measured_profile_smollm2.json"


@dataclass
class StudyConfig:
    steps: int = field(default=100, metadata=field_help("GRPO optimizer steps per run"))
    seeds: tuple = field(default=(0, 1, 2, 3), metadata=field_help("training seeds, the same for every arm (paired)"))
    scenarios: tuple = field(default=("main", "length", "update", "surge"), metadata=field_help(
        f"which scenarios to run, among {SCENARIOS}"))
    budget: int = field(default=64, metadata=field_help("completion budget L of the main cell (tokens)"))
    lengths: tuple = field(default=(16, 192), metadata=field_help("other budgets of the length axis"))
    magnitudes: tuple = field(default=(1.0, 3.0, 10.0, 20.0, 30.0), metadata=field_help(
        "injected mismatch of the main cell, in units of the measured bf16 engine's per-probability |Δ log p| "
        "(x20 was added after the pre-registered runs, to place the onset between x10 and x30)"))
    curve_magnitudes: tuple = field(default=(10.0, 20.0, 30.0), metadata=field_help(
        "injected magnitudes on the length and update axes (x20 added as above)"))
    profile_setting: str = field(default="hf-bf16", metadata=field_help(
        "which measured profile the injector follows (a setting of measured_profile_smollm2.json)"))
    prompts_per_step: int = field(default=4, metadata=field_help("distinct prompts per GRPO step"))
    num_generations: int = field(default=8, metadata=field_help("completions per prompt (GRPO group)"))
    learning_rate: float = field(default=3e-4, metadata=field_help(
        "constant LR of every cell but the update axis (chosen once on the control arm, never per arm)"))
    max_grad_norm: float = field(default=1.0, metadata=field_help("gradient clipping (TRL's default 1.0)"))
    high_lr_factor: float = field(default=5.0, metadata=field_help("update axis: LR multiplier (clipping off)"))
    temperature: float = field(default=1.0, metadata=field_help("sampling temperature"))
    loss_type: str = field(default="grpo", metadata=field_help("TRL loss_type"))
    eval_every: int = field(default=10, metadata=field_help("evaluate the trained policy every k steps"))
    eval_prompts: int = field(default=128, metadata=field_help("held-out prompts (never in any training batch)"))
    surge_budget: int = field(default=128, metadata=field_help("surge scenario: completion budget"))
    surge_after: int = field(default=25, metadata=field_help(
        "surge scenario: the step from which the reward favours length (before: length-neutral)"))
    surge_magnitude: float = field(default=10.0, metadata=field_help("surge scenario: injected magnitude"))
    lr_decay_options: dict = field(default_factory=lambda: {"warmup_steps": 10, "cooldown": 10}, metadata=field_help(
        "LengthTriggeredLRDecay options; the core defaults (20-step warm-up/cooldown) assume runs of hundreds of "
        "steps, so both are scaled to this run length"))
    min_p: float = field(default=0.02, metadata=field_help(
        "sampler min_p of the safe-vocab arm (the trainer prunes the same tail): with 39 tokens and ~3 likely "
        "ones, 0.02 prunes tokens 50x less likely than the top one; the core default 1e-4 prunes nothing here"))
    mitigation_cell: str | None = field(default=None, metadata=field_help(
        "mitigation scenario: the arm whose harm the mitigations are tried on"))
    mitigations: tuple = field(default=("token_tis", "seq_mis", "icepop", "safe_vocab"), metadata=field_help(
        f"mitigations tried alone on mitigation_cell, among {MITIGATIONS}"))
    device: str = field(default="cpu", metadata=field_help("cpu or cuda"))
    model: str | None = field(default=None, metadata=field_help(
        "a local model path instead of the chain task's warm start (its tokenizer must spell the task's letters "
        "as single tokens)"))
    hidden_size: int | None = field(default=None, metadata=field_help(
        "warm start: hidden size of the toy model (None: the task's 64); the GPU preset raises it"))
    num_layers: int | None = field(default=None, metadata=field_help("warm start: layers (None: the task's 2)"))
    warm_start_steps: int | None = field(default=None, metadata=field_help(
        "supervised warm-start steps of the chain task (chain_stop takes 3x; None: the recipe's 500 / 1500)"))
    arms: tuple | None = field(default=None, metadata=field_help("subset of arm names (None: every arm)"))

    def __post_init__(self) -> None:
        for name in ("seeds", "scenarios", "lengths", "magnitudes", "curve_magnitudes", "mitigations"):
            setattr(self, name, tuple(getattr(self, name)))
        if self.arms is not None:
            self.arms = tuple(self.arms)
        bad = [s for s in self.scenarios if s not in SCENARIOS]
        if bad:
            raise ValueError(f"StudyConfig.scenarios={self.scenarios}: unknown {bad}; choose among {SCENARIOS}")
        bad = [m for m in self.mitigations if m not in MITIGATIONS]
        if bad:
            raise ValueError(f"StudyConfig.mitigations={self.mitigations}: unknown {bad}; choose among {MITIGATIONS}")
        if "mitigation" in self.scenarios and not self.mitigation_cell:
            raise ValueError("StudyConfig: the mitigation scenario needs mitigation_cell (an arm name, e.g. "
                             "--set mitigation_cell=profile_x30@lr5x)")
        for name in ("steps", "budget", "eval_every", "eval_prompts", "prompts_per_step", "num_generations",
                     "surge_budget"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"StudyConfig.{name}={getattr(self, name)}: must be >= 1")
        if any(m <= 0 for m in self.magnitudes + self.curve_magnitudes) or self.surge_magnitude <= 0:
            raise ValueError("StudyConfig: injected magnitudes must be > 0 (the control is the magnitude-0 arm)")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"StudyConfig.device={self.device!r}: cpu or cuda")

    def to_dict(self) -> dict:
        out = asdict(self)
        for f in fields(self):
            if isinstance(out[f.name], tuple):
                out[f.name] = list(out[f.name])
        return out


@dataclass
class Arm:
    name: str
    scenario: str
    rollout: str  # exact | inject (control: magnitude 0) | bf16 | fp16
    magnitude: float = 0.0  # injected, × the measured engine
    budget: int = 64
    learning_rate: float = 3e-4
    max_grad_norm: float = 1.0
    task: str = "chain"  # chain | chain_stop
    control: str | None = None  # the paired zero-mismatch arm (same code path, same cell)
    safe_vocab: bool = False
    lr_decay: bool = False
    is_correction: str | None = None
    description: str = ""

    @property
    def cell(self) -> str:
        return self.name.partition("@")[2] or "main"

    def tim_config_kwargs(self, cfg: StudyConfig, profile: dict | None, seed: int) -> dict:
        # log_detail: the study's rows and its analysis read the detail families (by probability, max |Δ|, ...)
        kw = {"parity_audit": False, "log_histograms": False, "log_detail": True,
              "rollout": {"exact": "exact", "inject": "inject"}.get(self.rollout, "hf")}
        if self.rollout == "inject":
            kw["inject_options"] = {"scale": float(self.magnitude), "tau": 1.0, "mode": "noise", "seed": seed,
                                    "profile": profile}
        if self.safe_vocab:
            kw["safe_vocab"] = True
        if self.lr_decay:
            kw["lr_decay"] = True
            kw["lr_decay_options"] = dict(cfg.lr_decay_options)
        if self.is_correction:
            kw["is_correction"] = self.is_correction
        return kw


def _mag(m: float) -> str:
    return f"x{m:g}"


def build_arms(cfg: StudyConfig) -> list[Arm]:
    lr, clip = cfg.learning_rate, cfg.max_grad_norm
    arms: list[Arm] = []

    def cell(scenario: str, tag: str, budget: int, lr_: float, clip_: float, mags, task: str = "chain"):
        """The zero-mismatch control of a cell and its injected arms (paired with it)."""
        suffix = f"@{tag}" if tag else ""
        control = Arm(f"control{suffix}", scenario, "inject", 0.0, budget, lr_, clip_, task,
                      description=f"zero mismatch on the injected arms' code path (injector at scale 0), L={budget}")
        return [control] + [
            Arm(f"profile_{_mag(m)}{suffix}", scenario, "inject", float(m), budget, lr_, clip_, task,
                control=control.name, description=f"measured bf16 profile x{m:g} on the whole vocabulary, L={budget}")
            for m in mags]

    if "main" in cfg.scenarios:
        control, *injected = cell("main", "", cfg.budget, lr, clip, cfg.magnitudes)
        arms.append(Arm("exact", "main", "exact", 0.0, cfg.budget, lr, clip, control=control.name,
                        description="exact sampler (k3 must read 0.0); a different code path from the control"))
        arms.append(control)
        for dtype in ("bf16", "fp16"):
            arms.append(Arm(dtype, "main", dtype, 0.0, cfg.budget, lr, clip, control=control.name,
                            description=f"real {dtype} rollout: a {dtype} copy of the policy generates"))
        arms += injected
    if "length" in cfg.scenarios:
        for budget in cfg.lengths:
            arms += cell("length", f"L{budget}", budget, lr, clip, cfg.curve_magnitudes)
    if "update" in cfg.scenarios:
        tag = f"lr{cfg.high_lr_factor:g}x"
        arms += cell("update", tag, cfg.budget, lr * cfg.high_lr_factor, 1e6, cfg.curve_magnitudes)
    if "surge" in cfg.scenarios:
        surge = cell("surge", "surge", cfg.surge_budget, lr, clip, (cfg.surge_magnitude,), task="chain_stop")
        arms += surge
        for base in surge:
            arms.append(Arm(f"{base.name.split('@')[0]}+lr_decay@surge", "surge", base.rollout, base.magnitude,
                            base.budget, base.learning_rate, base.max_grad_norm, base.task, lr_decay=True,
                            control=base.name, description=base.description + " + length-triggered LR decay"))
    if "mitigation" in cfg.scenarios:
        probe = StudyConfig(**{**cfg.to_dict(), "scenarios": tuple(s for s in SCENARIOS if s != "mitigation"),
                               "arms": None, "mitigation_cell": None})
        known = {a.name: a for a in build_arms(probe)}
        if cfg.mitigation_cell not in known or known[cfg.mitigation_cell].magnitude <= 0:
            raise ValueError(f"StudyConfig.mitigation_cell={cfg.mitigation_cell!r}: must be an injected arm, one "
                             f"of {sorted(n for n, a in known.items() if a.magnitude > 0)}")
        base = known[cfg.mitigation_cell]
        for needed in (known[base.control], base):  # the comparisons need both
            if needed.name not in {a.name for a in arms}:
                arms.append(needed)
        head, _, tail = base.name.partition("@")
        for mit in cfg.mitigations:
            kw = {"safe_vocab": mit == "safe_vocab", "lr_decay": mit == "lr_decay",
                  "is_correction": mit if mit in ("token_tis", "seq_mis", "icepop") else None}
            arms.append(Arm(f"{head}+{mit}" + (f"@{tail}" if tail else ""), "mitigation", base.rollout,
                            base.magnitude, base.budget, base.learning_rate, base.max_grad_norm, base.task,
                            control=base.name, description=f"{base.description} + {mit}", **kw))
    if cfg.arms:
        wanted = set(cfg.arms)
        unknown = wanted - {a.name for a in arms}
        if unknown:
            raise ValueError(f"--arms {sorted(unknown)}: unknown; choose among {[a.name for a in arms]}")
        arms = [a for a in arms if a.name in wanted]
    return arms


def degradation_rule() -> dict:
    """Fixed before any run of this study (also written in FINDINGS.md).

    Endpoint: the trained policy's held-out reward at T = 1 (``eval/sample/reward``: valid prefix / L over the
    held-out prompts, sampled from the trainer's fp32 weights), averaged over the last ``final_evals``
    evaluations of the run. For an arm and its control, paired by seed: Δ_s = endpoint(arm, s) −
    endpoint(control, s). The arm is **degraded** when mean_s Δ_s <= −``min_drop`` and every seed's Δ_s < 0.
    A mitigation **helps** (paired with its unmitigated arm) when mean_s Δ_s >= +``min_drop`` and every Δ_s > 0.
    Greedy reward, training reward, k3 and grad-norm spikes are reported beside it, never part of the rule.
    Error bars: mean ± standard deviation of Δ_s over seeds, and the 95 % t interval.
    """
    return {"endpoint": "eval/sample/reward", "final_evals": 3, "min_drop": 0.03, "all_seeds_negative": True}


def collapse_rule() -> dict:
    """A symptom counted beside the rule (as in the first study): the 10-step moving average of the training
    reward stays below half of its running maximum for 10 consecutive steps, once that maximum is >= 0.2.
    Grad-norm spikes: > 5x the running median of the earlier positive values."""
    return {"window": 10, "ratio": 0.5, "patience": 10, "min_peak": 0.2, "grad_spike": 5.0, "entropy_spike": 2.0}
