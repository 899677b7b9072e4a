"""The report's line for a run that named no cause (``tim_plugins.report.causes``) says what the confident-token rules
did with the confident lag-0 disagreements: not judged where the parity audit found ``sampler-truncation-unmatched``
(``tim_plugins.causes``), else below the threshold of each window, not of the run's total. Each run is a real
``CauseTracker`` fed lag-0 batches whose disagreements are written in the test, its ``tim/cause/*`` logged as the
pipeline logs them; the counts the line gives are recomputed here from what was fed."""

from __future__ import annotations

import math

import pytest
import torch

from tim_plugins.causes import CauseConfig, CauseTracker
from tim_plugins.dump import append_log_history, write_summary
from tim_plugins.report import read_summary
from tim_plugins.report.causes import name_causes
from tim_plugins.report.health import verdict

TRUNCATION = "sampler-truncation-unmatched"
UNJUDGED = ("not judged: the engine's log-probs are renormalised over the tokens the sampler kept (the audit's "
            "sampler-truncation-unmatched), which moves a confident token that far on any weights")


def _batch(disagreeing: int, n: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One [1, n] lag-0 batch: every token confident (p = 0.9), the first ``disagreeing`` scored 3 nats lower by the
    trainer (past confident_gap = 2), the others equal."""
    rollout = torch.full((1, n), math.log(0.9))
    train = rollout.clone()
    train[0, :disagreeing] -= 3.0
    return rollout, train, torch.ones(1, n, dtype=torch.bool)


def _line(windows: int, part: str, audit: list[str]) -> str:
    """The whole line, its parts as the report words them (no floor: these windows log no lag-0 floor; no sync)."""
    measured = ("the two stacks' numerics plus the bias of sampler processing the trainer does not recompute (the "
                f"audit's {', '.join(sorted(audit))}: its fix column)" if audit else "the two stacks' numerics")
    return (f"What is causing it: no broken weight sync, stale engine or floor jump was named over {windows} logged "
            f"steps ({part}): the mismatch measured is {measured}.")


def _run(tmp_path, per_window: list[int], audit: list[str]) -> str:
    """A run of one window per entry of ``per_window`` (its confident disagreements) under the audit's ``audit``
    error codes: the tracker's tim/cause/* in log_history, the audit in the summary. Returns the report's line."""
    tracker = CauseTracker(framework="trl")
    tracker.audited(audit)
    for step, k in enumerate(per_window, start=1):
        tracker.update(*_batch(k))
        values, found = tracker.evaluate(step, {}, sync=False)
        assert found == [] and values["tim/cause/named"] == 0  # the run names nothing: the line under test is said
        assert values["tim/cause/confident_disagreements"] == k
        append_log_history(tmp_path, step, values)
    write_summary(tmp_path, framework="trl", title="t", settings={},
                  findings=[{"code": code, "severity": "error"} for code in audit])
    v = name_causes(verdict({"tim/token/kl_k3": 1e-5}, ("tim/token/kl_k3",)), read_summary(tmp_path), "trl")
    assert v["causes"] == {}
    (line,) = v["extra"]
    return line


def test_disagreements_under_an_unmatched_truncation_are_not_judged(tmp_path):
    """Two windows of 5 confident disagreements each, over the threshold of 2 in each: the old line said "10
    confident lag-0 disagreements (below the threshold)"; the rules never read them (the kept-mass renormalisation)."""
    per_window = [5, 5]
    threshold = CauseConfig().confident_min_tokens
    assert all(k >= threshold for k in per_window)  # every window over the threshold: no "below" can be true
    line = _run(tmp_path, per_window, [TRUNCATION])
    assert line == _line(2, f"{sum(per_window)} confident lag-0 disagreements, {UNJUDGED}", [TRUNCATION])
    assert "below the" not in line


def test_none_under_an_unmatched_truncation_is_not_judged_either(tmp_path):
    line = _run(tmp_path, [0, 0, 0], [TRUNCATION])
    assert line == _line(3, f"no confident lag-0 disagreement, {UNJUDGED}", [TRUNCATION])


@pytest.mark.parametrize("audit", [[], ["sampler-penalties-unmatched"]])
def test_judged_disagreements_are_below_the_threshold_of_each_window_not_of_the_total(tmp_path, audit):
    """One disagreement in three windows of four (threshold 2): the run's total, 3, is not below it; each window's
    count is. Under sampler-penalties-unmatched the counts are judged too (for sampler-constrained)."""
    per_window = [1, 0, 1, 1]
    threshold = CauseConfig().confident_min_tokens
    assert sum(per_window) >= threshold > max(per_window)
    line = _run(tmp_path, per_window, audit)
    said = (f"{sum(per_window)} confident lag-0 disagreements (at most {max(per_window)} in a window: below the "
            f"rule's per-window threshold)")
    assert line == _line(len(per_window), said, audit)


def test_one_window_says_its_count_is_below_the_threshold(tmp_path):
    line = _run(tmp_path, [1], [])
    assert line == _line(1, "1 confident lag-0 disagreement (below the rule's per-window threshold)", [])


def test_causes_the_log_counts_but_no_causes_file_holds_are_never_nothing_named(tmp_path):
    """A run that named a cause (a real tracker: 5 confident disagreements in its second window, over the
    threshold) whose causes.jsonl is not beside its dump: the report cannot say which cause, and says that, at least
    WATCH, instead of "no ... was named". With the file the cause is named as usual (the same log)."""
    from tim_plugins.dump import append_causes
    from tim_plugins.report.causes import with_causes

    tracker = CauseTracker(framework="trl")
    tracker.audited([])
    named = []
    for step, k in enumerate([0, 5], start=1):
        tracker.update(*_batch(k))
        values, found = tracker.evaluate(step, {}, sync=False)
        append_log_history(tmp_path, step, values)
        named += [(step, c) for c in found]
    assert [s for s, _ in named] == [2] and values["tim/cause/named"] == len(found) >= 1
    write_summary(tmp_path, framework="trl", title="t", settings={}, findings=[])
    calm = verdict({"tim/token/kl_k3": 1e-5}, ("tim/token/kl_k3",))
    assert calm["status"] == "ok"

    v = name_causes(dict(calm), with_causes(read_summary(tmp_path), tmp_path), "trl")
    assert v["causes"] == {} and v["status"] == "watch"
    n = len(found)
    assert v["extra"] == [
        f"What is causing it: the run's log counts {n} named cause{'' if n == 1 else 's'} (tim/cause/named at step 2), "
        "but no causes.jsonl beside its dump holds them, so this report cannot say which: the run's console printed "
        "each with its fix when it was named, and its closing lines list them."]

    append_causes(tmp_path, [c for _, c in named], window=2)
    v = name_causes(dict(calm), with_causes(read_summary(tmp_path), tmp_path), "trl")
    assert v["causes"] == {c.code: [2] for _, c in named}
    assert not any("cannot say which" in line for line in v["extra"])
