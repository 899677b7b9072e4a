"""The named causes in the report's verdict (``tim_plugins.report.causes``): the rule of its module docstring, on
summaries written the way the pipeline writes them (causes.jsonl beside a dump, tim/cause/* in log_history)."""

from __future__ import annotations


import pytest

from tim_plugins.causes import Cause
from tim_plugins.dump import append_causes, append_log_history, write_summary
from tim_plugins.report import read_summary
from tim_plugins.report.causes import name_causes, read_causes, with_causes
from tim_plugins.report.health import verdict


def _ok_verdict():
    return verdict({"tim/token/kl_k3": 1e-5}, ("tim/token/kl_k3",))


def test_causes_round_trip_through_the_dump_folder(tmp_path):
    causes = [Cause("sync-tensors-stale", 3, "the sync left 2 tensors", tensors=("a.weight", "b.weight")),
              Cause("engine-stale", 4, "5 of 9 confident tokens", evidence={"x": float("nan")})]
    append_causes(tmp_path, causes[:1])
    append_causes(tmp_path, causes[1:])
    with open(tmp_path / "causes.jsonl", "a") as f:
        f.write('{"code": "torn')  # a run killed mid-write
    rows = read_causes(tmp_path)
    assert rows == [c.to_dict() for c in causes] and rows[1]["evidence"] == {"x": None}
    write_summary(tmp_path, framework="trl", title="t", settings={})
    assert read_summary(tmp_path)["causes"] == rows
    assert with_causes({"causes": []}, tmp_path) == {"causes": []}  # a summary's own list wins
    assert read_causes(tmp_path / "nowhere") is None


def test_a_broken_sync_makes_the_verdict_act_and_leads_it():
    v = _ok_verdict()
    assert v["status"] == "ok"
    summary = {"causes": [Cause("sync-noop", 1, "none updated").to_dict(),
                          Cause("floor-jump", 2, "jumped").to_dict(), Cause("sync-noop", 5, "again").to_dict()]}
    name_causes(v, summary, "trl")
    assert v["status"] == "act" and v["causes"] == {"sync-noop": [1, 5], "floor-jump": [2]}
    assert v["headline"].startswith("ACT: the engine sampled from other weights than the trainer scored: sync-noop "
                                    "(first at step 1), floor-jump (first at step 2).")
    assert v["headline"].endswith("Measured: every checked metric is inside its healthy range.")
    assert v["extra"][0].startswith("sync-noop at steps 1, 5: none updated. Fix (TRL): ")
    assert v["extra"][1].startswith("floor-jump at step 2: jumped. Fix (TRL): ")


def test_a_kept_prefix_cache_alone_says_so_in_the_headline():
    v = name_causes(_ok_verdict(), {"causes": [Cause("sync-prefix-cache", 1, "4 blocks").to_dict()]}, "trl")
    assert v["status"] == "act" and v["causes"] == {"sync-prefix-cache": [1]}
    assert v["headline"].startswith("ACT: the engine sampled through keys and values its prefix cache kept from "
                                    "earlier weights: sync-prefix-cache (first at step 1). ")
    assert "Fix (TRL): TRL's VLLMGeneration.sync_weights ends with the engine's reset_prefix_cache" in v["extra"][0]
    both = {"causes": [Cause("sync-prefix-cache", 1, "4 blocks").to_dict(), Cause("floor-jump", 2, "x").to_dict()]}
    assert name_causes(_ok_verdict(), both, "verl")["headline"].startswith(
        "ACT: the engine sampled from other weights than the trainer scored: sync-prefix-cache (first at step 1), "
        "floor-jump (first at step 2).")


@pytest.mark.parametrize("status", ["ok", "watch", "act"])
def test_staleness_raises_to_watch_at_least(status):
    v = _ok_verdict()
    v["status"] = status
    name_causes(v, {"causes": [Cause("staleness", 3, "80 %").to_dict()]}, "verl")
    assert v["status"] == {"ok": "watch"}.get(status, status)
    assert v["headline"].startswith(f"{v['status'].upper()}: staleness makes the log-ratio unhealthy")
    assert ("Fix (verl): a lower actor_rollout_ref.actor.optim.lr, or fewer updates per batch: "
            "actor_rollout_ref.actor.ppo_epochs=1") in v["extra"][0]


def test_none_named_says_what_was_checked(tmp_path):
    for step, checked in ((1, 27.0), (2, 27.0)):
        append_log_history(tmp_path, step, {"tim/cause/named": 0.0, "tim/cause/confident_disagreements": 0.0,
                                            "tim/cause/floor_jump": 1.4 if step == 2 else float("nan"),
                                            "tim/cause/sync_checked_tensors": checked})
    v = name_causes(_ok_verdict(), read_summary(tmp_path), "trl")
    assert v["status"] == "ok" and v["causes"] == {}
    (line,) = v["extra"]
    assert line.startswith("What is causing it: no broken weight sync, stale engine or floor jump was named over 2 "
                           "logged steps (no confident lag-0 disagreement; the lag-0 floor at most 1.4x")
    assert "(2 windows, 27 tensors each)" in line
    assert line.endswith("the mismatch measured is the two stacks' numerics.")
    assert name_causes(_ok_verdict(), {"log_history": [{"step": 1}]}, None)["extra"] == []  # nothing watched


@pytest.mark.parametrize("code", ["sampler-penalties-unmatched", "sampler-truncation-unmatched"])
def test_none_named_under_sampler_processing_the_trainer_does_not_recompute_says_so(tmp_path, code):
    """A fault-free run whose sampler applies a repetition penalty (or a truncation) the trainer does not: the
    floor moves with that processing's bias and is not judged (tim_plugins.causes), so the line does not call the
    measured mismatch numerics alone, and a floor over a trailing median of 0 (inf) is no ratio to quote."""
    floors = {1: float("nan"), 2: 3.4, 3: float("inf"), 4: 1.2}
    for step, ratio in floors.items():
        append_log_history(tmp_path, step, {"tim/cause/named": 0.0, "tim/cause/confident_disagreements": 0.0,
                                            "tim/cause/floor_jump": ratio, "tim/cause/sync_checked_tensors": 27.0})
    write_summary(tmp_path, framework="trl", title="t", settings={},
                  findings=[{"code": code, "severity": "error"}, {"code": "dtype-mismatch", "severity": "error"}])
    v = name_causes(_ok_verdict(), read_summary(tmp_path), "trl")
    (line,) = v["extra"]
    # the inf is said as what it is; the rule's margin is not claimed for it: the floor was not judged here
    assert ("the lag-0 floor at most 3.4x its trailing median where that median was above 0, and above a trailing "
            "median of 0 in 1 window, not judged: it is the bias of the sampler ") in line
    assert "floor_jump_min" not in line
    assert line.endswith("the mismatch measured is the two stacks' numerics plus the bias of sampler processing the "
                         f"trainer does not recompute (the audit's {code}: its fix column).")
    assert "infx" not in line


def _floor_ratios(floors, factor, min_gap, window):
    """FloorHistory's rule written out: each value against the median of the trailing kept values (NaN before any;
    inf over a median of 0); a jumped value is not kept."""
    import statistics

    kept, ratios = [], []
    for f in floors:
        if not kept:
            ratios.append(float("nan"))
            kept.append(f)
            continue
        median = statistics.median(kept[-window:])
        ratio = f / median if median > 0 else (float("inf") if f > 0 else 1.0)
        ratios.append(ratio)
        if not (ratio > factor and f - median > min_gap):
            kept.append(f)
    return ratios


@pytest.mark.parametrize("floors", [[0.0, 0.0, 0.02, 0.011, 0.012], [0.0, 0.03]])
def test_a_floor_over_a_trailing_median_of_0_is_said_so_not_hidden(tmp_path, floors):
    """A fault-free run whose lag-0 floor reads exactly 0 at first (docs/causes.md: TRL with bf16=True) and then a few
    hundredths of a nat: the logged ratio is inf, not named (under the rule's floor_jump_min margin above 0). The
    line says the floor rose above a trailing median of 0 within that margin, and quotes the largest finite ratio
    only for the windows whose median was above 0, never as the run's largest."""
    import math

    from tim_plugins.causes import CauseConfig, CauseTracker

    config = CauseConfig()
    tracker = CauseTracker(framework="trl")
    logged = []
    for step, floor in enumerate(floors, 1):
        values, found = tracker.evaluate(step, {"tim/token/abs_diff_mean": floor, "tim/tokens": 1000.0}, sync=False)
        assert not found
        logged.append(values["tim/cause/floor_jump"])
        append_log_history(tmp_path, step, values)
    want = _floor_ratios(floors, config.floor_jump_factor, config.floor_jump_min, config.floor_window)
    assert [r if not math.isnan(r) else None for r in logged] == [r if not math.isnan(r) else None for r in want]
    write_summary(tmp_path, framework="trl", title="t", settings={}, findings=[])
    (line,) = name_causes(_ok_verdict(), read_summary(tmp_path), "trl")["extra"]
    zero = sum(1 for r in want if r == math.inf)
    finite = [r for r in want if math.isfinite(r) and not math.isnan(r)]
    above = (f"above a trailing median of 0 in {zero} window{'' if zero == 1 else 's'}, by no more than the rule's "
             f"floor_jump_min margin ({config.floor_jump_min:g} nats by default)")
    if finite:
        assert (f"the lag-0 floor at most {max(finite):.2g}x its trailing median where that median was above 0, "
                f"and {above})") in line
    else:
        assert f"(no confident lag-0 disagreement; the lag-0 floor {above}):" in line
    assert line.endswith("the mismatch measured is the two stacks' numerics.")
