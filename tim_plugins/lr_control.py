"""Response-length-triggered learning-rate decay: an early warning that shrinks the update before collapse.

Mismatch and gradient noise escalate together late in RL training, and a surge of the mean response length
comes before the collapse ("Beyond Precision", arXiv 2602.01826). The paper publishes no thresholds; this
controller makes the rule explicit, tunable, and replayable offline (``tim-plugins lr-replay``).

The rule, per signal s (the response length always; optionally ``kl_k3`` and ``grad_norm``), evaluated once per
optimizer step on finite observations x_t only:

  warm-up      the first ``warmup_steps`` finite observations (``rebaseline_steps`` after a trigger) only fill
               the buffers: b = median(x_1 .. x_N). Nothing can fire before b exists.
  window level w_t = median(x_{t-W+1} .. x_t) over the last W = ``window`` finite observations (a median, so a
               burst of fewer than ceil(W/2) steps never moves it: at the defaults, 1-2 step spikes are ignored).
  exceeds      e_t = [w_t > b_t · (1 + margin_s)] and [w_t > floor_s]
  baseline     after warm-up, b_{t+1} = b_t + α (w_t − b_t) with α = ``baseline_ema``, updated only while
               e_t is false, so a surge does not drag its own reference up.
  combine      c_t = e_t(length) OR any(e_t(extra))   (``combine="any"``)
               c_t = e_t(length) AND all(e_t(extra))  (``combine="all"``); an extra signal that is missing or
               still warming up counts as "not exceeding".
  fire         when c_t holds for ``patience`` consecutive finite observations outside cooldown.

On firing, ``mode="step"``: scale ← max(scale · decay_factor, min_lr_ratio); then ``cooldown`` calls without
firing, all baselines are forgotten and re-learnt from the next ``rebaseline_steps`` observations (the short
windows are kept). A surge is thus acted on once; if the length keeps surging from the new level, the
controller fires again.
``mode="linear"|"cosine"``: the first trigger starts a smooth decay of the scale from its value s0 to
``min_lr_ratio`` over K = ``decay_steps`` calls (n = calls since the trigger, counting the trigger call as 1):
  linear: s(n) = s0 + (min_lr_ratio − s0) · min(1, n/K)
  cosine: s(n) = min_lr_ratio + (s0 − min_lr_ratio) · (1 + cos(π · min(1, n/K))) / 2
and detection stops (the decay is already under way).

Missing, NaN, inf or negative lengths are skipped and counted (``tim/lr/skipped``): they change no buffer and
neither extend nor break the patience streak (cooldown and smooth decay count calls, so they do advance).
A call whose ``step`` is not larger than the last one seen is ignored and counted (``tim/lr/stale``), so an
adapter may call once per micro-batch and only the first call of each optimizer step counts.

All state is plain Python (ints, floats, lists, dicts, None) so ``state_dict()`` is JSON-serialisable and
``torch.save``-able; resuming from it reproduces the uninterrupted trajectory bit for bit.

Applying the scale to an optimizer and its LR scheduler lives in :mod:`tim_plugins.lr_scaling`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LRDecayConfig",
    "LengthTriggeredLRDecay",
    "EXTRA_SIGNALS",
    "SIGNAL_ALIASES",
    "MODES",
]

MODES = ("step", "linear", "cosine")
EXTRA_SIGNALS = ("kl_k3", "grad_norm")
# Keyword / metric-key spellings accepted by observe(**signals) for each extra signal.
SIGNAL_ALIASES: dict[str, str] = {
    "kl_k3": "kl_k3",
    "k3": "kl_k3",
    "tim/token/kl_k3": "kl_k3",
    "rollout_corr/k3_kl": "kl_k3",
    "grad_norm": "grad_norm",
    "actor/grad_norm": "grad_norm",
}
_STATE_VERSION = 1


@dataclass
class LRDecayConfig:
    """Options of :class:`LengthTriggeredLRDecay`. Defaults target a real GRPO/PPO run of a few hundred to a few
    thousand optimizer steps (mean response length per step over a batch of >= 64 responses)."""

    mode: str = field(default="step", metadata={
        "help": "'step': multiply the scale by decay_factor on each trigger; 'linear' / 'cosine': the first "
                "trigger starts a smooth decay to min_lr_ratio over decay_steps steps."})
    warmup_steps: int = field(default=20, metadata={
        "help": "Finite observations whose median becomes the first baseline; no trigger before. 20 steps: a "
                "median of 20 batch means is robust to a few outliers and costs ~1-5% of a typical run."})
    window: int = field(default=5, metadata={
        "help": "Length of the short window (median of the last N finite observations). 5 ignores 1-2 step "
                "spikes yet reacts within a few steps."})
    margin: float = field(default=0.25, metadata={
        "help": "Relative margin: the window must exceed baseline*(1+margin). The batch-mean length of a "
                "stable run wanders by ~5-10% step to step; 25% above a median of 5 is a clear surge."})
    patience: int = field(default=3, metadata={
        "help": "Consecutive steps the condition must hold before firing (with window=5, a burst must last "
                ">= 3 steps to fire)."})
    decay_factor: float = field(default=0.5, metadata={
        "help": "mode='step': scale <- max(scale*decay_factor, min_lr_ratio) on each trigger. Halving is the "
                "smallest change that visibly shrinks the update yet leaves room for 3 more triggers."})
    min_lr_ratio: float = field(default=0.1, metadata={
        "help": "Floor of the scale (fraction of the scheduled LR). Below ~0.1 an RL run stops learning."})
    cooldown: int = field(default=20, metadata={
        "help": "Steps after a trigger during which no trigger fires (the decay needs time to act on the "
                "length; matches warmup_steps so the new baseline is ready when cooldown ends)."})
    baseline_ema: float = field(default=0.02, metadata={
        "help": "EMA rate α of the baseline after warm-up (time constant ~1/α = 50 steps): follows the slow, "
                "healthy length growth of RL runs, not a surge that develops over 5-30 steps."})
    rebaseline_steps: int | None = field(default=None, metadata={
        "help": "Observations for the new baseline after a trigger (None: same as warmup_steps)."})
    decay_steps: int = field(default=200, metadata={
        "help": "mode='linear'/'cosine': steps K over which the scale goes to min_lr_ratio."})
    length_floor: float = field(default=0.0, metadata={
        "help": "Absolute level (tokens) the length window must also exceed; guards very short outputs "
                "where +25% is a handful of tokens."})
    signals: tuple = field(default=(), metadata={
        "help": "Extra signals to watch, from {kl_k3, grad_norm} (also spelt k3, tim/token/kl_k3, "
                "rollout_corr/k3_kl, actor/grad_norm), a tuple or a comma list (empty: length only)."})
    combine: str = field(default="any", metadata={
        "help": "How extra signals combine with the length: 'any' (length OR an extra fires) or 'all' "
                "(length AND every extra)."})
    kl_k3_margin: float = field(default=1.0, metadata={
        "help": "Relative margin for the k3 window (1.0: k3 doubled; k3 is noisy across orders of "
                "magnitude)."})
    kl_k3_floor: float = field(default=1e-3, metadata={
        "help": "The k3 window must also exceed this (dense bf16 runs sit at 1e-5..1e-3)."})
    grad_norm_margin: float = field(default=1.0, metadata={
        "help": "Relative margin for the grad-norm window (1.0: doubled)."})
    grad_norm_floor: float = field(default=0.0, metadata={
        "help": "The grad-norm window must also exceed this."})

    def __post_init__(self) -> None:
        if isinstance(self.signals, str):
            self.signals = tuple(s.strip() for s in self.signals.split(",") if s.strip())
        else:
            self.signals = tuple(self.signals)
        if self.mode not in MODES:
            raise ValueError(f"LRDecayConfig.mode={self.mode!r} is not one of {MODES}; pick one of them.")
        if self.combine not in ("any", "all"):
            raise ValueError(f"LRDecayConfig.combine={self.combine!r} must be 'any' or 'all'.")
        for name in self.signals:
            if name not in SIGNAL_ALIASES:
                raise ValueError(
                    f"LRDecayConfig.signals contains {name!r}; extra signals are {EXTRA_SIGNALS} (also spelt "
                    f"{sorted(set(SIGNAL_ALIASES) - set(EXTRA_SIGNALS))}; the length is always watched); remove it "
                    "or fix the spelling.")
        self.signals = tuple(SIGNAL_ALIASES[name] for name in self.signals)
        if len(set(self.signals)) != len(self.signals):
            raise ValueError(f"LRDecayConfig.signals={self.signals!r} lists a signal twice; list each once.")
        ints = {"warmup_steps": 1, "window": 1, "patience": 1, "cooldown": 0, "decay_steps": 1}
        for name, lo in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"LRDecayConfig.{name}={v!r} must be an integer >= {lo}.")
        if self.rebaseline_steps is not None and (
            isinstance(self.rebaseline_steps, bool) or not isinstance(self.rebaseline_steps, int)
            or self.rebaseline_steps < 1
        ):
            raise ValueError(
                f"LRDecayConfig.rebaseline_steps={self.rebaseline_steps!r} must be None or an integer >= 1.")

        def _num(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"LRDecayConfig.{name}={v!r} must be a finite number.")
            return float(v)

        if not 0.0 < _num("decay_factor") < 1.0:
            raise ValueError(
                f"LRDecayConfig.decay_factor={self.decay_factor!r} must be in (0, 1): it multiplies the LR "
                "scale on each trigger (0.5 halves it).")
        if not 0.0 < _num("min_lr_ratio") <= 1.0:
            raise ValueError(
                f"LRDecayConfig.min_lr_ratio={self.min_lr_ratio!r} must be in (0, 1]: it is the floor of the "
                "LR scale as a fraction of the scheduled LR (e.g. 0.1).")
        if not 0.0 < _num("baseline_ema") <= 1.0:
            raise ValueError(
                f"LRDecayConfig.baseline_ema={self.baseline_ema!r} must be in (0, 1] (EMA rate; 0.02 ≈ 50-step "
                "time constant).")
        for name in ("margin", "kl_k3_margin", "grad_norm_margin"):
            if _num(name) <= 0.0:
                raise ValueError(
                    f"LRDecayConfig.{name}={getattr(self, name)!r} must be > 0: it is a relative margin over "
                    "the baseline (0.25 = 25% above).")
        for name in ("length_floor", "kl_k3_floor", "grad_norm_floor"):
            if _num(name) < 0.0:
                raise ValueError(f"LRDecayConfig.{name}={getattr(self, name)!r} must be >= 0.")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (``signals`` as a list)."""
        d = dataclasses.asdict(self)
        d["signals"] = list(self.signals)
        return d


class _Tracker:
    """Baseline (warm-up median, then EMA) and short-window median of one signal. Plain Python floats."""

    __slots__ = ("margin", "floor", "window_size", "ema", "warmup_n", "warm", "window", "baseline", "level",
                 "exceed")

    def __init__(self, margin: float, floor: float, window_size: int, ema: float, warmup_n: int) -> None:
        self.margin, self.floor, self.window_size, self.ema = margin, floor, window_size, ema
        self.restart(warmup_n)

    def restart(self, warmup_n: int, keep_window: bool = False) -> None:
        """Forget the baseline (learn a new one from the next ``warmup_n`` values); the short window is kept
        on a re-baseline so the window level stays defined and plotted through it."""
        self.warmup_n = warmup_n
        self.warm: list[float] = []
        self.baseline: float | None = None
        self.exceed = False
        if not keep_window:
            self.window: list[float] = []
            self.level: float | None = None

    def update(self, x: float) -> None:
        self.window.append(x)
        del self.window[:-self.window_size]
        self.level = statistics.median(self.window)  # w_t = median of the last W finite values
        if self.baseline is None:
            self.warm.append(x)
            self.exceed = False
            if len(self.warm) >= self.warmup_n:
                self.baseline = statistics.median(self.warm)  # b = median of the warm-up values
                self.warm = []
            return
        # e_t = [w_t > b_t (1 + margin)] and [w_t > floor]
        self.exceed = self.level > self.baseline * (1.0 + self.margin) and self.level > self.floor
        if not self.exceed:
            self.baseline = self.baseline + self.ema * (self.level - self.baseline)  # b ← b + α (w − b)

    def state(self) -> dict[str, Any]:
        return {"warmup_n": self.warmup_n, "warm": list(self.warm), "window": list(self.window),
                "baseline": self.baseline, "level": self.level, "exceed": self.exceed}

    def load(self, s: Mapping[str, Any]) -> None:
        self.warmup_n = int(s["warmup_n"])
        self.warm = [float(v) for v in s["warm"]]
        saved = [float(v) for v in s["window"]]
        self.window = saved[-self.window_size:]  # a state saved with a larger window: its last window_size values
        self.baseline = None if s["baseline"] is None else float(s["baseline"])
        self.level = None if s["level"] is None else float(s["level"])
        if len(self.window) < len(saved):
            self.level = statistics.median(self.window)
        self.exceed = bool(s["exceed"])


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def _as_float(value: Any) -> float | None:
    """A finite Python float, or None for missing / non-numeric / NaN / inf values (never raises)."""
    if value is None:
        return None
    try:
        if hasattr(value, "item"):  # 0-d torch tensor or numpy scalar (one host read per optimizer step)
            value = value.item()
        out = float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return out if math.isfinite(out) else None


class LengthTriggeredLRDecay:
    """Watches the mean response length (and optionally k3 / grad norm) and returns the LR scale to apply.

    Call :meth:`observe` once per optimizer step; apply the returned scale to the next ``optimizer.step()``
    (see :func:`tim_plugins.lr_scaling.apply_lr_scale` or :class:`~tim_plugins.lr_scaling.ScaledLROptimizerMixin`).
    The rule is documented in the module docstring.

    Args:
        config: an :class:`LRDecayConfig` (default: its defaults).
        **overrides: field values replacing those of ``config`` (e.g. ``margin=0.3``).
    """

    def __init__(self, config: LRDecayConfig | None = None, **overrides: Any) -> None:
        base = config if config is not None else LRDecayConfig()
        if overrides:
            names = {f.name for f in dataclasses.fields(LRDecayConfig)}
            unknown = sorted(set(overrides) - names)
            if unknown:
                raise TypeError(
                    f"LengthTriggeredLRDecay got unknown option(s) {unknown}; valid options: {sorted(names)}.")
            base = dataclasses.replace(base, **overrides)
        self.config = base
        c = base
        self._rebaseline_n = c.rebaseline_steps if c.rebaseline_steps is not None else c.warmup_steps
        self._trackers: dict[str, _Tracker] = {
            "length": _Tracker(c.margin, c.length_floor, c.window, c.baseline_ema, c.warmup_steps)}
        for name in c.signals:
            self._trackers[name] = _Tracker(
                getattr(c, f"{name}_margin"), getattr(c, f"{name}_floor"), c.window, c.baseline_ema,
                c.warmup_steps)
        self._scale = 1.0
        self._calls = 0
        self._last_step: int | None = None
        self._triggered = False
        self._trigger_count = 0
        self._trigger_steps: list[int | None] = []
        self._skipped = 0
        self._stale = 0
        self._skipped_signals = {name: 0 for name in c.signals}
        self._streak = 0
        self._cooldown_left = 0
        self._decay_start: int | None = None  # call index of the trigger that started a smooth decay
        self._decay_from = 1.0
        self._fired_baseline: float | None = None  # the length baseline that the last trigger exceeded

    # ------------------------------------------------------------------ public API
    @property
    def scale(self) -> float:
        """The LR scale now in force (1.0 = scheduled LR)."""
        return self._scale

    @property
    def trigger_count(self) -> int:
        return self._trigger_count

    @property
    def trigger_steps(self) -> list[int | None]:
        """The ``step`` of every trigger so far (None where observe got ``step=None``)."""
        return list(self._trigger_steps)

    def observe(self, step: int | None, response_length: Any, **signals: Any) -> float:
        """Record one optimizer step's observations and return the LR scale in force from this step on.

        Args:
            step: the optimizer step (int, increasing) or None. A step not larger than the last int seen is
                ignored (counted in ``tim/lr/stale``).
            response_length: mean response length of the step's batch (float, numpy or 0-d tensor); missing,
                NaN, inf or negative values are skipped and counted in ``tim/lr/skipped``.
            **signals: optional ``kl_k3`` and ``grad_norm`` (aliases: ``tim/token/kl_k3``, ``k3``,
                ``rollout_corr/k3_kl``, ``actor/grad_norm``). Only those in ``config.signals`` are used;
                a non-finite one is skipped and counted. An unknown name raises ``TypeError``.
        """
        extras: dict[str, Any] = {}
        for key, value in signals.items():
            name = SIGNAL_ALIASES.get(key)
            if name is None:
                raise TypeError(
                    f"LengthTriggeredLRDecay.observe got unknown signal {key!r}; known: {sorted(SIGNAL_ALIASES)}.")
            extras[name] = value
        if step is not None:
            step = int(step)
            if self._last_step is not None and step <= self._last_step:
                self._stale += 1  # ignored: the counting call's state (tim/lr/triggered included) stands
                return self._scale
            self._last_step = step

        self._calls += 1
        self._triggered = False
        decaying = self._decay_start is not None
        if decaying:
            self._scale = self._smooth_scale(self._calls - self._decay_start + 1)
        in_cooldown = self._cooldown_left > 0
        if in_cooldown:
            self._cooldown_left -= 1

        length = _as_float(response_length)
        if length is None or length < 0.0:
            self._skipped += 1
            return self._scale
        self._trackers["length"].update(length)
        for name in self.config.signals:
            value = _as_float(extras.get(name))
            tracker = self._trackers[name]
            if value is None:
                self._skipped_signals[name] += 1
                tracker.exceed = False  # a missing extra never argues for a trigger
            else:
                tracker.update(value)

        length_tr = self._trackers["length"]
        if decaying or in_cooldown or length_tr.baseline is None:
            self._streak = 0
            return self._scale
        extra_ex = [self._trackers[n].exceed for n in self.config.signals]
        if self.config.combine == "any":
            hit = length_tr.exceed or any(extra_ex)  # c_t = e(length) OR any e(extra)
        else:
            hit = length_tr.exceed and all(extra_ex)  # c_t = e(length) AND all e(extra)
        self._streak = self._streak + 1 if hit else 0
        if self._streak >= self.config.patience:
            self._fire(step)
        return self._scale

    def metrics(self) -> dict[str, float]:
        """``tim/lr/*`` values after the last :meth:`observe` call. Undefined levels (no baseline yet, no
        finite observation yet) are NaN."""
        length = self._trackers["length"]
        out = {
            "tim/lr/scale": self._scale,
            "tim/lr/triggered": 1.0 if self._triggered else 0.0,
            "tim/lr/trigger_count": float(self._trigger_count),
            "tim/lr/baseline_length": _nan_if_none(
                self._fired_baseline if self._triggered and self.config.mode == "step" else length.baseline),
            "tim/lr/window_length": _nan_if_none(length.level),
            "tim/lr/skipped": float(self._skipped),
            "tim/lr/stale": float(self._stale),
            "tim/lr/streak": float(self._streak),
            "tim/lr/cooldown_left": float(self._cooldown_left),
        }
        for name in self.config.signals:
            tr = self._trackers[name]
            out[f"tim/lr/baseline_{name}"] = _nan_if_none(tr.baseline)
            out[f"tim/lr/window_{name}"] = _nan_if_none(tr.level)
            out[f"tim/lr/skipped_{name}"] = float(self._skipped_signals[name])
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python, JSON-serialisable state (no NaN/inf inside: non-finite inputs are never stored)."""
        return {
            "version": _STATE_VERSION,
            "config": self.config.to_dict(),
            "scale": self._scale,
            "calls": self._calls,
            "last_step": self._last_step,
            "triggered": self._triggered,
            "trigger_count": self._trigger_count,
            "trigger_steps": list(self._trigger_steps),
            "skipped": self._skipped,
            "stale": self._stale,
            "skipped_signals": dict(self._skipped_signals),
            "streak": self._streak,
            "cooldown_left": self._cooldown_left,
            "decay_start": self._decay_start,
            "decay_from": self._decay_from,
            "fired_baseline": self._fired_baseline,
            "trackers": {name: tr.state() for name, tr in self._trackers.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. The controller's own config is kept; a differing saved config
        is reported with a warning (tuning thresholds on resume is allowed). A signal watched now but absent
        from the saved state starts its warm-up afresh."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"LengthTriggeredLRDecay state version {state.get('version')!r} is not {_STATE_VERSION}; "
                "it was written by another tim-plugins release: start the controller afresh.")
        saved_cfg = dict(state.get("config") or {})
        now_cfg = self.config.to_dict()
        diff = sorted(k for k in now_cfg if k in saved_cfg and saved_cfg[k] != now_cfg[k])
        if diff:
            warnings.warn(
                "LengthTriggeredLRDecay: resuming with options that differ from the checkpoint's: "
                + ", ".join(f"{k}: {saved_cfg[k]!r} -> {now_cfg[k]!r}" for k in diff), stacklevel=2)
        self._scale = float(state["scale"])
        self._calls = int(state["calls"])
        self._last_step = None if state["last_step"] is None else int(state["last_step"])
        self._triggered = bool(state["triggered"])
        self._trigger_count = int(state["trigger_count"])
        self._trigger_steps = [None if s is None else int(s) for s in state["trigger_steps"]]
        self._skipped = int(state["skipped"])
        self._stale = int(state["stale"])
        saved_skips = state.get("skipped_signals", {})
        self._skipped_signals = {n: int(saved_skips.get(n, 0)) for n in self.config.signals}
        self._streak = int(state["streak"])
        self._cooldown_left = int(state["cooldown_left"])
        self._decay_start = None if state["decay_start"] is None else int(state["decay_start"])
        self._decay_from = float(state["decay_from"])
        fb = state.get("fired_baseline")
        self._fired_baseline = None if fb is None else float(fb)
        for name, tr in self._trackers.items():
            saved = state["trackers"].get(name)
            if saved is not None:
                tr.load(saved)
            else:
                tr.restart(self.config.warmup_steps)

    # ------------------------------------------------------------------ internals
    def _fire(self, step: int | None) -> None:
        c = self.config
        self._triggered = True
        self._trigger_count += 1
        self._trigger_steps.append(step)
        self._streak = 0
        if c.mode == "step":
            self._scale = max(self._scale * c.decay_factor, c.min_lr_ratio)  # s ← max(s·γ, s_min)
            self._cooldown_left = c.cooldown
            self._fired_baseline = self._trackers["length"].baseline
            for tr in self._trackers.values():
                tr.restart(self._rebaseline_n, keep_window=True)  # re-baseline: the surge level is the new normal
        else:
            self._decay_start = self._calls
            self._decay_from = self._scale
            self._scale = self._smooth_scale(1)

    def _smooth_scale(self, n: int) -> float:
        c = self.config
        frac = min(1.0, n / c.decay_steps)
        s0, lo = self._decay_from, c.min_lr_ratio
        if c.mode == "linear":
            return s0 + (lo - s0) * frac  # s(n) = s0 + (s_min − s0) · min(1, n/K)
        return lo + (s0 - lo) * (1.0 + math.cos(math.pi * frac)) / 2.0  # cosine from s0 to s_min
