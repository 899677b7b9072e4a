"""The run's closing lines count windows, not steps (``tim_plugins.cause_registry.tally_window``): a TRL logging
window holds one weight sync per optimizer step, each sync cause carries its own sync's step, and the window names
the code once (``tim/cause/named``). Reference: the windows and steps written in each test, counted here."""

from __future__ import annotations

from tim_plugins.cause_registry import Cause, cause_fix
from tim_plugins.causes import CauseTracker

CODE = "sync-tensors-stale"


def _syncs(steps) -> list[Cause]:
    """The causes of faulty syncs, one per sync (after optimizer step s, as the sync check names it)."""
    return [Cause(CODE, s, f"at the weight sync after optimizer step {s}", tensors=("model.layers.1.q.weight",))
            for s in steps]


def _line(span: str, first: int) -> str:
    return (f"tim-plugins: this run named [{CODE}] {span} (first: at the weight sync after optimizer step {first}). "
            f"Fix (TRL): {cause_fix(CODE, 'trl')}")


def _expected_span(windows: dict[int, list[int]]) -> tuple[str, int]:
    """The span the closing line gives, from the windows fed ({window's last step: its faulty syncs' steps}), counted
    here: the windows holding a faulty sync, the lowest and highest of those syncs' steps."""
    named = [steps for steps in windows.values() if steps]
    first, last = min(min(s) for s in named), max(max(s) for s in named)
    n = len(named)
    if n == 1 and first == last:
        return f"at step {first}", first
    steps = f"at step {first}" if first == last else f"steps {first} to {last}"
    return f"in {n} window{'' if n == 1 else 's'}, {steps}", first


def _run(windows: dict[int, list[int]], tracker: CauseTracker | None = None) -> CauseTracker:
    tracker = tracker if tracker is not None else CauseTracker(framework="trl")
    for close, steps in windows.items():
        tracker.add_found(_syncs(steps))
        values, _ = tracker.evaluate(close, {}, sync=False)
        assert values["tim/cause/named"] == (1 if steps else 0)  # one code per window, however many syncs
    return tracker


def test_four_faulty_syncs_in_one_trl_window_are_one_window():
    """TRL, logging_steps=5: the window closed at step 5 holds the syncs after steps 1-4, all faulty. The old tally
    said "in 4 windows, steps 1 to 4" while ``tim/cause/named`` said one window."""
    windows = {5: [1, 2, 3, 4]}
    tracker = _run(windows)
    span, first = _expected_span(windows)
    assert span == "in 1 window, steps 1 to 4"
    assert tracker.summary_lines() == [_line(span, first)]
    assert {k: v for k, v in tracker.tally[CODE].items() if k != "message"} == {"first": 1, "last": 4, "windows": 1}


def test_windows_are_counted_once_each_and_a_lone_sync_says_its_step():
    windows = {5: [1, 2, 3, 4], 10: [5, 6, 7, 8, 9], 15: [], 20: [17]}
    tracker = _run(windows)
    span, first = _expected_span(windows)
    assert span == "in 3 windows, steps 1 to 17"
    assert tracker.summary_lines() == [_line(span, first)]
    lone = {5: [], 10: [7]}
    span, first = _expected_span(lone)
    assert span == "at step 7"
    assert _run(lone).summary_lines() == [_line(span, first)]


def test_verl_one_sync_per_window_is_unchanged():
    """verl syncs once per window (the sync after step s named in window s + 1): windows and syncs coincide."""
    windows = {s + 1: [s] for s in range(1, 6)}
    span, first = _expected_span(windows)
    assert span == "in 5 windows, steps 1 to 5"
    assert _run(windows).summary_lines() == [_line(span, first)]


def test_a_window_a_checkpoint_cut_counts_once_after_the_resume():
    """TRL's save_steps=2 inside a logging window of 5 steps: the syncs after steps 1-2 ride in the state
    (``CauseTracker.state_dict``'s window), those after 3-4 are found by the resumed attempt, and the window closed
    at step 5 names the code once; a later window adds one more. The tally's saved form loads as it was written."""
    before = CauseTracker(framework="trl")
    before.add_found(_syncs([1, 2]))
    resumed = CauseTracker(framework="trl")
    resumed.load_state_dict(before.state_dict())
    windows = {5: [3, 4], 10: [5, 6]}
    _run(windows, resumed)
    fed = {5: [1, 2, 3, 4], 10: [5, 6]}  # what the run's windows held, the checkpoint's part included
    span, first = _expected_span(fed)
    assert span == "in 2 windows, steps 1 to 6"
    assert resumed.summary_lines() == [_line(span, first)]
    again = CauseTracker(framework="trl")
    again.load_state_dict(resumed.state_dict())  # a state saved as a window closed: its tally only
    assert again.summary_lines() == [_line(span, first)]


def test_a_tally_saved_before_the_fix_still_loads():
    """The saved tally keeps its keys (first, last, windows, message): a state written by an earlier version loads
    and closes the run with its counts (a TRL window's syncs counted as windows there, as it was saved)."""
    old = {"floor": [], "named": [], "lag0_k3": float("nan"),
           "tally": {CODE: {"first": 1, "last": 4, "windows": 4, "message": "at the weight sync after optimizer "
                                                                             "step 1"}}}
    tracker = CauseTracker(framework="trl")
    tracker.load_state_dict(old)
    assert tracker.summary_lines() == [_line("in 4 windows, steps 1 to 4", 1)]
    _run({10: [5, 6]}, tracker)
    assert tracker.summary_lines() == [_line("in 5 windows, steps 1 to 6", 1)]


def test_a_cause_the_loss_passes_name_after_the_window_closed_counts_once_for_it():
    """verl's staleness rule runs after the window was closed (``evaluate_loss_passes``): its cause joins that window,
    and a second call for the same window names nothing new."""
    tracker = CauseTracker(framework="verl")
    split = {"tim/split/tokens": 100.0, "tim/split/staleness_var_share": 0.9, "tim/staleness/token/kl_k3": 0.05}
    for step in (3, 4):
        tracker.evaluate(step, {}, sync=False)
        tracker.evaluate_loss_passes(step, split)
        assert tracker.evaluate_loss_passes(step, split) == ({}, [])
    assert tracker.tally["staleness"]["windows"] == 2
    assert tracker.summary_lines()[0].startswith("tim-plugins: this run named [staleness] in 2 windows, steps 3 to 4")
