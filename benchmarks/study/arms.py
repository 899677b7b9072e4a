"""The study's configuration and its arms. Every arm shares the same GRPO recipe; an arm only chooses the
rollout (exact / realistic bf16 / injected at a k3 target) and which mitigations the TIM callback switches on.
Nothing here is tuned per arm: mitigation options are the core's defaults (except where a default cannot
apply at this scale, said next to it, and applied identically to every arm that uses it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["StudyConfig", "Arm", "build_arms", "MITIGATIONS", "collapse_rule"]

# Mitigations studied alone on the strongest TIM arm, then all together.
MITIGATIONS = ("safe_vocab", "lr_decay", "token_tis", "seq_mis", "icepop")


@dataclass
class StudyConfig:
    steps: int = field(default=80, metadata={"help": "GRPO optimizer steps per run"})
    seeds: tuple = field(default=(0, 1, 2), metadata={"help": "training seeds (same for every arm)"})
    inject_targets: tuple = field(default=(1e-4, 1e-2, 1e-1), metadata={
        "help": "k3 targets of the injected arms (calibrated once on the warm-started policy)"})
    inject_mode: str = field(default="bias", metadata={
        "help": "TailNoiseInjector mode: 'bias' (+σ on tail tokens: the engine over-weights the tail, the "
                "direction seen in real bf16 runs) or 'noise'"})
    inject_tau: float = field(default=0.1, metadata={"help": "tail threshold of the injector"})
    prompts_per_step: int = field(default=4, metadata={"help": "distinct prompts per GRPO step"})
    num_generations: int = field(default=8, metadata={"help": "completions per prompt (GRPO group)"})
    max_completion_length: int = field(default=12, metadata={"help": "tokens; answers need <= 7"})
    learning_rate: float = field(default=1e-4, metadata={
        "help": "constant LR, chosen on the exact arm (1e-3 degraded its reward over 80 steps; 1e-4 improved it)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping (TRL's default 1.0)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    loss_type: str = field(default="grpo", metadata={"help": "TRL loss_type"})
    min_p: float = field(default=1e-3, metadata={
        "help": "sampler min_p of the safe-vocab arms (trainer prunes the same tail). 1e-3 rather than the core "
                "default 1e-4: with 39 tokens and a peaked policy, 1e-4 prunes almost nothing"})
    lr_decay_options: dict = field(default_factory=lambda: {"warmup_steps": 10, "cooldown": 10}, metadata={
        "help": "LengthTriggeredLRDecay options; the core defaults (20-step warm-up/cooldown) assume runs of "
                "hundreds of steps, so both are scaled to this run length"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    model: str | None = field(default=None, metadata={"help": "a local model path instead of the sort task's"})
    arms: tuple | None = field(default=None, metadata={"help": "subset of arm names (None: all)"})

    def to_dict(self) -> dict:
        out = asdict(self)
        out["seeds"] = list(self.seeds)
        out["inject_targets"] = list(self.inject_targets)
        out["arms"] = list(self.arms) if self.arms else None
        return out


@dataclass
class Arm:
    name: str
    group: str  # exact | tim | mitigation | all
    rollout: str  # exact | hf | bf16 | inject
    target_k3: float | None = None
    safe_vocab: bool = False
    lr_decay: bool = False
    is_correction: str | None = None
    description: str = ""

    def tim_config_kwargs(self, cfg: StudyConfig) -> dict:
        kw = {"parity_audit": False, "log_histograms": False,
              "rollout": {"bf16": "hf"}.get(self.rollout, self.rollout)}
        if self.safe_vocab:
            kw["safe_vocab"] = True
        if self.lr_decay:
            kw["lr_decay"] = True
            kw["lr_decay_options"] = dict(cfg.lr_decay_options)
        if self.is_correction:
            kw["is_correction"] = self.is_correction
        return kw


def _target_name(k3: float) -> str:
    return f"inject_k3_{k3:.0e}".replace("e-0", "e-")


def build_arms(cfg: StudyConfig) -> list[Arm]:
    arms = [
        Arm("exact", "exact", "exact", description="zero-mismatch sampler (k3 must read 0.0)"),
        Arm("bf16", "tim", "bf16", description="realistic: bf16-autocast rollout vs fp32 trainer"),
    ]
    for k3 in cfg.inject_targets:
        arms.append(Arm(_target_name(k3), "tim", "inject", target_k3=k3,
                        description=f"tail {cfg.inject_mode} injection calibrated to k3 = {k3:g}"))
    strongest = max(cfg.inject_targets)
    base = dict(rollout="inject", target_k3=strongest)
    tag = _target_name(strongest)
    arms += [
        Arm(f"{tag}+safe_vocab", "mitigation", safe_vocab=True, description="safe vocabulary (min_p both sides)",
            **base),
        Arm(f"{tag}+lr_decay", "mitigation", lr_decay=True, description="length-triggered LR decay", **base),
        Arm(f"{tag}+token_tis", "mitigation", is_correction="token_tis", description="token TIS, C = 2", **base),
        Arm(f"{tag}+seq_mis", "mitigation", is_correction="seq_mis", description="sequence MIS, C = 2", **base),
        Arm(f"{tag}+icepop", "mitigation", is_correction="icepop", description="IcePop, band (0.5, 5)", **base),
        Arm(f"{tag}+all", "all", safe_vocab=True, lr_decay=True, is_correction="seq_mis+token_tis",
            description="safe vocab + LR decay + sequence MIS x token TIS", **base),
    ]
    if cfg.arms:
        wanted = set(cfg.arms)
        unknown = wanted - {a.name for a in arms}
        if unknown:
            raise ValueError(f"--arms {sorted(unknown)}: unknown; choose among {[a.name for a in arms]}")
        arms = [a for a in arms if a.name in wanted]
    return arms


def collapse_rule() -> dict:
    """Fixed before any run (the same for every arm): a run has collapsed at the first step s where the
    10-step moving average of the reward has stayed below half of its running maximum for K = 10 consecutive
    steps, once that running maximum is >= 0.2 (so a run that never learned cannot "collapse"). Grad-norm
    spikes (> 5x the run's running median) and entropy spikes (> 2x the running median) are counted beside it
    as the accompanying symptoms."""
    return {"window": 10, "ratio": 0.5, "patience": 10, "min_peak": 0.2, "grad_spike": 5.0, "entropy_spike": 2.0}
