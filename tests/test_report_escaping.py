"""A summary.json is data: what it stores reaches the report's markup escaped, and what this version does not know
(a verdict line's status or source, a finding's code: a summary written by another version, or edited) is shown
neutrally instead of raised on."""

from __future__ import annotations

import html
import json
import re

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")

from tim_plugins.parity.findings import CODES, fix_for  # noqa: E402
from tim_plugins.report.health import SOURCES  # noqa: E402
from tim_plugins.report.page import Page  # noqa: E402
from tim_plugins.report.parity import findings_rows, reconcile  # noqa: E402

X = "<script>alert(1)</script>"
ATTR = "ok'><script>alert(2)</script><span class='"  # a status that would close the tag's class attribute


def _no_payload(page: str) -> None:
    assert "<script>" not in page and "<span class=''>" not in page
    assert X not in page and ATTR not in page


def test_a_verdict_line_s_status_is_one_of_the_fixed_tags_and_an_unknown_one_is_neutral():
    page = Page("t", SOURCES)
    page.verdict({"status": ATTR, "headline": "h" + X,
                  "lines": [["ok", "k3 fine", "k3"], ["watch", "tail high", "tail"], [ATTR, "text" + X, "k3"],
                            ["n/a", "nothing", None], [None, "no status", "not-a-source" + X], "not a line" + X]},
                 ["extra" + X])
    out = page.html()
    _no_payload(out)
    assert re.findall(r"<div class='verdict ([^']*)'>", out) == ["na"]  # an unknown overall status: neutral
    tags = re.findall(r"<span class='tag ([^']*)'>([^<]*)</span>", out)
    assert tags == [("ok", "OK"), ("watch", "WATCH"), ("na", "?"), ("na", "N/A"), ("na", "?"), ("na", "?")]
    assert html.escape("text" + X) in out and html.escape("extra" + X) in out and html.escape("h" + X) in out
    # the known sources keep their text; the unknown one is listed as its key, escaped
    assert html.escape(SOURCES["k3"]) in out and html.escape(SOURCES["tail"]) in out
    assert f"{html.escape('not-a-source' + X)} (no text for this source)" in out


def test_a_training_summary_with_markup_in_its_stored_verdict_renders_escaped(tmp_path):
    from tim_plugins.report import build_report

    (tmp_path / "summary.json").write_text(json.dumps({
        "kind": "training", "framework": "trl", "title": "t", "settings": {},
        "verdict": {"status": ATTR, "headline": "h", "lines": [[ATTR, "text", "k3"], ["act", "t2", "src" + X]]}}))
    out = build_report(tmp_path, threads=1).read_text()
    _no_payload(out)
    assert re.findall(r"<span class='tag ([^']*)'>([^<]*)</span>", out)[:2] == [("na", "?"), ("act", "ACT")]


def test_a_measure_summary_with_markup_in_setting_and_baseline_renders_escaped(tmp_path):
    from tim_plugins.report import build_report

    base, other = "base" + X, "other" + X
    (tmp_path / "summary.json").write_text(json.dumps({
        "kind": "measure", "baseline": base, "primary": base,
        "comparisons": {base: {"tim/token/kl_k3": 1e-4}, other: {"tim/token/kl_k3": 1e-8}},
        "verdict": {"status": "ok", "setting": "set" + X, "headline": "h", "lines": [[ATTR, "x", "k3"]]}}))
    out = build_report(tmp_path, threads=1).read_text()
    _no_payload(out)
    assert f"Verdict for <b>{html.escape('set' + X)}</b>" in out
    assert f"the baseline of the comparison is <b>{html.escape(base)}</b>" in out


def _finding(code, severity="error", **more):
    return {"code": code, "severity": severity, "message": "m" + X, "rollout": "r", "trainer": "t", **more}


def test_a_finding_code_this_version_does_not_know_renders_generically():
    known = _finding("dtype-mismatch")
    future = _finding("from-a-newer-version" + X, detail="kv-cache fp8", level=3)
    rows = findings_rows([known, future], "trl")
    # the known code: the registry's knob for the run's framework (an independent look-up)
    assert rows[0] == ["error", "dtype-mismatch", "r", "t", "m" + X, fix_for(CODES["dtype-mismatch"].fix, "trl")]
    assert rows[1][:5] == ["error", "from-a-newer-version" + X, "r", "t", "m" + X]
    assert rows[1][5] == ("no fix known for code from-a-newer-version" + X + " in this version of tim-plugins (a "
                          "summary written by another version?); its other stored fields: detail: kv-cache fp8; "
                          "level: 3")
    # an unknown code with a stored fix: the stored fix, picked for the framework like a known one's
    assert findings_rows([_finding("newer", fix={"trl": "GRPOConfig(x=1)", "verl": "y=1"})], "verl")[0][5] == "y=1"
    # a finding stored without most fields: shown as missing, not raised on
    assert findings_rows([{"code": "bare"}], None)[0][:5] == ["None", "bare", None, None, None]
    # an unknown error raises the status like a known one and is named in the headline
    v = reconcile({"status": "ok", "headline": "OK: fine.", "lines": []}, [future], "trl")
    assert v["status"] == "watch" and "from-a-newer-version" + X in v["headline"]
    assert v["extra"][0].startswith(f"from-a-newer-version{X} (m{X}): fix it (TRL): no fix known for code")


def test_a_training_report_with_an_unknown_finding_code_renders(tmp_path):
    from tim_plugins.report import build_report

    (tmp_path / "summary.json").write_text(json.dumps({
        "kind": "training", "framework": "trl", "title": "t", "settings": {},
        "findings": [_finding("from-a-newer-version" + X, detail="d" + X), _finding("dtype-mismatch", "warning")]}))
    out = build_report(tmp_path, threads=1).read_text()
    _no_payload(out)
    assert html.escape("no fix known for code from-a-newer-version" + X) in out
    assert html.escape("its other stored fields: detail: d" + X) in out


def test_training_and_comparison_reports_with_a_finding_missing_its_fields_render(tmp_path):
    """A stored finding without a code or a severity (an edited or truncated summary.json): both pages render,
    the finding shown with what it has, the other findings counted as usual."""
    from tim_plugins.report import build_comparison, build_report

    runs = []
    for name in ("a", "b"):
        run = tmp_path / name
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({
            "kind": "training", "framework": "trl", "title": name, "settings": {},
            "findings": [{"message": "no code, no severity" + X}, _finding("dtype-mismatch", "error")]}))
        runs.append(run)
    out = build_report(runs[0], threads=1).read_text()
    _no_payload(out)
    assert html.escape("no code, no severity" + X) in out and "dtype-mismatch" in out
    page = build_comparison(runs, tmp_path / "compare.html", threads=1).read_text()
    _no_payload(page)
    assert "dtype-mismatch" in page
