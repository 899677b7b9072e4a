"""ParityProbe: thresholds on real mismatch metrics, warn / raise / stop, every-N, patience, state."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from tim_plugins.metrics import mismatch_metrics
from tim_plugins.parity import ParityError, ParityProbe, ParityProbeConfig


def _metrics(shift: float, seed: int = 0) -> dict:
    """Real metrics of a batch whose train log-probs differ from the rollout's by `shift` on token (0, 0)."""
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(4, 9, generator=gen) * 3
    train = rollout.clone()
    train[0, 0] += shift
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[3] = False  # a fully masked row
    return mismatch_metrics(rollout, train, mask)


def _k3(d: float, n: int) -> float:
    # k3 = mean over valid tokens of e^d − d − 1; only one token has d != 0
    return (math.exp(d) - d - 1) / n


def test_metrics_fixture_matches_naive_formula():
    m = _metrics(0.5)
    assert m["tim/token/kl_k3"] == pytest.approx(_k3(0.5, 27), rel=1e-5)
    assert m["tim/token/abs_diff_max"] == pytest.approx(0.5, rel=1e-6)
    assert m["tim/seq/log_ratio_abs_max"] == pytest.approx(0.5, rel=1e-6)


def test_warn_logs_step_and_values(caplog):
    probe = ParityProbe(kl_k3_max=1e-3, abs_diff_max=0.3, action="warn")
    assert not probe.check(1, _metrics(0.01)).tripped  # k3 = 1.9e-6, |d| = 0.01
    with caplog.at_level(logging.WARNING, logger="tim_plugins.parity"):
        decision = probe.check(2, _metrics(0.5))  # k3 = 4.0e-3 > 1e-3, |d| = 0.5 > 0.3
    assert decision.tripped and decision.action == "warn" and not decision.stop
    assert {t.key for t in decision.trips} == {"tim/token/kl_k3", "tim/token/abs_diff_max"}
    k3 = next(t for t in decision.trips if t.key == "tim/token/kl_k3")
    assert k3.value == pytest.approx(_k3(0.5, 27), rel=1e-5) and k3.threshold == 1e-3 and k3.step == 2
    assert "step 2" in caplog.text and "tim/token/kl_k3=0.00" in caplog.text
    assert [t.step for t in probe.trips] == [2, 2]


def test_raise_carries_the_decision():
    probe = ParityProbe(seq_log_ratio_abs_max=0.2, kl_k3_max=None, action="raise")
    probe.check(0, _metrics(0.1))
    with pytest.raises(ParityError, match="tim/seq/log_ratio_abs_max") as err:
        probe.check(1, _metrics(-0.3))
    assert err.value.trip.trips[0].value == pytest.approx(0.3, rel=1e-6)


def test_stop_asks_the_framework_to_stop():
    decision = ParityProbe(kl_k3_max=1e-4, action="stop").check(5, _metrics(1.0))
    assert decision.stop and decision.action == "stop"


def test_every_n_steps_and_patience():
    probe = ParityProbe(kl_k3_max=1e-4, action="stop", every_n_steps=3, patience=2)
    bad = _metrics(1.0)
    d1 = probe.check(1, bad)
    assert not d1.checked and not d1.tripped  # not due
    d3 = probe.check(3, bad)
    assert d3.tripped and d3.action is None and not d3.stop  # first of two needed
    d6 = probe.check(6, bad)
    assert d6.stop
    probe.check(9, _metrics(0.0))  # a clean check resets the count
    assert not probe.check(12, bad).stop
    assert probe.num_checks == 4


def test_a_named_cause_is_acted_on_in_its_window_due_or_not_and_without_patience():
    """A one-off cause (a sync that failed once) is named in one window only: the probe acts on it there, on a step
    its threshold check is not due and before its patience runs out, and that does not count as a threshold check.
    The cause count comes from the cause tracker that names it (``CauseTracker.evaluate``)."""
    from tim_plugins.causes import Cause, CauseTracker

    probe = ParityProbe(kl_k3_max=1e-4, action="stop", every_n_steps=4, patience=3)
    tracker = CauseTracker()
    clean = _metrics(0.0)
    tracker.add_found([Cause("sync-noop", 1, "the sync left every checked tensor as it was")])
    named, found = tracker.evaluate(1, clean, sync=False)
    assert [c.code for c in found] == ["sync-noop"] and named["tim/cause/named"] == 1.0
    d1 = probe.check(1, {**clean, **named})
    assert d1.stop and d1.tripped and not d1.checked and [t.key for t in d1.trips] == ["tim/cause/named"]
    d2 = probe.check(2, {**clean, **tracker.evaluate(2, clean, sync=False)[0]})  # not named again
    assert not d2.tripped and not d2.stop
    assert probe.num_checks == 0 and probe.state_dict()["consecutive"] == 0
    # the thresholds keep their every-N and patience: a bad k3 alone acts at the third due check
    bad = _metrics(1.0)
    assert [probe.check(s, bad).stop for s in (3, 4, 8, 12)] == [False, False, False, True]
    raising = ParityProbe(kl_k3_max=1e-4, action="raise", every_n_steps=4)
    with pytest.raises(ParityError, match="tim/cause/named=1"):
        raising.check(5, {**clean, "tim/cause/named": 1.0})
    assert not raising.check(6, {**clean, "tim/cause/named": float("nan")}).tripped


def test_a_cause_named_on_a_due_check_under_the_limits_does_not_count_towards_patience():
    """A due check whose thresholds pass, in a window that names a cause: the cause is acted on there (warn here),
    and the check is a clean one for patience, which counts consecutive threshold trips; so the first threshold trip
    after it is 1 of ``patience``, not 2 (also across a checkpoint)."""
    probe = ParityProbe(kl_k3_max=1e-3, patience=2, action="stop")
    d1 = probe.check(1, {**_metrics(0.0), "tim/cause/named": 1.0})
    assert d1.checked and d1.stop and [t.key for t in d1.trips] == ["tim/cause/named"]
    assert probe.state_dict()["consecutive"] == 0
    resumed = ParityProbe(kl_k3_max=1e-3, patience=2, action="stop")
    resumed.load_state_dict(probe.state_dict())
    for p in (probe, resumed):
        assert [p.check(s, _metrics(1.0)).stop for s in (2, 3)] == [False, True]


def test_nan_and_missing_metrics_are_skipped_not_raised():
    probe = ParityProbe(kl_k3_max=1e-4, abs_diff_max=0.1, action="raise")
    empty = mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    decision = probe.check(0, {**empty, "tim/token/kl_k3": float("nan")})
    assert not decision.tripped and "tim/token/kl_k3" in decision.skipped
    decision = probe.check(1, {})
    assert set(decision.skipped) == {"tim/token/kl_k3", "tim/token/abs_diff_max"}
    with pytest.raises(ParityError):  # +inf is a real (infinite) mismatch
        probe.check(2, {"tim/token/kl_k3": float("inf")})


def test_state_dict_round_trip():
    probe = ParityProbe(kl_k3_max=1e-4, patience=3)
    probe.check(0, _metrics(1.0))
    probe.check(1, _metrics(1.0))
    other = ParityProbe(kl_k3_max=1e-4, patience=3)
    other.load_state_dict(probe.state_dict())
    assert other.check(2, _metrics(1.0)).action == "warn"  # third consecutive trip acts
    assert [t.step for t in other.trips] == [0, 1, 2]


def test_a_probe_that_warns_every_step_keeps_the_last_trips_and_counts_them_all():
    """A warn-only probe tripping at every step of a long run: its state (saved in every checkpoint) keeps the last
    ``TRIPS_KEPT`` trips and the count of all of them, also across a save and load."""
    from tim_plugins.parity.probe import TRIPS_KEPT

    probe = ParityProbe(kl_k3_max=1e-4)
    metrics = _metrics(1.0)
    n = TRIPS_KEPT + 44
    for step in range(n):
        probe.check(step, metrics)
    assert [t.step for t in probe.trips] == list(range(n - TRIPS_KEPT, n)) and probe.num_trips == n
    other = ParityProbe(kl_k3_max=1e-4)
    other.load_state_dict(probe.state_dict())
    other.check(n, metrics)
    assert [t.step for t in other.trips] == list(range(n - TRIPS_KEPT + 1, n + 1)) and other.num_trips == n + 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(action="explode"), "action='explode'"),
    (dict(every_n_steps=0), "every_n_steps=0"),
    (dict(kl_k3_max=-1.0), "kl_k3_max=-1.0"),
    (dict(kl_k3_max=None), "every threshold is None"),
])
def test_config_errors_quote_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        ParityProbeConfig(**kwargs)


def _naive_due(last_checked, step, n):
    """The window rule spelt out: a multiple of ``n`` among the steps since the last check (from step 1)."""
    return any(m % n == 0 for m in range((last_checked or 0) + 1, step + 1))


@pytest.mark.parametrize("window,n", [(3, 2), (2, 3), (1, 2), (5, 5), (4, 6), (7, 3)])
def test_a_check_is_due_when_its_window_holds_a_multiple_of_every_n_steps(window, n):
    """An adapter that checks once per logging window of ``window`` steps (TRL: ``logging_steps``): each call is
    judged against the naive rule; a window longer than ``every_n_steps`` is checked every time (``step % n`` alone
    would check only the common multiples: never before step 6 with windows of 3 and n=2), and a bad window stops the
    run at the first due window."""
    probe = ParityProbe(kl_k3_max=1e-4, action="warn", every_n_steps=n)
    last, checked = None, []
    for step in range(window, 60, window):
        expected = _naive_due(last, step, n)
        decision = probe.check(step, _metrics(0.0))
        assert decision.checked == expected, (step, last)
        if expected:
            last = step
            checked.append(step)
    assert probe.num_checks == len(checked) > 0
    if window >= n:
        assert checked == list(range(window, 60, window))
    stopping = ParityProbe(kl_k3_max=1e-4, action="stop", every_n_steps=n)
    first_due = next(s for s in range(window, 60, window) if _naive_due(None, s, n))
    assert [s for s in range(window, 60, window) if stopping.check(s, _metrics(1.0)).stop][0] == first_due


def test_a_window_with_no_measured_value_is_not_a_check():
    """A window whose every threshold metric is missing or NaN (TRL: a step that trains a reused batch,
    ``num_iterations > 1``) neither counts towards ``patience`` nor resets it, and the due step it held stays due:
    patience 2 over measured, unmeasured, measured windows acts at the second measured one; with ``every_n_steps=2``
    and every due step unmeasured, the next measured window is checked."""
    nothing = {"tim/token/kl_k3": float("nan")}
    probe = ParityProbe(kl_k3_max=1e-4, abs_diff_max=0.1, action="stop", patience=2)
    d1 = probe.check(1, _metrics(1.0))
    assert d1.checked and d1.tripped and not d1.stop
    d2 = probe.check(2, nothing)
    assert not d2.checked and not d2.tripped and set(d2.skipped) == {"tim/token/kl_k3", "tim/token/abs_diff_max"}
    assert d2.metrics() == {"tim/probe/tripped": 0.0, "tim/probe/checked": 0.0}
    assert probe.state_dict()["consecutive"] == 1
    assert probe.check(3, _metrics(1.0)).stop
    assert probe.num_checks == 2
    partial = ParityProbe(kl_k3_max=1e-4, abs_diff_max=0.1, action="stop", patience=2)
    partial.check(1, _metrics(1.0))
    assert partial.check(2, {"tim/token/abs_diff_max": 0.0}).checked  # one value measured: a (clean) check
    assert partial.state_dict()["consecutive"] == 0
    # every_n_steps=2 and the batch reused every other step: each due step (2, 4, ...) is unmeasured
    every2 = ParityProbe(kl_k3_max=1e-4, action="stop", every_n_steps=2, patience=2)
    seen = [every2.check(s, _metrics(1.0) if s % 2 else nothing) for s in range(1, 7)]
    assert [d.checked for d in seen] == [False, False, True, False, True, False]
    assert [d.stop for d in seen] == [False, False, False, False, True, False]


def test_the_last_check_is_saved_and_an_older_state_still_loads():
    """The step of the last check rides in ``state_dict`` (a resumed run judges its first window from there); a
    state saved before it was kept (no ``last_checked``) loads, and its first window is judged from step 1."""
    probe = ParityProbe(kl_k3_max=1e-4, every_n_steps=4)
    probe.check(4, _metrics(0.0))
    probe.check(6, _metrics(0.0))
    state = probe.state_dict()
    assert state["last_checked"] == 4
    resumed = ParityProbe(kl_k3_max=1e-4, every_n_steps=4)
    resumed.load_state_dict(state)
    assert not resumed.check(7, _metrics(0.0)).checked and resumed.check(9, _metrics(0.0)).checked
    old = {k: v for k, v in state.items() if k != "last_checked"}
    legacy = ParityProbe(kl_k3_max=1e-4, every_n_steps=4)
    legacy.load_state_dict(old)
    assert legacy.num_checks == 1 and legacy.check(7, _metrics(0.0)).checked
    fresh = ParityProbe(kl_k3_max=1e-4, every_n_steps=4)
    fresh.load_state_dict(fresh.state_dict())  # a state with no check yet (None) round-trips
    assert not fresh.check(3, _metrics(0.0)).checked and fresh.check(5, _metrics(0.0)).checked
