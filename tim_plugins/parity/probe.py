"""Live parity probe: thresholds on the monitor's metrics, checked every N steps, with an action on a trip.

The probe judges the windows an adapter hands it (``check(step, metrics)``: the metrics of the steps since its last
call; verl: one step, TRL: one logging window). A check is due when a multiple of ``every_n_steps`` lies in the steps
since the last check, (last checked step, step]: a window that spans several steps is judged whenever it contains a
due step, so logging every 3 steps with ``every_n_steps=2`` checks every window, and every step with
``every_n_steps=2`` checks every second one. A due call whose every threshold metric is missing or NaN (a window with
no measured tokens: a step that trains a reused batch) is not a check: it neither counts towards ``patience`` nor
resets it, and the due step stays pending for the next call.

Adapters feed it the dict from `MismatchMonitor.compute()` (or `mismatch_metrics(...)`) and act on the
returned `ProbeDecision`: ``warn`` logs, ``raise`` raises `ParityError`, ``stop`` sets
``decision.stop = True`` (TRL: ``control.should_save = control.should_training_stop = True``; verl: save a
checkpoint and end the loop). Every trip is logged with the step and the metric values, and the last
``TRIPS_KEPT`` are kept in `probe.trips` (saved by `state_dict()`; `probe.num_trips` counts them all: a probe that
warns every step of a long run would otherwise grow every checkpoint). A missing or NaN metric never trips: it is counted in
`decision.skipped` (diagnostics do not crash training on bad input).

A named cause (``tim/cause/named`` > 0 in the metrics: a broken weight sync, a stale engine, ...,
``tim_plugins.causes``) trips the probe too, whatever its limits, and is acted on in the window it is named in: on a
step that is not due (``every_n_steps``) and before ``patience`` runs out. A one-off cause (a sync that failed once)
is not named again, so waiting for a later check would never act on it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

from tim_plugins.parity.findings import ParityError

__all__ = ["ParityProbe", "ParityProbeConfig", "check_probe_values", "ProbeDecision", "Trip", "PROBE_ACTIONS", "DEFAULT_METRIC_KEYS",
           "TRIPS_KEPT"]

logger = logging.getLogger("tim_plugins.parity")

PROBE_ACTIONS = ("warn", "raise", "stop")
TRIPS_KEPT = 256
# config field → metric key of tim_plugins.metrics
DEFAULT_METRIC_KEYS = {
    "kl_k3_max": "tim/token/kl_k3",
    "abs_diff_max": "tim/token/abs_diff_max",
    "seq_log_ratio_abs_max": "tim/seq/log_ratio_abs_max",
}
# Named causes trip the probe at any limit (tim_plugins.causes.CAUSE_KEYS[0]).
CAUSE_KEY = "tim/cause/named"


@dataclass
class ParityProbeConfig:
    """Thresholds (None = not checked) and what to do when one is exceeded."""

    kl_k3_max: Optional[float] = field(
        default=1e-3, metadata={"help": "trip when tim/token/kl_k3 > this (dense models run 1e-5..1e-3)"})
    abs_diff_max: Optional[float] = field(
        default=None, metadata={"help": "trip when tim/token/abs_diff_max (max |Δ log p| over tokens) > this"})
    seq_log_ratio_abs_max: Optional[float] = field(
        default=None, metadata={"help": "trip when tim/seq/log_ratio_abs_max (max |Σ_t Δ log p|) > this"})
    action: str = field(default="warn", metadata={"help": "warn | raise | stop"})
    every_n_steps: int = field(default=1, metadata={"help": (
        "check the thresholds on a window (the steps since the last check) that holds a multiple of every_n_steps "
        "(a named cause is acted on at any step)")})
    patience: int = field(default=1, metadata={"help": (
        "act after this many consecutive tripped checks; a window with no measured tokens is no check "
        "(a named cause: at once)")})

    def __post_init__(self) -> None:
        check_probe_values({f.name: getattr(self, f.name) for f in fields(self)})
        if all(getattr(self, name) is None for name in DEFAULT_METRIC_KEYS):
            raise ValueError("ParityProbeConfig: every threshold is None, so the probe can never trip; set at "
                             f"least one of {list(DEFAULT_METRIC_KEYS)}")


def check_probe_values(values: Mapping[str, Any], where: Callable[[str], str] = "ParityProbeConfig.{}".format) -> None:
    """The rule of each probe option, for ``ParityProbeConfig`` and for an adapter's spelling of it (``where``
    turns a field name into the name the user wrote): a ValueError quoting the first bad value."""
    for name, value in values.items():
        if name == "action":
            ok, rule = value in PROBE_ACTIONS, f"must be one of {PROBE_ACTIONS}"
        elif name in ("every_n_steps", "patience"):
            ok, rule = not isinstance(value, bool) and isinstance(value, int) and value >= 1, "must be an integer >= 1"
        elif name in DEFAULT_METRIC_KEYS:
            ok = value is None or (not isinstance(value, bool) and isinstance(value, (int, float))
                                   and math.isfinite(value) and value >= 0)
            rule = "must be a finite number >= 0 or None"
        else:
            continue
        if not ok:
            raise ValueError(f"{where(name)}={value!r} is invalid: {rule}")


@dataclass
class Trip:
    """One exceeded threshold at one step."""

    step: int
    key: str
    value: float
    threshold: float

    def to_dict(self) -> dict:
        return {"step": self.step, "key": self.key, "value": self.value, "threshold": self.threshold}


@dataclass
class ProbeDecision:
    """What the adapter should do after `ParityProbe.check`."""

    step: int
    checked: bool = False
    tripped: bool = False
    action: Optional[str] = None  # the action to take now (None when nothing to do)
    stop: bool = False  # ask the framework to checkpoint and stop gracefully
    trips: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # threshold keys whose metric was missing / NaN
    message: Optional[str] = None  # what tripped, when the action is due (the ParityError's text for "raise")

    def metrics(self) -> dict:
        """`tim/probe/*` values for the logger."""
        return {"tim/probe/tripped": float(self.tripped), "tim/probe/checked": float(self.checked)}

    def merged(self, later: "ProbeDecision") -> "ProbeDecision":
        """This decision and a ``later`` one of the same step (``ParityProbe.check_causes``) as one: what tripped in
        either, and the action due in either (one probe, one action)."""
        message = "; ".join(m for m in (self.message, later.message) if m) or None
        return ProbeDecision(step=later.step, checked=self.checked or later.checked,
                             tripped=self.tripped or later.tripped, action=self.action or later.action,
                             stop=self.stop or later.stop, trips=self.trips + later.trips,
                             skipped=self.skipped + later.skipped, message=message)


class ParityProbe:
    """Check mismatch metrics against thresholds every N steps and decide warn / raise / stop."""

    def __init__(self, config: Optional[ParityProbeConfig] = None, **options: Any):
        if config is not None and options:
            raise ValueError("ParityProbe(config, **options): pass either a config or keyword options, not both")
        self.config = config if config is not None else ParityProbeConfig(**options)
        self.trips: list[Trip] = []
        self.num_trips = 0
        self._consecutive = 0
        self.num_checks = 0
        self._last_checked: Optional[int] = None  # the step of the last check (None: none yet)

    def due(self, step: int) -> bool:
        """Whether a check at ``step`` is due: a multiple of ``every_n_steps`` lies in (last checked step, step],
        the steps since the start (step 1) before the first check. A step at or before the last check (a restarted
        step count) falls back to its own rule: due when it is a multiple."""
        step, n = int(step), int(self.config.every_n_steps)
        if step % n == 0:
            return True
        last = 0 if self._last_checked is None or self._last_checked > step else self._last_checked
        return step // n > last // n

    def check(self, step: int, metrics: Mapping[str, float], *, raise_on_trip: bool = True) -> ProbeDecision:
        """Compare `metrics` (a `mismatch_metrics` / `MismatchMonitor.compute()` dict) with the thresholds.

        Raises `ParityError` when the action is ``raise`` and the probe trips (after `patience` checks; a named
        cause at once, due or not), unless ``raise_on_trip=False``: then the decision (``action="raise"``,
        ``message``) goes to whoever acts on it (verl: the decision is made in the actor workers, the driver
        raises).
        """
        decision = ProbeDecision(step=int(step))
        if self.due(step):
            self._thresholds(step, metrics, decision)
            # a window without one threshold value measured nothing (a reused batch's step): no check, so the
            # patience count neither grows nor resets, and the due step waits for the next window
            if len(decision.skipped) < self._num_thresholds:
                decision.checked = True
                self.num_checks += 1
                self._last_checked = int(step)
        return self._decide(decision, metrics.get(CAUSE_KEY), raise_on_trip)

    @property
    def _num_thresholds(self) -> int:
        return sum(getattr(self.config, name) is not None for name in DEFAULT_METRIC_KEYS)

    def check_causes(self, step: int, named: float, *, raise_on_trip: bool = True) -> ProbeDecision:
        """The decision on causes named after ``check`` ran for ``step`` (``named`` = the window's
        ``tim/cause/named``): no threshold is checked and the patience count is left as it was."""
        return self._decide(ProbeDecision(step=int(step)), named, raise_on_trip)

    def _decide(self, decision: ProbeDecision, named, raise_on_trip: bool) -> ProbeDecision:
        """Add the named causes' trip to ``decision`` (its thresholds checked, or not due) and act."""
        step = decision.step
        cause = named is not None and float(named) > 0  # NaN compares False
        if cause:  # acted on in the window it is named in, due or not, without patience: it does not come back
            decision.trips.append(Trip(step, CAUSE_KEY, float(named), 0.0))
        if decision.checked:  # patience counts the checks whose thresholds tripped: a cause is acted on apart
            self._consecutive = self._consecutive + 1 if any(t.key != CAUSE_KEY for t in decision.trips) else 0
        if not decision.trips:
            return decision
        self.trips.extend(decision.trips)
        self.num_trips += len(decision.trips)
        del self.trips[:-TRIPS_KEPT]
        decision.tripped = True
        desc = ", ".join(f"{t.key}={t.value:.6g} > {t.threshold:.6g}" for t in decision.trips)
        if self._consecutive < self.config.patience and not cause:
            logger.warning("tim parity probe: step %d: %s (%d/%d before acting)", step, desc, self._consecutive,
                           self.config.patience)
            return decision
        decision.action = self.config.action
        decision.message = f"tim parity probe tripped at step {step}: {desc}"
        logger.warning("tim parity probe tripped at step %d: %s (action: %s)", step, desc, self.config.action)
        if self.config.action == "stop":
            decision.stop = True
        elif self.config.action == "raise" and raise_on_trip:
            raise ParityError(decision.message, trip=decision)
        return decision

    def _thresholds(self, step: int, metrics: Mapping[str, float], decision: ProbeDecision) -> None:
        """The thresholds' trips (and skipped keys) of a due check, into ``decision``."""
        for name, key in DEFAULT_METRIC_KEYS.items():
            threshold = getattr(self.config, name)
            if threshold is None:
                continue
            value = metrics.get(key)
            if value is None:
                decision.skipped.append(key)
                continue
            value = float(value)
            if math.isnan(value):
                decision.skipped.append(key)
                continue
            if value > threshold:  # +inf trips: an infinite mismatch is a real finding
                decision.trips.append(Trip(int(step), key, value, float(threshold)))

    def state_dict(self) -> dict:
        return {"trips": [t.to_dict() for t in self.trips], "num_trips": self.num_trips,
                "consecutive": self._consecutive, "num_checks": self.num_checks, "last_checked": self._last_checked}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.trips = [Trip(**t) for t in state.get("trips", [])][-TRIPS_KEPT:]
        self.num_trips = int(state.get("num_trips", len(state.get("trips", []))))
        self._consecutive = int(state.get("consecutive", 0))
        self.num_checks = int(state.get("num_checks", 0))
        # a state without the key: the first window after the resume is judged from step 1, so no due step is
        # missed (at worst one check comes early)
        last = state.get("last_checked")
        self._last_checked = None if last is None else int(last)
