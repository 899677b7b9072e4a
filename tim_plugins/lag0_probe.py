"""The lag-0 probe: where the engine's weights cannot be read (a remote server), does the engine follow the trainer
at each weight sync?

A fixed batch of token sequences (the run's first generated rows) is scored by both sides: the engine's log-probs of
the given tokens (vLLM's prompt log-probs: temperature 1, no sampler processing) and the trainer's ``log_softmax`` of
its logits, per token: ``e`` and ``t``. The first scoring, the **reference**, is taken while both hold the weights that
sampled the batch (lag 0: the generation just ran, the optimizer has not stepped). After each checked sync the batch
is scored again. The rule (``Lag0Probe.judge`` mirrors it; means over the tokens both sides scored finitely):

- the **floor** is the reference's ``mean |e - t|``: the two stacks' numerics on these tokens, measured on the same
  weights (a floor that followed later probes would rise with a fault that grows slowly, and hide it);
- ``moved_trainer = mean |t - t_prev|`` and ``moved_engine = mean |e - e_prev|``, since the previous probe;
- ``drift = mean |(e - t) - (e_ref - t_ref)|``: how far the per-token gap moved from the reference's;
- **``probe-engine-unchanged``** when ``moved_trainer > max(moved_factor x floor, moved_min)`` and ``moved_engine <
  unchanged_ratio x moved_trainer``: the trainer moved further than the two stacks' numerics blur, and the engine's
  answers did not follow (a sync that never reached the engine);
- ``moved_since_reference = mean |t - t_ref|``: the trainer's own move since the reference;
- else **``probe-engine-drift``** when ``drift > drift_factor x floor``, ``drift > floor + drift_min`` and ``drift >
  drift_share x moved_since_reference``: the engine moves, but not with the trainer (a layer the sync skips, weights
  written wrongly: the engine misses that part of the policy's move), or a stale engine whose trainer moves too slowly
  per sync for the first rule: the gap accumulates against the reference (the whole move: a share of 1). The share
  keeps a healthy engine whose numerics grow with the policy's move apart: SmolLM2-135M against a bf16
  `trl vllm-serve` at a learning rate of 1e-3, every sync applied, moved its per-token gap 5-7x the reference's floor
  (0.26-0.37 nats), 7 % of the trainer's move since the reference;
- else the probe is in step.

A resumed run takes a new batch and reference at its first generation, after the resume's first sync. The floor its
checkpoint carries (``state_dict``: the reference's gap, or the last probe's that named nothing where that is larger,
as the healthy gap grows with the policy's move) judges that reference: a gap above ``drift_factor x`` that floor
and above it plus ``drift_min`` is **``probe-engine-drift``** at once (the engine does not hold the weights the
trainer resumed with); the floor then stays the carried one, so that the rules judge the later syncs against the two stacks'
numerics, not against the fault. Such a reference is no lag-0 scoring, so the drift rule does not measure against it:
until a probe's own gap ``mean |e - t|`` is within those bounds of the carried floor, each probe that breaches them
is ``probe-engine-drift`` again (``probe-engine-unchanged`` first, as above), and the first probe within them becomes
the reference (a later sync reached the engine). Otherwise the new reference's gap is the floor.

A healthy sync moves both sides alike (``moved_engine ≈ moved_trainer``, ``drift`` at the numerics' scale, about
the floor); a sync that does not reach the engine leaves ``moved_engine`` at 0 (the same request, the same numbers).
What it cannot see: the engine's prefix cache (vLLM never reads cached blocks for a request that asks for prompt
log-probs), and a fault smaller than the numerics of the two stacks on these tokens.

The API an adapter uses (framework-neutral; the adapter scores the batch on both sides)::

    probe = Lag0Probe(Lag0ProbeConfig())
    probe.set_reference(engine, trainer, mask)       # [K, T] log-probs at lag 0 and the scored tokens
    pipeline.probed(probe.judge_reference(step))     # after a resume: the reference against the carried floor
    if probe.due():                                  # after each sync: True every every_n_syncs-th
        causes = probe.judge(step, engine, trainer, mask)   # -> list[Cause], [] when in step
        pipeline.probed(causes)                      # the console line, tim/cause/*, the probe's warn / raise / stop
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tim_plugins._mismatch_layout import valid_logprob_pair
from tim_plugins.causes import Cause

__all__ = ["HISTORY", "Lag0Probe", "Lag0ProbeConfig", "ProbeScores"]

HISTORY = 1024  # judged probes whose figures Lag0Probe.history keeps


@dataclass
class Lag0ProbeConfig:
    """The lag-0 probe's batch, schedule and thresholds (the rule: this module's docstring)."""

    every_n_syncs: int = field(default=1, metadata={"help": "probe every Nth weight sync"})
    sequences: int = field(default=4, metadata={"help": (
        "sequences in the fixed batch (rows spread over the run's first generation batch)")})
    max_tokens: int = field(default=64, metadata={"help": (
        "tokens kept of each sequence (its first token, then its last ones: the completion's end, however long a "
        "shared prompt): the probe's cost is one forward of sequences x max_tokens tokens on each side")})
    moved_factor: float = field(default=4.0, metadata={"help": (
        "the engine's move is judged once the trainer's log-probs moved more than this times the floor ...")})
    moved_min: float = field(default=1e-3, metadata={"help": "... and more than this many nats (mean per token)"})
    unchanged_ratio: float = field(default=0.25, metadata={"help": (
        "probe-engine-unchanged: the engine's log-probs moved less than this share of the trainer's move")})
    drift_factor: float = field(default=4.0, metadata={"help": (
        "probe-engine-drift: the per-token gap moved from the reference's by more than this times the floor ...")})
    drift_min: float = field(default=0.05, metadata={"help": "... and by more than the floor plus this many nats ..."})
    drift_share: float = field(default=0.1, metadata={"help": (
        "... and by more than this share of the trainer's own move since the reference (mean |t - t_ref|): a stale "
        "engine leaves the whole move, a skipped layer its part; a healthy engine's numerics a small share once the "
        "policy moved far (0 leaves this condition out)")})

    def __post_init__(self) -> None:
        for name in ("every_n_syncs", "sequences", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Lag0ProbeConfig.{name}={v!r} is invalid: must be an integer >= 1")
        if self.max_tokens < 2:
            raise ValueError(f"Lag0ProbeConfig.max_tokens={self.max_tokens!r} is invalid: must be >= 2 (the first "
                             "token of a sequence has no log-prob)")
        checks = {
            "moved_factor": (self.moved_factor > 0, "must be > 0"),
            "moved_min": (self.moved_min > 0, "must be > 0"),
            "unchanged_ratio": (0 < self.unchanged_ratio < 1, "must be in (0, 1)"),
            "drift_factor": (self.drift_factor > 1, "must be > 1"),
            "drift_min": (self.drift_min >= 0, "must be >= 0"),
            "drift_share": (0 <= self.drift_share < 1, "must be in [0, 1)"),
        }
        for name, (ok, rule) in checks.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok:
                raise ValueError(f"Lag0ProbeConfig.{name}={v!r} is invalid: {rule}")


@dataclass
class ProbeScores:
    """One scoring of the fixed batch: the engine's and the trainer's [K, T] log-probs (float64, CPU) and the tokens
    both scored validly (``_mismatch_layout.valid_logprob_pair``: finite, no placeholder)."""

    engine: torch.Tensor
    trainer: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> "ProbeScores":
        if engine.shape != trainer.shape or engine.shape != mask.shape:
            raise ValueError(f"the probe's engine {tuple(engine.shape)}, trainer {tuple(trainer.shape)} and mask "
                             f"{tuple(mask.shape)} log-probs must have one shape")
        e, t = engine.detach().double().cpu(), trainer.detach().double().cpu()
        return cls(e, t, mask.detach().bool().cpu() & valid_logprob_pair(e, t))


def _mean_abs(x: torch.Tensor, valid: torch.Tensor) -> float:
    n = int(valid.sum())
    return float(x[valid].abs().sum()) / n if n else math.nan


class Lag0Probe:
    """The probe's state over a run: the reference scoring and its gap (the floor), the previous scoring (module
    docstring)."""

    def __init__(self, config: Lag0ProbeConfig | None = None) -> None:
        self.config = config if config is not None else Lag0ProbeConfig()
        self.reference: ProbeScores | None = None
        self.previous: ProbeScores | None = None
        self.floor = math.nan  # the reference's mean |e - t|
        self.syncs = 0  # syncs seen (due)
        self.history: list[dict] = []  # the last HISTORY judged probes' figures (a cause carries its own)
        self.carried_floor = math.nan  # the floor a checkpoint carried (load_state_dict), before this reference
        # the gap of the last probe that named nothing: the two stacks' lag-0 gap grows as training moves the policy
        # (0.05 -> 0.3 nats on SmolLM2 in bf16, tests/data), so a checkpoint carries the larger of it and the floor
        self.last_gap = math.nan
        self.reference_faulty = False  # the reference breached the carried floor: the engine was not at lag 0

    def set_reference(self, engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> float:
        """The lag-0 scoring both sides hold the same weights for; returns its gap (NaN: no token scored)."""
        scores = ProbeScores.of(engine, trainer, mask)
        gap = _mean_abs(scores.engine - scores.trainer, scores.valid)
        if math.isfinite(gap):
            self.reference = self.previous = scores
            self.reference_faulty = self._breaches(gap, self.carried_floor)
            self.floor = self.carried_floor if self.reference_faulty else gap
        return gap

    def _breaches(self, gap: float, floor: float) -> bool:
        c = self.config
        return math.isfinite(floor) and gap > c.drift_factor * floor and gap > floor + c.drift_min

    def judge_reference(self, step: int) -> list[Cause]:
        """The reference scoring against the floor a checkpoint carried (the module docstring): [] without a carried
        floor or a reference, or when it is in step."""
        if self.reference is None:
            return []
        ref, floor = self.reference, self.carried_floor
        gap = _mean_abs(ref.engine - ref.trainer, ref.valid)
        if not self._breaches(gap, floor):
            return []
        tokens, ratio = int(self.reference.valid.sum()), gap / floor if floor > 0 else math.inf
        return [Cause("probe-engine-drift", step,
                      f"at the first generation after the resume the engine's and the trainer's log-probs of the "
                      f"probe's {tokens} tokens differ by {gap:.3g} nats (mean per token), {ratio:.3g}x the two "
                      f"stacks' floor {floor:.3g} measured before the resume: the engine does not hold the weights "
                      f"the trainer resumed with",
                      evidence={"step": int(step), "gap": gap, "floor": floor, "tokens": tokens, "resumed": True})]

    def state_dict(self) -> dict:
        """What a checkpoint carries: the floor (the reference's, or the one carried into this run before it; the
        last healthy probe's gap where that is larger: the resumed run's reference is lag 0 at the checkpoint's
        policy, not the run's first), and the syncs seen (the ``every_n_syncs`` schedule goes on where it was)."""
        floor = self.floor if math.isfinite(self.floor) else self.carried_floor
        if math.isfinite(self.last_gap) and not floor >= self.last_gap:  # NaN floor: the gap alone
            floor = self.last_gap
        return {"floor": floor if math.isfinite(floor) else None, "syncs": self.syncs}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run's carried floor, which judges its first reference (``judge_reference``), and its syncs."""
        floor = (state or {}).get("floor")
        self.carried_floor = float(floor) if isinstance(floor, (int, float)) and not isinstance(floor, bool) \
            and math.isfinite(floor) and floor >= 0 else math.nan
        syncs = (state or {}).get("syncs")
        if isinstance(syncs, int) and not isinstance(syncs, bool) and syncs >= 0:
            self.syncs = syncs

    def due(self) -> bool:
        """One more sync happened: True when it is to be probed (every ``every_n_syncs``-th; the same answer on every
        rank, whether or not it holds the reference)."""
        self.syncs += 1
        return self.syncs % self.config.every_n_syncs == 0

    def judge(self, step: int, engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> list[Cause]:
        """The scoring right after a sync: the causes it names (the module docstring's rule), [] when in step."""
        if self.reference is None:
            raise RuntimeError("Lag0Probe.judge needs a reference scoring first (set_reference)")
        c, now, prev, ref = self.config, ProbeScores.of(engine, trainer, mask), self.previous, self.reference
        if now.engine.shape != ref.engine.shape:
            raise ValueError(f"the probe's batch changed shape: {tuple(now.engine.shape)} against the reference's "
                             f"{tuple(ref.engine.shape)}")
        valid = now.valid & prev.valid & ref.valid
        floor = self.floor
        gap = _mean_abs(now.engine - now.trainer, valid)
        moved_trainer = _mean_abs(now.trainer - prev.trainer, valid)
        moved_engine = _mean_abs(now.engine - prev.engine, valid)
        drift = _mean_abs((now.engine - now.trainer) - (ref.engine - ref.trainer), valid)
        moved_since_reference = _mean_abs(now.trainer - ref.trainer, valid)
        figures = {"step": int(step), "gap": gap, "floor": floor, "moved_trainer": moved_trainer,
                   "moved_engine": moved_engine, "drift": drift, "moved_since_reference": moved_since_reference,
                   "tokens": int(valid.sum())}
        self.history.append(figures)
        del self.history[:-HISTORY]
        # a token this scoring could not score keeps its last scored values: an empty or partly invalid scoring does
        # not shrink the next probe's comparison
        self.previous = ProbeScores(torch.where(now.valid, now.engine, prev.engine),
                                    torch.where(now.valid, now.trainer, prev.trainer), now.valid | prev.valid)
        if not math.isfinite(gap):
            return []
        causes = []
        if moved_trainer > max(c.moved_factor * floor, c.moved_min) and moved_engine < c.unchanged_ratio * moved_trainer:
            causes.append(Cause(
                "probe-engine-unchanged", step,
                f"after the weight sync the engine's log-probs of the probe's {figures['tokens']} tokens moved "
                f"{moved_engine:.3g} nats (mean per token) while the trainer's moved {moved_trainer:.3g} since the "
                f"previous probe (the two stacks' floor: {floor:.3g})", evidence=figures))
        elif self.reference_faulty:
            if self._breaches(gap, floor):
                causes.append(Cause(
                    "probe-engine-drift", step,
                    f"after the weight sync the engine's and the trainer's log-probs of the probe's "
                    f"{figures['tokens']} tokens still differ by {gap:.3g} nats (mean per token), "
                    f"{gap / floor if floor > 0 else math.inf:.3g}x the two stacks' floor {floor:.3g} measured "
                    f"before the resume: the engine does not hold the trainer's weights", evidence=figures))
            else:  # a sync reached the engine: this scoring is the lag-0 reference the resume's first one was not
                self.reference, self.reference_faulty = now, False
        elif (drift > c.drift_factor * floor and drift > floor + c.drift_min
              and drift > c.drift_share * moved_since_reference):
            causes.append(Cause(
                "probe-engine-drift", step,
                f"after the weight sync the engine's and the trainer's log-probs of the probe's {figures['tokens']} "
                f"tokens differ by {drift:.3g} nats (mean per token) more than at lag 0 before, "
                f"{drift / floor if floor > 0 else math.inf:.3g}x the two stacks' floor {floor:.3g} and "
                f"{drift / moved_since_reference if moved_since_reference > 0 else math.inf:.2g} of the trainer's "
                f"move since then ({moved_since_reference:.3g})", evidence=figures))
        if not causes and not self.reference_faulty:
            self.last_gap = gap
        return causes
