"""TIM injection: perturb the rollout distribution on its tail, calibrated to a target `tim/token/kl_k3`.

The injector adds, on tail tokens only (p < τ under the distribution it receives),

    mode "noise":  z'_a = z_a + σ · ε_a,   ε_a ~ N(0, 1) i.i.d. (symmetric)
    mode "bias":   z'_a = z_a + s · σ      (s = ±1: a systematic shift; +1 = the engine over-weights the tail)

and leaves tokens with p >= τ and masked (-inf) logits untouched. With a measured `InjectionProfile` m(p) the shift
of token a is scaled by its probability p_a = softmax(z)_a:

    mode "noise":  z'_a = z_a + σ · c · m(p_a) · ε_a      (c = sqrt(π/2), so E|z'_a − z_a| = σ · m(p_a))
    mode "bias":   z'_a = z_a + s · σ · m(p_a)

so at σ = 1 each logit moves, on average, by the mean |Δ log p| a real low-precision engine showed at that
probability (`InjectionProfile.from_measure_summary` reads it from ``tim-plugins measure``), and σ is the
magnitude relative to that engine. The rollout then samples from, and reports
the log-probs of, the perturbed distribution, exactly as a mismatched engine would; the trainer recomputes the
unperturbed one. Like custom processors in vLLM, an HF logits processor passed to `generate()` runs *before*
the temperature warper, so τ applies to softmax(z) and the tempered distribution is softmax(z' / T)
(TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin._get_logits_processor, VLLM_SOURCES
vllm.v1.sample.sampler:Sampler.apply_logits_processors).

The scale σ is found by bisection so that k3 = mean(e^d − d − 1), d = log p_train − log p_rollout, measured
with `tim_plugins.metrics.mismatch_metrics` on a probe batch, hits the target (E_q[k3] = KL(q‖p)).
Deterministic under a seed.
"""

from __future__ import annotations

import base64
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from tim_plugins.rollout.batch import completion_mask_from_eos

__all__ = [
    "TailNoiseInjector",
    "InjectorConfig",
    "InjectionProfile",
    "INJECT_MODES",
    "MAX_SCALE",
    "EXTRA_ARGS_KEY",
    "noise_seed",
    "perturb_tail",
    "calibrate_scale",
    "calibrate_injector",
    "CalibrationResult",
    "CalibrationError",
]

INJECT_MODES = ("noise", "bias")
# The largest σ: σ times a Gaussian draw must stay a finite float32 shift (1e39 turned the logits to inf and the
# sampled distribution to NaN), and a tail shifted by a million nats is already gone from the distribution.
MAX_SCALE = 1e6
# The key of the injector's settings in ``SamplingParams.extra_args`` (read by the vLLM processor,
# ``tim_plugins.integrations.vllm.inject``).
EXTRA_ARGS_KEY = "tim_inject"


def noise_seed(seed: int) -> int:
    """The 64-bit seed the injector's generators start from: any integer, modulo 2**64. torch's
    ``Generator.manual_seed`` takes [-2**63, 2**64) and maps a negative seed the same way, so the seeds it took
    keep their draws, and the HF and vLLM paths accept the same seeds (e.g. ``random.getrandbits(64)``)."""
    return int(seed) % (1 << 64)


@dataclass(frozen=True)
class InjectionProfile:
    """Per-probability magnitude m(p) of the injected logit shift, from a measured |Δ log p| vs p table.

    ``p``: bin centres, strictly increasing in (0, 1]; ``mean_abs_diff``: the measured mean |Δ log p| of the
    vocabulary entries in each bin (> 0). m(p) interpolates linearly in (log p, log m) and is constant beyond
    the first and last centre.
    """

    p: tuple
    mean_abs_diff: tuple
    source: str = ""

    def __post_init__(self) -> None:
        p = tuple(float(x) for x in self.p)
        m = tuple(float(x) for x in self.mean_abs_diff)
        if not p or len(p) != len(m):
            raise ValueError(f"InjectionProfile: p ({len(p)} values) and mean_abs_diff ({len(m)} values) must be "
                             "non-empty and of the same length")
        if not all(0.0 < x <= 1.0 for x in p) or any(b <= a for a, b in zip(p, p[1:])):
            raise ValueError(f"InjectionProfile.p={p}: must be strictly increasing probabilities in (0, 1]")
        if not all(math.isfinite(x) and x > 0.0 for x in m):
            raise ValueError(f"InjectionProfile.mean_abs_diff={m}: must be finite numbers > 0 (drop empty bins)")
        object.__setattr__(self, "p", p)
        object.__setattr__(self, "mean_abs_diff", m)
        # (log p, log m) per device, built once: magnitude() runs at every decoding step
        object.__setattr__(self, "_log_tables", {})

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._log_tables:
            self._log_tables[device] = (
                torch.tensor([math.log(x) for x in self.p], dtype=torch.float32, device=device),
                torch.tensor([math.log(x) for x in self.mean_abs_diff], dtype=torch.float32, device=device))
        return self._log_tables[device]

    def magnitude(self, probs: torch.Tensor) -> torch.Tensor:
        """m(p) for a tensor of probabilities (float32, same shape)."""
        lp, lm = self._tables(probs.device)
        x = probs.float().clamp_min(1e-30).log().clamp(lp[0], lp[-1])
        if lp.numel() == 1:
            return lm[0].exp().expand_as(x).clone()
        i = torch.searchsorted(lp, x.contiguous(), right=True).clamp_(1, lp.numel() - 1)
        x0, x1, y0, y1 = lp[i - 1], lp[i], lm[i - 1], lm[i]
        return (y0 + (y1 - y0) * (x - x0) / (x1 - x0)).exp()

    def to_dict(self) -> dict:
        return {"p": list(self.p), "mean_abs_diff": list(self.mean_abs_diff), "source": self.source}

    @classmethod
    def coerce(cls, value: Union["InjectionProfile", Mapping, None]) -> Optional["InjectionProfile"]:
        """An InjectionProfile from itself, a ``to_dict()`` mapping, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls(p=tuple(value["p"]), mean_abs_diff=tuple(value["mean_abs_diff"]),
                       source=str(value.get("source", "")))
        raise TypeError(f"InjectionProfile.coerce: expected an InjectionProfile or a mapping with 'p' and "
                        f"'mean_abs_diff', got {type(value).__name__}")

    @classmethod
    def from_measure_summary(cls, summary: Union[Mapping, str, Path], setting: str = "hf-bf16",
                             min_count: float = 1.0) -> "InjectionProfile":
        """The ``by p`` profile of one setting of a ``tim-plugins measure`` summary (its ``summary.json``, or
        the loaded dict): bins with fewer than ``min_count`` entries or a zero mean are dropped."""
        source = ""
        if not isinstance(summary, Mapping):
            source = str(summary)
            summary = json.loads(Path(summary).read_text())
        profiles = summary.get("profiles") or {}
        if setting not in profiles:
            raise ValueError(f"InjectionProfile.from_measure_summary: no profile for setting {setting!r}; the "
                             f"summary has {sorted(profiles)}")
        curve = profiles[setting]["p"]
        rows = [(c, m) for c, m, n in zip(curve["centre"], curve["mean"], curve["count"])
                if n >= min_count and m > 0 and math.isfinite(m)]
        if not rows:
            raise ValueError(f"InjectionProfile.from_measure_summary: setting {setting!r} has no bin with "
                             f">= {min_count} entries and a mean > 0")
        return cls(p=tuple(r[0] for r in rows), mean_abs_diff=tuple(r[1] for r in rows),
                   source=f"{source}#{setting}" if source else setting)


def perturb_tail(
    scores: torch.Tensor,
    scale: float,
    *,
    tau: float,
    mode: str = "noise",
    bias_sign: float = 1.0,
    generator: Optional[torch.Generator] = None,
    profile: Optional[InjectionProfile] = None,
) -> torch.Tensor:
    """Perturbed copy of `scores` ([..., V] logits): tail tokens (softmax(scores) < tau) shifted by σ·ε or ±σ,
    times the profile's m(p) (with the sqrt(π/2) factor in noise mode) when one is given."""
    z = scores.float()
    probs = torch.softmax(z, dim=-1)
    tail = (probs < tau) & torch.isfinite(z)
    if mode == "noise":
        # CPU generator → same draws on every device; then moved.
        eps = torch.randn(z.shape, generator=generator, dtype=torch.float32).to(z.device)
        delta = scale * eps
        if profile is not None:
            delta = delta * (math.sqrt(math.pi / 2) * profile.magnitude(probs))
    elif mode == "bias":
        delta = torch.full_like(z, scale * bias_sign)
        if profile is not None:
            delta = delta * profile.magnitude(probs)
    else:
        raise ValueError(f"perturb_tail(mode={mode!r}): must be one of {INJECT_MODES}")
    return torch.where(tail, z + delta, z).to(scores.dtype)


@dataclass
class InjectorConfig:
    """Options of :class:`TailNoiseInjector` (the adapters' ``inject_options``): one definition, one set of checks."""

    scale: float = field(default=0.0, metadata={
        "help": "σ, the magnitude of the perturbation (0 = off); calibrate_injector finds it for a target k3."})
    tau: float = field(default=0.1, metadata={
        "help": "Tail threshold: only tokens with p < tau under the distribution the processor receives move."})
    mode: str = field(default="noise", metadata={
        "help": f"One of {INJECT_MODES}: symmetric Gaussian noise, or a systematic shift by bias_sign · σ."})
    seed: int = field(default=0, metadata={"help": "Seed of the noise; reset() restarts the same sequence."})
    bias_sign: float = field(default=1.0, metadata={
        "help": "mode='bias': +1 (the engine over-weights the tail) or -1."})
    profile: Any = field(default=None, metadata={
        "help": "An InjectionProfile (or its to_dict()) scaling each token's shift by m(p); None = uniform."})

    def __post_init__(self) -> None:
        if self.mode not in INJECT_MODES:
            raise ValueError(f"TailNoiseInjector(mode={self.mode!r}): must be one of {INJECT_MODES}")
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not 0.0 < self.tau <= 1.0:
            raise ValueError(f"TailNoiseInjector(tau={self.tau!r}): must be in (0, 1]")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not \
                0 <= self.scale <= MAX_SCALE:
            raise ValueError(f"TailNoiseInjector(scale={self.scale!r}): must be a number in [0, {MAX_SCALE:g}] (its "
                             "shifts are added to float32 logits; calibrate_scale searches up to 64)")
        if self.bias_sign not in (1.0, -1.0, 1, -1):
            raise ValueError(f"TailNoiseInjector(bias_sign={self.bias_sign!r}): must be +1 or -1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"TailNoiseInjector(seed={self.seed!r}): must be an integer (any size: the generators "
                             "use it modulo 2**64)")
        self.scale, self.tau, self.seed, self.bias_sign = float(self.scale), float(self.tau), int(self.seed), \
            float(self.bias_sign)
        self.profile = InjectionProfile.coerce(self.profile)


class TailNoiseInjector:
    """Tail perturbation usable as an HF logits processor: ``generate(..., logits_processor=[injector])``.

    Args (``InjectorConfig``'s fields, checked there):
        scale: σ (0 = off). Usually set by `calibrate_injector` / `calibrate_scale`.
        tau: tail threshold on the token probability of the distribution the processor receives.
        mode: "noise" (symmetric Gaussian) or "bias" (shift by bias_sign · σ).
        seed: seeds the noise generator; `reset()` restarts the same noise sequence.
        profile: an `InjectionProfile` (or its ``to_dict()``) scaling each token's shift by m(p); with tau=1
            it perturbs the whole vocabulary the way the measured engine did, and σ is relative to it.
    """

    def __init__(self, scale: float = 0.0, *, tau: float = 0.1, mode: str = "noise", seed: int = 0,
                 bias_sign: float = 1.0, profile: Union[InjectionProfile, Mapping, None] = None):
        cfg = InjectorConfig(scale=scale, tau=tau, mode=mode, seed=seed, bias_sign=bias_sign, profile=profile)
        self.scale, self.tau, self.mode, self.seed = cfg.scale, cfg.tau, cfg.mode, cfg.seed
        self.bias_sign, self.profile = cfg.bias_sign, cfg.profile
        self.reset()

    @classmethod
    def from_config(cls, config: InjectorConfig) -> "TailNoiseInjector":
        return cls(config.scale, tau=config.tau, mode=config.mode, seed=config.seed, bias_sign=config.bias_sign,
                   profile=config.profile)

    def reset(self) -> None:
        self._generator = torch.Generator().manual_seed(noise_seed(self.seed))

    def state_dict(self) -> dict:
        """Where the noise sequence stands (JSON-safe: a checkpoint resumes the draws after the last one taken,
        not from the seed again)."""
        state = self._generator.get_state().numpy().tobytes()
        return {"seed": self.seed, "generator": base64.b64encode(state).decode()}

    def load_state_dict(self, state: Mapping) -> None:
        """Put back a ``state_dict``; one saved under another seed is refused (another configuration's draws)."""
        if state.get("seed") != self.seed:
            raise ValueError(f"TailNoiseInjector.load_state_dict: the state was saved with seed {state.get('seed')!r}, "
                             f"this injector's is {self.seed!r}. Fix: resume with the seed the run was started with")
        raw = bytearray(base64.b64decode(state["generator"]))
        self._generator.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())

    def perturb(self, scores: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        if self.scale == 0.0:
            return scores
        return perturb_tail(scores, self.scale, tau=self.tau, mode=self.mode, bias_sign=self.bias_sign,
                            generator=self._generator if generator is None else generator, profile=self.profile)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """HF LogitsProcessor protocol: scores [B, V] → perturbed scores [B, V]."""
        return self.perturb(scores)

    def to_extra_args(self) -> dict:
        """Per-request activation of the vLLM processor: ``SamplingParams(extra_args=injector.to_extra_args())``."""
        if self.profile is not None:
            raise ValueError("TailNoiseInjector.to_extra_args: the vLLM processor "
                             "(tim_plugins.integrations.vllm.inject) applies no InjectionProfile; a profiled "
                             "injector runs with HF generate only (drop profile= for vLLM)")
        # the seed as its generators use it (the same draws): vLLM takes extra_args integers in [-2**63, 2**64)
        # only (SamplingParams refuses others: its engine's MessagePack transport carries 64 bits)
        return {EXTRA_ARGS_KEY: {"scale": self.scale, "tau": self.tau, "mode": self.mode,
                                 "seed": noise_seed(self.seed), "bias_sign": self.bias_sign}}

    def __repr__(self) -> str:
        prof = "" if self.profile is None else f", profile={self.profile.source or 'measured'!r}"
        return (f"TailNoiseInjector(scale={self.scale:.6g}, tau={self.tau}, mode={self.mode!r}, seed={self.seed}, "
                f"bias_sign={self.bias_sign:+g}{prof})")


def _k3_at(scale: float, logits: torch.Tensor, temperature: float, injector: TailNoiseInjector,
           uniforms: torch.Tensor) -> float:
    from tim_plugins.metrics import mismatch_metrics

    gen = torch.Generator().manual_seed(noise_seed(injector.seed))  # common random numbers across scales
    z_q = perturb_tail(logits, scale, tau=injector.tau, mode=injector.mode, bias_sign=injector.bias_sign,
                       generator=gen, profile=injector.profile) if scale > 0 else logits
    logq = torch.log_softmax(z_q.float() / temperature, dim=-1)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    # inverse-CDF sampling from q with fixed uniforms [N, S]: tokens move smoothly with the scale
    cdf = logq.exp().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    tok = torch.searchsorted(cdf, uniforms).clamp_(max=logits.shape[-1] - 1)  # [N, S]
    rollout_lp, train_lp = logq.gather(-1, tok), logp.gather(-1, tok)
    return float(mismatch_metrics(rollout_lp, train_lp, torch.ones_like(rollout_lp, dtype=torch.bool))
                 ["tim/token/kl_k3"])


class CalibrationError(ValueError):
    """The target k3 is out of the injector's reach on the probe batch: ``reached`` is the most it gave."""

    def __init__(self, message: str, *, target_k3: float, reached: float):
        super().__init__(message)
        self.target_k3, self.reached = target_k3, reached


@dataclass
class CalibrationResult:
    scale: float
    k3: float  # k3 on the probe batch at `scale`
    target_k3: float
    iterations: int


def calibrate_scale(
    logits: torch.Tensor,
    target_k3: float,
    injector: TailNoiseInjector,
    *,
    temperature: float = 1.0,
    samples_per_position: int = 16,
    rtol: float = 0.01,
    max_iter: int = 60,
    max_scale: float = 64.0,
) -> CalibrationResult:
    """Bisection on σ so that k3 measured on `logits` ([N, V], untempered, unperturbed) hits `target_k3`.

    k3 is measured with `mismatch_metrics` on `samples_per_position` tokens per position drawn from the
    perturbed distribution with fixed uniforms (common random numbers make k3(σ) deterministic and
    near-monotone). Sets and returns the injector's scale.
    """
    if target_k3 <= 0 or not math.isfinite(target_k3):
        raise ValueError(f"calibrate_scale(target_k3={target_k3}): must be a finite number > 0")
    if logits.dim() != 2:
        raise ValueError(f"calibrate_scale: logits must be [N, V], got {tuple(logits.shape)}")
    temperature = 1.0 if temperature <= 0 else float(temperature)
    gen = torch.Generator().manual_seed(noise_seed(injector.seed + 1))
    uniforms = torch.rand((logits.shape[0], samples_per_position), generator=gen, dtype=torch.float32)
    lo, hi = 0.0, 0.25
    k3_hi = _k3_at(hi, logits, temperature, injector, uniforms)
    it = 1
    while k3_hi < target_k3:
        lo, hi = hi, hi * 2
        if hi > max_scale:
            raise CalibrationError(f"calibrate_scale: k3 stays below {target_k3:g} up to scale {max_scale:g} "
                                   f"(reached {k3_hi:.3g}); the tail (p < tau={injector.tau}) is too small on this "
                                   "probe batch: raise tau or use a larger probe batch",
                                   target_k3=target_k3, reached=k3_hi)
        k3_hi = _k3_at(hi, logits, temperature, injector, uniforms)
        it += 1
    best = (hi, k3_hi)
    while it < max_iter:
        mid = 0.5 * (lo + hi)
        k3 = _k3_at(mid, logits, temperature, injector, uniforms)
        it += 1
        if abs(k3 - target_k3) < abs(best[1] - target_k3):
            best = (mid, k3)
        if abs(k3 - target_k3) <= rtol * target_k3:
            break
        lo, hi = (mid, hi) if k3 < target_k3 else (lo, mid)
    injector.scale = float(best[0])
    injector.reset()
    return CalibrationResult(injector.scale, best[1], float(target_k3), it)


@torch.no_grad()
def calibrate_injector(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    target_k3: float,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    tau: float = 0.1,
    mode: str = "noise",
    seed: int = 0,
    bias_sign: float = 1.0,
    rounds: int = 2,
    samples_per_position: int = 16,
    profile: Union[InjectionProfile, Mapping, None] = None,
) -> tuple[TailNoiseInjector, CalibrationResult]:
    """Calibrate a `TailNoiseInjector` on probe rollouts of an HF model.

    Round 1 samples probe completions without perturbation; each later round samples with the injector at
    the current scale (the perturbation changes which contexts are visited) and re-calibrates on the
    unperturbed logits of those positions.

    Args:
        input_ids, attention_mask: [B, P] left-padded probe prompts.
        target_k3: wanted `tim/token/kl_k3` between rollout (perturbed) and trainer (clean) log-probs.
        profile: an `InjectionProfile` the injector scales its shifts by (see `TailNoiseInjector`).
    """
    injector = TailNoiseInjector(0.0, tau=tau, mode=mode, seed=seed, bias_sign=bias_sign, profile=profile)
    result: Optional[CalibrationResult] = None
    for r in range(max(1, int(rounds))):
        injector.reset()
        torch.manual_seed(noise_seed(seed + 1000 * r))
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=temperature or 1.0,
            top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, logits_processor=[injector],
            output_logits=True, return_dict_in_generate=True, pad_token_id=model.generation_config.pad_token_id,
        )
        raw = torch.stack(out.logits, dim=1)  # [B, T, V] before any processor (clean)
        completion = out.sequences[:, input_ids.shape[1]:]
        valid = completion_mask_from_eos(completion, model.generation_config.eos_token_id).bool()
        logits = raw[valid]  # up to and including the first EOS
        result = calibrate_scale(logits, target_k3, injector, temperature=temperature or 1.0,
                                 samples_per_position=samples_per_position)
    injector.reset()
    return injector, result
