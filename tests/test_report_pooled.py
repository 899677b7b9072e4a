"""The by-lag and by-turn tables pool each label's logged windows by token count over the windows whose k3 is
finite, numerator and denominator together, and count the windows left out (k3 NaN, inf or not logged); checked
against a naive pooling written out here."""

from __future__ import annotations

import math

import pytest

from tim_plugins.report.page import Page
from tim_plugins.report.staleness import by_turn, lag_verdict, pooled_by, staleness_section

INF, NAN = float("inf"), float("nan")


def _windows(keying: str, windows: list[tuple[int, str, float, float | None]]) -> list[dict]:
    """log_history rows from (step, label, tokens, k3); k3 None: the window logged its count only."""
    rows: dict[int, dict] = {}
    for step, label, n, k3 in windows:
        row = rows.setdefault(step, {"step": step})
        row[f"tim/by_{keying}/{label}/count"] = n
        if k3 is not None:
            row[f"tim/by_{keying}/{label}/kl_k3"] = k3
    return list(rows.values())


def _naive(windows, label):
    """Token-weighted k3 over the finite windows of ``label``; (windows, tokens, +inf windows) of the others."""
    mine = [(n, k3) for _, lab, n, k3 in windows if lab == label and n > 0]
    fin = [(n, k3) for n, k3 in mine if k3 is not None and math.isfinite(k3)]
    out = [(n, k3) for n, k3 in mine if k3 is None or not math.isfinite(k3)]
    tokens = sum(n for n, _ in fin)
    return ((tokens, sum(n * k for n, k in fin) / tokens if tokens else NAN),
            (len(out), sum(n for n, _ in out), sum(1 for _, k in out if k == INF)))


WINDOWS = [(1, "0", 100, 2e-3), (2, "0", 100, NAN), (3, "0", 100, INF),  # the reviewer's case
           (1, "1", 40, 5e-3), (2, "1", 60, 7e-3), (3, "1", 10, None),
           (2, "2", 30, 9e-3), (3, "8+", 0, INF)]  # an empty window: no tokens, not a window


def test_the_pooled_k3_is_the_finite_windows_token_weighted_and_the_rest_is_counted():
    from tim_plugins.report.staleness import left_out_by

    history = _windows("lag", WINDOWS)
    lags, out = pooled_by(history, "lag"), left_out_by(history, "lag")
    assert list(lags) == ["0", "1", "2"]
    for label in lags:
        (tokens, k3), left = _naive(WINDOWS, label)
        assert lags[label] == (tokens, pytest.approx(k3, rel=1e-12))
        assert out.get(label, (0, 0, 0)) == left
    assert lags["0"] == (100.0, pytest.approx(2e-3))  # not 300 tokens at 6.7e-4
    assert out == {"0": (2, 200.0, 1), "1": (1, 10.0, 0)}
    # the by-turn table pools the same way
    assert by_turn(_windows("turn", WINDOWS)) == lags


def test_the_table_shows_the_windows_left_out_and_the_verdict_uses_the_finite_k3():
    history = _windows("lag", WINDOWS)
    page = Page("t", {})
    staleness_section(page, {"log_history": history, "framework": "trl"})
    flat = page.html().replace(" class='num'", "")
    assert "<th>left out: windows with k3 not finite (tokens)</th>" in flat
    assert "<tr><td>0</td><td>100</td><td>0.002</td><td>2 (200 tokens; 1 at +inf)</td></tr>" in flat
    k3 = (40 * 5e-3 + 60 * 7e-3) / 100
    assert f"<tr><td>1</td><td>100</td><td>{k3:.3g}</td><td>1 (10 tokens)</td></tr>" in flat
    assert "<tr><td>2</td><td>30</td><td>0.009</td><td>–</td></tr>" in flat
    assert "3 logged windows had a k3 that is not finite (1 at +inf" in flat
    total = (100 * 2e-3 + 40 * 5e-3 + 60 * 7e-3 + 30 * 9e-3) / 230
    assert f"{2e-3 / total:.2%} of the run&#x27;s k3 ({total:.3g})" in flat
    # every window finite: the table as before, no column
    page = Page("t", {})
    staleness_section(page, {"log_history": _windows("lag", [(1, "0", 10, 1e-3), (2, "1", 10, 3e-3)])})
    assert "left out" not in page.html()


def test_a_lag_without_any_finite_window_is_not_a_floor():
    history = _windows("lag", [(1, "0", 50, NAN), (2, "0", 50, INF), (1, "1", 20, 4e-3), (2, "odd", 5, 1.0)])
    lags = pooled_by(history, "lag")
    assert list(lags) == ["0", "1", "odd"]  # a label of another form after the numbers, not raised on
    assert lags["0"][0] == 0.0 and math.isnan(lags["0"][1])
    headline, _ = lag_verdict(lags, "trl")
    assert headline.startswith("No lag-0 window has a finite k3 (see the windows left out below), so the mismatch "
                               "floor is not observed; the lowest lag (1)")
    page = Page("t", {})
    staleness_section(page, {"log_history": history})
    assert "<td>0</td><td class='num'>0</td><td>–</td><td>2 (100 tokens; 1 at +inf)</td>" in page.html()
