"""The report's "Mismatch or staleness?" section from logged values: the per-step table, the pooled verdict (each
part's share of the log-ratio variance, weighted by tokens x Var(d), computed here independently) with the fix in
the run's framework, the by-lag table, and the mismatch-only case of a run without batch reuse."""

from __future__ import annotations

from html import escape as html_escape

import pytest

from tim_plugins.report.page import Page
from tim_plugins.fixes import part_fix
from tim_plugins.report.staleness import split_rows, staleness_section, staleness_verdict


def _step(step, tokens, var, s_share, m_share, lag_counts):
    row = {"step": step, "tim/split/tokens": tokens, "tim/split/total_var": var,
           "tim/split/staleness_var_share": s_share, "tim/split/mismatch_var_share": m_share,
           "tim/split/cov_share": 1 - s_share - m_share, "tim/staleness/token/kl_k3": 0.01 * s_share,
           "tim/token/kl_k3": 1e-4}
    for lag, (count, k3) in lag_counts.items():
        row[f"tim/by_lag/{lag}/count"], row[f"tim/by_lag/{lag}/kl_k3"] = count, k3
    return row


HISTORY = [
    {"step": 1, "loss": 0.1},  # a row without a split (TRL's own keys only)
    _step(1, 100, 2e-4, 0.0, 1.0, {"0": (100, 1e-4)}),
    _step(2, 100, 3e-3, 0.9, 0.08, {"1": (100, 2e-3)}),
    _step(3, 50, 1e-4, 0.0, 1.0, {"0": (50, 1.2e-4)}),
]


def _render(summary) -> str:
    page = Page("t", {})
    staleness_section(page, summary)
    return page.html()


def test_verdict_pools_the_shares_and_names_the_fix():
    rows = split_rows(HISTORY)
    assert [r["step"] for r in rows] == [1, 2, 3]
    w = [100 * 2e-4, 100 * 3e-3, 50 * 1e-4]
    stale = (w[1] * 0.9) / sum(w)
    mism = (w[0] * 1.0 + w[1] * 0.08 + w[2] * 1.0) / sum(w)
    headline, fix = staleness_verdict(rows, "trl")
    assert headline.startswith("Staleness dominates") and f"staleness {stale:.0%}" in headline
    assert f"mismatch {mism:.0%}" in headline and fix == part_fix("staleness", "trl")
    assert staleness_verdict(rows, "verl")[1] == part_fix("staleness", "verl")


def test_section_tables():
    html = _render({"log_history": HISTORY, "framework": "trl"})
    assert "Mismatch or staleness?" in html and "num_iterations=1" in html
    cells = html.replace(" class='num'", "")
    assert "<td>90.0%</td>" in cells and "<td>8.0%</td>" in cells  # step 2's shares
    # by lag: lag 0 pools steps 1 and 3 (token-weighted k3), lag 1 is step 2's
    k3_lag0 = (100 * 1e-4 + 50 * 1.2e-4) / 150
    flat = html.replace("\n", "").replace(" class='num'", "")
    assert f"<td>0</td><td>150</td><td>{k3_lag0:.3g}</td>" in flat
    assert "<td>1</td><td>100</td><td>0.002</td>" in flat


def test_without_reuse_the_verdict_is_mismatch_only():
    history = [_step(s, 80, 1e-4, 0.0, 1.0, {"0": (80, 1e-4)}) for s in (1, 2)]
    headline, fix = staleness_verdict(split_rows(history), "trl")
    assert headline.startswith("Mismatch only") and fix == part_fix("mismatch", "trl")


def test_identical_steps_fold_into_one_line():
    """40 steps without reuse: the same shares at every step, so one line instead of 40 identical rows; the mismatch
    k3 of each step (which does vary) is the k3 panel's."""
    history = [_step(s, 80, 1e-4 * (1 + s % 3), 0.0, 1.0, {"0": (80, 1e-4)}) for s in range(1, 41)]
    html = _render({"log_history": history, "framework": "trl"})
    assert "Each of the 40 steps alike: staleness 0.0% of Var(d), mismatch 100.0%" in html
    assert "<th>staleness share of Var(d)</th>" not in html  # no per-step table
    assert "<th>staleness share of Var(d)</th>" in _render({"log_history": HISTORY, "framework": "trl"})


def test_no_split_no_section():
    assert "Mismatch or staleness?" not in _render({"log_history": [{"step": 1, "loss": 0.1}]})
    assert split_rows([]) == []


@pytest.mark.parametrize("framework", [None, "verl"])
def test_fix_follows_the_framework(framework):
    html = _render({"log_history": HISTORY, "framework": framework})
    assert part_fix("staleness", framework).split(":")[0] in html


def test_by_turn_table_pools_the_steps_token_weighted():
    from tim_plugins.report.staleness import by_turn

    history = [dict(h) for h in HISTORY]
    history[1].update({"tim/by_turn/0/count": 60.0, "tim/by_turn/0/kl_k3": 1e-4,
                       "tim/by_turn/1/count": 40.0, "tim/by_turn/1/kl_k3": 3e-3})
    history[3].update({"tim/by_turn/0/count": 30.0, "tim/by_turn/0/kl_k3": 2e-4, "tim/by_turn/10/count": 0.0})
    turns = by_turn(history)
    assert list(turns) == ["0", "1"]  # an empty bucket is no turn
    assert turns["0"] == (90.0, pytest.approx((60 * 1e-4 + 30 * 2e-4) / 90))
    assert turns["1"] == (40.0, pytest.approx(3e-3))
    flat = _render({"log_history": history, "framework": "verl"}).replace("\n", "").replace(" class='num'", "")
    assert "By turn" in flat and f"<td>0</td><td>90</td><td>{(60 * 1e-4 + 30 * 2e-4) / 90:.3g}</td>" in flat
    assert "By turn" not in _render({"log_history": HISTORY, "framework": "trl"})  # single-turn: no table


def test_lag_only_runs_get_the_statistical_split():
    """A run that logs tim/by_lag/* but no split (AsyncGRPOTrainer: no π_old): the floor's share of the pooled k3,
    written out here, names the dominant part; without lag-0 tokens the verdict says the floor is unobserved."""
    from tim_plugins.report.staleness import lag_verdict, pooled_by

    history = [{"step": 1, "tim/by_lag/0/count": 30, "tim/by_lag/0/kl_k3": 1e-4,
                "tim/by_lag/1/count": 10, "tim/by_lag/1/kl_k3": 4e-3},
               {"step": 2, "tim/by_lag/0/count": 10, "tim/by_lag/0/kl_k3": 3e-4,
                "tim/by_lag/2/count": 20, "tim/by_lag/2/kl_k3": 9e-3}]
    lags = pooled_by(history, "lag")
    assert list(lags) == ["0", "1", "2"]
    floor = (30 * 1e-4 + 10 * 3e-4) / 40
    assert lags["0"] == (40.0, pytest.approx(floor, rel=1e-12))
    total = (30 * 1e-4 + 10 * 4e-3 + 10 * 3e-4 + 20 * 9e-3) / 70
    headline, fix = lag_verdict(lags, "trl")
    assert headline.startswith("Staleness dominates") and f"{floor / total:.2%}" in headline
    assert fix == part_fix("staleness_async", "trl")
    html = _render({"log_history": history, "framework": "verl"})
    assert "statistical: by policy lag" in html and html_escape(part_fix("staleness_async", "verl")) in html
    assert "By turn" not in html  # one turn only: no turn table
    # mismatch dominates when the lags barely add to the floor
    flat = {"0": (50.0, 1e-3), "1": (50.0, 1.1e-3)}
    assert lag_verdict(flat, "trl")[0].startswith("Mismatch dominates")
    assert lag_verdict(flat, "trl")[1] == part_fix("mismatch", "trl")
    headline, _ = lag_verdict({"2": (5.0, 1e-2), "3": (5.0, 2e-2)}, "trl")
    assert headline.startswith("No token trained at lag 0") and "(2)" in headline


def test_a_resumed_runs_repeated_steps_count_once_with_their_last_rows(tmp_path):
    """A run resumed from its step-1 checkpoint appends steps 2 and 3 again to log_history.jsonl: the report reads
    one row per step, the last (what training went on from), and pools the verdict over those three steps alone."""
    import json

    from tim_plugins.dump import LOG_HISTORY
    from tim_plugins.report import read_summary

    first = [_step(1, 100, 2e-4, 0.0, 1.0, {}), _step(2, 100, 3e-3, 0.9, 0.08, {}), _step(3, 50, 1e-4, 0.0, 1.0, {})]
    again = [_step(2, 100, 1e-3, 0.5, 0.5, {}), _step(3, 50, 2e-3, 0.2, 0.8, {})]
    (tmp_path / LOG_HISTORY).write_text("".join(json.dumps(r) + "\n" for r in first + again))
    history = read_summary(tmp_path)["log_history"]
    assert history == [first[0], *again]
    w = [100 * 2e-4, 100 * 1e-3, 50 * 2e-3]
    stale = (w[1] * 0.5 + w[2] * 0.2) / sum(w)
    headline, _ = staleness_verdict(split_rows(history), "verl")
    assert f"staleness {stale:.0%}" in headline, headline
