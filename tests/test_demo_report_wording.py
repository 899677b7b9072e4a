"""What a TRL user reads in the demo's report and help: the batch-invariance row's fix is TRL's, the ESS panel
draws no verl line on a TRL run, the verdict's audit line counts what the audit tables show, and `demo --help`
quotes the measured run time."""

from __future__ import annotations

import html as html_mod
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")

from test_report_figures import _synthetic_run, drawn  # noqa: E402, F401  (fixture)

from tim_plugins.parity.findings import CODES, make_finding  # noqa: E402
from tim_plugins.report import build_report  # noqa: E402
from tim_plugins.report.health import RULES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _finding(code, severity):
    return make_finding(code, severity, f"{code} message", "a", "b").to_dict()


def _demo_run(tmp_path, framework="trl"):
    """A run folder shaped like the demo's: the callback's findings (TRL's generation with the trainer's model),
    the audit of the bf16 rollout copy the demo samples with, the dtype mismatch declared deliberate."""
    run = _synthetic_run(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    summary.update({
        "framework": framework,
        "findings": [_finding("batch-invariance-off", "info"), _finding("prefix-caching-on", "warning")],
        "own_audit": [_finding("dtype-mismatch", "error"), _finding("lm-head-precision-mismatch", "warning"),
                      _finding("batch-invariance-off", "info")],
        "deliberate": {"dtype-mismatch": "the bfloat16 rollout is deliberate in this demo",
                       "lm-head-precision-mismatch": "the bfloat16 rollout is deliberate in this demo"},
        "attached": {"rollout_source": "custom", "hooks": [], "config": {}},
    })
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def _tables(page: str) -> list[list[list[str]]]:
    """Every table of the page as rows of unescaped cell texts (header row first)."""
    out = []
    for table in re.findall(r"<table>(.*?)</table>", page, re.S):
        rows = []
        for row in re.findall(r"<tr>(.*?)</tr>", table, re.S):
            rows.append([html_mod.unescape(re.sub(r"<[^>]+>", "", c))
                         for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)])
        out.append(rows)
    return out


def _audit_tables(page: str) -> list[list[dict]]:
    return [[dict(zip(t[0], r)) for r in t[1:]] for t in _tables(page) if t and t[0][:2] == ["severity", "code"]]


def test_batch_invariance_fix_cell_is_trl_s_in_a_trl_run(tmp_path):
    page = build_report(_demo_run(tmp_path)).read_text()
    tables = _audit_tables(page)
    assert len(tables) == 2
    cells = [row["fix (TRL)"] for t in tables for row in t if row["code"] == "batch-invariance-off"]
    assert len(cells) == 2 and set(cells) == {CODES["batch-invariance-off"].fix["trl"]}
    cell = cells[0]
    # a TRL knob first (TIMConfig), vLLM's variable only as where to set it when TRL runs vLLM; no duplicated name
    assert cell.index("TIMConfig(rollout='exact')") < cell.index("VLLM_BATCH_INVARIANT=1")
    assert "trl vllm-serve" in cell and not cell.startswith("VLLM")
    assert "tim-plugins: tim-plugins" not in html_mod.unescape(page)


def test_a_tim_plugins_command_is_not_prefixed_with_its_own_name(tmp_path):
    from tim_plugins.parity.findings import fix_for

    bi = CODES["batch-invariance-off"].fix
    assert fix_for(bi, "hf") == bi["tim_plugins"] and bi["tim_plugins"].startswith("tim-plugins measure")
    unknown = CODES["unknown-setting"].fix  # the audit's own flags, where no framework has words of its own
    assert fix_for(unknown, "vllm") == unknown["tim_plugins"] and unknown["tim_plugins"].startswith("tim-plugins audit")
    other = {"tim_plugins": "fill the field in PipelineSpec"}  # a tim-plugins knob that is not a command keeps its name
    assert fix_for(other, "trl") == "tim-plugins: fill the field in PipelineSpec"


@pytest.mark.parametrize("framework,label", [("trl", "warning"), ("verl", "verl warning"), (None, "warning")])
def test_ess_panel_names_verl_only_on_a_verl_run(drawn, tmp_path, framework, label):  # noqa: F811
    build_report(_demo_run(tmp_path, framework))
    series = drawn[0]
    ess = next(ax for ax in series.axes if ax.get_visible() and ax.get_title().startswith(("ESS", "IS weight ESS")))
    texts = [t.get_text().strip() for t in ess.texts]
    warn = RULES["tim/is/ess"].act_lo
    assert f"{label}: ESS < {warn:g}" in texts
    if framework != "verl":
        assert not any("verl" in t for ax in series.axes for t in [ax.get_title(), *(x.get_text() for x in ax.texts)])


def test_audit_line_counts_what_the_tables_show(tmp_path):
    page = build_report(_demo_run(tmp_path)).read_text()
    callback, own = _audit_tables(page)

    def tally(rows):
        severities = [r["severity"] for r in rows]
        return (severities.count("error"), severities.count("error (deliberate here)"), severities.count("warning"))

    assert tally(callback) == (0, 0, 1) and tally(own) == (0, 1, 0)
    assert [r["severity"] for r in own if r["code"] == "lm-head-precision-mismatch"] == ["warning (deliberate here)"]
    text = html_mod.unescape(re.sub(r"<[^>]+>", "", page))
    line = re.search(r"Parity audit: [^\n]*?the rollout model actually used [^;]*?warnings?[^.]*\.", text).group(0)
    # the counts over both tables: no error to fix, the deliberate one apart (as its cell says); one warning, and
    # one deliberate here (as its cell says)
    assert line.startswith("Parity audit: 0 errors to fix, 1 deliberate here (dtype-mismatch); 1 warning "
                           "(prefix-caching-on), 1 deliberate here (lm-head-precision-mismatch).")
    # and per table, in the tables' own words
    assert "the callback's view (TRL's generation with the trainer's model) 0 errors, 1 warning;" in line
    assert ("the rollout model actually used 0 errors (+1 deliberate here), 0 warnings (+1 deliberate here)."
            in line)
    assert "0 errors, 0 warnings" not in text  # the old line that read as contradicting the second table


def test_an_accidental_error_is_counted_to_fix(tmp_path):
    from tim_plugins.report.training_page import audit_line

    findings = [_finding("temperature-mismatch", "error")]
    own = [_finding("dtype-mismatch", "error")]
    line = audit_line(findings, own, {"dtype-mismatch": "on purpose"})
    assert line.startswith("Parity audit: 1 error to fix (temperature-mismatch), 1 deliberate here (dtype-mismatch);"
                           " 0 warnings.")
    assert audit_line([], None, {}) == "Parity audit: 0 errors to fix; 0 warnings."


def test_demo_help_quotes_the_measured_time():
    from tim_plugins.apps.cli import build_parser

    parser = build_parser()
    demo = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "demo")[1]
    text = " ".join(demo.format_help().split())
    assert "under a minute" not in text
    assert "toy model: 30 s on 2 idle cores, 1.5 min at load 4" in text
    assert "--model smollm2: 1.5 min idle, about 10 min at load 4" in text
    # the figures are the measured ones (docs/demo.md: the wall times with the load beside them)
    docs = " ".join((ROOT / "docs" / "demo.md").read_text().split())
    idle = re.search(r"On idle cores \(load average ([\d.]+)\): `tim-plugins demo` (\d+) s of wall time .* "
                     r"`--model smollm2` \(two runs of 4 steps\) 1 min (\d+) s", docs)
    assert idle and float(idle.group(1)) < 1 and int(idle.group(2)) <= 30 and 60 + int(idle.group(3)) <= 1.5 * 60 + 10
    wall = re.search(r"1 min (\d+) s of wall time \(\d+ s of CPU time, [\d.]+ GB peak RSS\) at a load average of ([\d.]+)",
                     docs)
    assert wall and 60 + int(wall.group(1)) <= 1.5 * 60 + 5 and round(float(wall.group(2))) == 4
    assert "about 10 min for its 8 steps" in docs
    summary = " ".join(parser.format_help().split())
    assert "under a minute" not in summary and "30 s on 2 idle cores, 1.5 min at load 4" in summary
