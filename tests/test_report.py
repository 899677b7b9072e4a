"""Report pieces: healthy ranges and the verdict, the per-step series (logged values first, the dump's rows
through the core monitor otherwise), the comparison verdict's ratios, and the HTML building blocks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")

from tim_plugins.dump import TokenDumper  # noqa: E402
from tim_plugins.parity.probe import ParityProbeConfig  # noqa: E402
from tim_plugins.report.health import K3_HEALTHY_MAX, LOG2, RULES, SOURCES, status, verdict  # noqa: E402
from tim_plugins.report.measure_page import measure_verdict  # noqa: E402
from tim_plugins.report.page import Page, fmt  # noqa: E402
from tim_plugins.report.tokens import load_tokens  # noqa: E402
from tim_plugins.report.training_page import step_table, training_verdict  # noqa: E402


def test_healthy_ranges_and_their_sources():
    # One source of truth: the k3 limit is the parity probe's default.
    assert K3_HEALTHY_MAX == ParityProbeConfig().kl_k3_max
    assert status("tim/token/kl_k3", K3_HEALTHY_MAX) == "ok"
    assert status("tim/token/kl_k3", K3_HEALTHY_MAX * 1.01) == "watch"
    assert status("tim/token/kl_k3", 0.2) == "act"
    assert status("tim/is/ess", 0.6) == "ok" and status("tim/is/ess", 0.4) == "watch"
    assert status("tim/is/ess", 0.2) == "act"
    assert status("tim/token/abs_diff_p99", LOG2 * 0.99) == "ok" and status("tim/token/abs_diff_p99", 0.7) == "act"
    assert status("tim/token/kl_k1", -0.2) == "act" and status("tim/token/kl_k1", 0.05) == "ok"
    assert status("tim/token/kl_k3", float("nan")) is None and status("no/such/key", 1.0) is None
    assert RULES["tim/dist/tv_mean"].ok_hi == pytest.approx(math.sqrt(K3_HEALTHY_MAX / 2))  # Pinsker
    for rule in RULES.values():
        assert rule.source in SOURCES and rule.text


def test_verdict_is_the_worst_status_and_skips_missing_metrics():
    v = verdict({"tim/token/kl_k3": 5e-5, "tim/is/ess": 0.4}, ("tim/token/kl_k3", "tim/is/ess",
                                                              "tim/token/abs_diff_p99"))
    assert v["status"] == "watch" and [line[0] for line in v["lines"]] == ["ok", "watch"]
    assert verdict({"tim/token/kl_k3": 0.5}, ("tim/token/kl_k3",))["status"] == "act"
    assert verdict({}, ("tim/token/kl_k3",))["status"] == "n/a"


def test_comparison_verdict_names_the_ratios_against_the_baseline():
    comps = {
        "hf-bf16": {"tim/token/kl_k3": 1e-4, "tim/token/abs_diff_p99": 0.05, "tim/dist/kl_rollout_train_mean": 1e-4,
                    "rollout/tokens_per_s": 100.0},
        "hf-fp32": {"tim/token/kl_k3": 1e-8, "tim/token/abs_diff_p99": 1e-5, "tim/dist/kl_rollout_train_mean": 2e-8,
                    "rollout/tokens_per_s": 80.0},
        "exact": {"tim/token/kl_k3": 0.0, "tim/token/abs_diff_p99": 0.0, "tim/dist/kl_rollout_train_mean": 0.0,
                  "rollout/tokens_per_s": 10.0},
    }
    v = measure_verdict({"comparisons": comps, "baseline": "hf-bf16", "primary": "hf-bf16"})
    assert v["setting"] == "hf-bf16"
    assert v["extra"][0] == ("Lowest k3: exact; lowest tail mismatch (|Δ| p99): exact; lowest k3 without the "
                             "(slow) exact sampler: hf-fp32.")
    assert "hf-fp32 vs hf-bf16: k3 1e+04× lower" in v["extra"][1] and "throughput 1.25× lower" in v["extra"][1]
    assert "exact vs hf-bf16: k3 down to exactly 0" in v["extra"][2]


def test_step_table_prefers_logged_values_and_falls_back_to_the_dump(tmp_path):
    g = torch.Generator().manual_seed(0)
    dumper = TokenDumper(out_dir=str(tmp_path), sample_rate=1.0)
    data = {}
    for step in (1, 2, 3):
        rollout = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
        train = rollout + 0.05 * step * torch.randn(5, 7, generator=g, dtype=torch.float64)
        mask = torch.rand(5, 7, generator=g) < 0.8
        mask[0] = False  # a fully masked sequence
        dumper.write(step, rollout, train, mask, torch.zeros(5, 7, dtype=torch.long))
        data[step] = (rollout.float().double()[mask], train.float().double()[mask])
    summary = {"log_history": [{"step": 2, "tim/tokens": 1.0, "tim/token/kl_k3": 123.0, "reward": 0.5}]}
    table = step_table(summary, load_tokens(tmp_path))
    # the logged row covers its window (steps 1-2: step 1's sample is not drawn beside it); step 3, after the last
    # logged row, from the dump
    assert table["step"].tolist() == [2, 3] and table["from_dump"].tolist() == [False, True]
    assert table["k3"][0] == 123.0  # the logged value wins
    for i, step in ((1, 3),):  # the tail: the naive formulas on the dumped rows
        r, t = data[step]
        d = t - r
        assert table["k3"][i] == pytest.approx(float((d.expm1() - d).mean()), rel=1e-9)
    for i, step in ((0, 2), (1, 3)):  # no logged ESS: the dump's ESS of that step's ratios
        r, t = data[step]
        rho = (t - r).exp()
        assert table["ess"][i] == pytest.approx(float(rho.sum() ** 2 / (rho.numel() * (rho ** 2).sum())), rel=1e-9)
    assert not table["ess_logged"].any()
    assert table["lr_scale"].tolist() == [1.0, 1.0]  # lr decay off: the scale stays 1
    assert table["reward"][0] == 0.5 and np.isnan(table["reward"][1])
    # without a logged row every dumped step is drawn from the dump
    alone = step_table({}, load_tokens(tmp_path))
    assert alone["step"].tolist() == [1, 2, 3] and alone["from_dump"].all()
    # the verdict: the logged k3 (every token) over the dump's sample of it; the token count is not mixed
    v = training_verdict(summary, load_tokens(tmp_path), table)
    assert any("k3" in line[1] and "123" in line[1] for line in v["lines"]), v["lines"]
    assert any("1 monitored tokens (and " in x and "of step 3, after the last logged row" in x for x in v["extra"])
    # a run whose logged rows are far outside the healthy ranges while the dump's sample looks healthy: not OK
    bad = {"log_history": [{"step": s, "tim/tokens": 20000.0, "tim/token/kl_k3": 0.5,
                            "tim/seq/log_ratio_abs_max": 40.0} for s in (1, 2, 3)]}
    v = training_verdict(bad, load_tokens(tmp_path), step_table(bad, load_tokens(tmp_path)))
    assert v["status"] != "ok" and any("0.5" in line[1] for line in v["lines"] if "k3" in line[1]), v


def test_page_escapes_text_and_numbers_its_sources():
    page = Page("<title>", {"a": "source A", "b": "source B"})
    page.verdict({"status": "ok", "headline": "fine <b>", "lines": [("ok", "x < 1", "b")]}, ["more & more"])
    page.table(["k", "v"], [["<k>", 1.5], ["n", float("nan")]], [[None, "ok"], [None, None]])
    html = page.html()
    assert "&lt;title&gt;" in html and "fine &lt;b&gt;" in html and "x &lt; 1" in html and "more &amp; more" in html
    assert "<a href='#src1'>[1]</a>" in html and "<li id='src1'>source B</li>" in html and "source A" not in html
    assert "<td class='num ok'>1.5</td>" in html and "<td class='num'>n/a</td>" in html
    assert fmt(3.0) == "3" and fmt(1e-5) == "1e-05" and fmt(None) == "—" and fmt(True) == "yes"


# ------------------------------------------------------------------------------------- largest disagreements
def _dump_with_ties(folder):
    """Three steps of random rows, plus an exact tie and an invalid (-inf) rollout row."""
    g = torch.Generator().manual_seed(3)
    dumper = TokenDumper(out_dir=str(folder), sample_rate=1.0)
    for step in (1, 2, 3):
        rollout = -torch.rand(4, 9, generator=g) * 3
        train = rollout + 0.1 * torch.randn(4, 9, generator=g)
        mask = torch.ones(4, 9, dtype=torch.bool)
        mask[1, 6:] = False  # a shorter completion
        if step == 2:
            train[0, 2], rollout[0, 2] = -0.5, -3.5    # |Δ| = 3: the largest ...
            train[2, 4], rollout[2, 4] = -1.0, -4.0    # ... tied with this one (later in dump order)
            rollout[3, 0] = float("-inf")               # invalid: never listed
            train[3, 0] = 0.0
        dumper.write(step, rollout, train, mask, torch.randint(0, 383, (4, 9), generator=g))


def test_largest_disagreements_equal_a_naive_sort_of_the_dump(tmp_path):
    from tim_plugins.dump import read_dump
    from tim_plugins.metrics import INVALID_LOGPROB_THRESHOLD
    from tim_plugins.report.disagreements import dump_disagreements

    _dump_with_ties(tmp_path)
    got = dump_disagreements(tmp_path, n=12, context=2)
    rows = read_dump(tmp_path).to_pylist()
    ok = [r for r in rows if all(math.isfinite(r[k]) and r[k] > INVALID_LOGPROB_THRESHOLD
                                 for k in ("rollout_logprob", "train_logprob"))]
    assert len(ok) == len(rows) - 1
    want = sorted(ok, key=lambda r: -abs(r["train_logprob"] - r["rollout_logprob"]))[:12]  # stable: dump order
    assert [(r["step"], r["sequence"], r["position"]) for r in got[:2]] == [(2, 0, 2), (2, 2, 4)]
    for g_row, w in zip(got, want, strict=True):
        assert (g_row["step"], g_row["rank"], g_row["sequence"], g_row["position"], g_row["token_id"]) == (
            w["step"], w["rank"], w["sequence"], w["position"], w["token_id"])
        assert g_row["diff"] == w["train_logprob"] - w["rollout_logprob"]
        assert g_row["p_rollout"] == pytest.approx(math.exp(w["rollout_logprob"]), rel=1e-12)
        assert g_row["p_train"] == pytest.approx(math.exp(w["train_logprob"]), rel=1e-12)
        same = [r for r in rows if (r["step"], r["rank"], r["sequence"]) == (w["step"], w["rank"], w["sequence"])]
        assert g_row["before"] == [r["token_id"] for r in same if w["position"] - 2 <= r["position"] < w["position"]]
        assert g_row["after"] == [r["token_id"] for r in same if w["position"] < r["position"] <= w["position"] + 2]
        assert g_row["start"] == (w["position"] == 0)
        assert g_row["end"] == (w["position"] == max(r["position"] for r in same))


def test_largest_disagreements_from_tensors_equal_those_of_their_dump(tmp_path):
    """measure takes them from its own tensors: the same rows as the dump of those tensors, with the context
    positions (scored or not) around each."""
    from tim_plugins.report.disagreements import columns_from_tensors, dump_disagreements, largest_disagreements

    g = torch.Generator().manual_seed(5)
    rollout = -torch.rand(5, 8, generator=g) * 3
    train = rollout + 0.05 * torch.randn(5, 8, generator=g)
    ids = torch.randint(0, 383, (5, 8), generator=g)
    context = torch.ones(5, 8, dtype=torch.long)
    context[4, 5:] = 0
    scored = context.bool().clone()
    scored[0, 3] = False  # e.g. a boundary token that left the loss: context only
    TokenDumper(out_dir=str(tmp_path), sample_rate=1.0).write(0, rollout, train, scored, ids)
    from_dump = dump_disagreements(tmp_path, n=40)
    from_tensors = largest_disagreements(columns_from_tensors(rollout, train, scored, ids, context_mask=context), n=40)
    key = lambda r: (r["sequence"], r["position"], r["token_id"], r["diff"])  # noqa: E731
    assert [key(r) for r in from_tensors] == [key(r) for r in from_dump]
    near = next(r for r in from_tensors if (r["sequence"], r["position"]) == (0, 4))
    assert near["before"][-1] == int(ids[0, 3])  # the unscored token still gives context


def test_visible_shows_control_and_format_characters():
    from tim_plugins.report.disagreements import visible

    assert visible("a\nb\tc\r\x00\x1b[31m\x7f\x85\x9f\u200b\u202e\u2028é 😀") == (
        "a⏎b⇥c\\r\\x00\\x1b[31m\\x7f\\x85\\x9f\\u200b\\u202e\\u2028é 😀")


def test_decoded_text_reaches_the_html_and_the_console_as_text(tmp_path):
    """A completion decoding to markup shows as text: no script element in the parsed page, the text intact."""
    from html.parser import HTMLParser

    from tim_plugins.report import build_report
    from tim_plugins.report.disagreements import disagreements_text

    evil = {0: "<script>alert(1)</script>", 1: "\n", 2: "\x1b[2J", 3: "\u202e", 4: "&amp;"}
    decode = lambda ids: "".join(evil.get(i % 5, f"<t{i}>") for i in ids)  # noqa: E731
    dumper = TokenDumper(out_dir=str(tmp_path / "dump"), sample_rate=1.0)
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, 10, generator=g) * 3
    train = rollout + 0.1 * torch.randn(3, 10, generator=g)
    ids = torch.arange(30).reshape(3, 10)
    dumper.write(0, rollout, train, torch.ones(3, 10, dtype=torch.bool), ids)
    page = build_report(tmp_path / "dump", tmp_path / "r.html", decode=decode).read_text()

    class Parse(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags, self.marks, self.in_mark = [], [], False

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)
            self.in_mark = tag == "mark"

        def handle_endtag(self, tag):
            self.in_mark = False

        def handle_data(self, data):
            if self.in_mark:
                self.marks.append(data)

    parsed = Parse()
    parsed.feed(page)
    assert "script" not in parsed.tags and "mark" in parsed.tags
    # every listed token shows as the decoded text, control characters made visible
    shown = {"<script>alert(1)</script>", "⏎", "\\x1b[2J", "\\u202e", "&amp;"} | {f"<t{i}>" for i in range(30)}
    assert parsed.marks and set(parsed.marks) <= shown
    assert "<script>alert(1)</script>" in parsed.marks  # token 0, 5, 10, ... : among the 15 largest
    assert "\x1b" not in page and "\u202e" not in page
    from tim_plugins.report.disagreements import dump_disagreements

    rows = dump_disagreements(tmp_path / "dump", decode)
    text = "\n".join(disagreements_text(rows))
    assert len(text.splitlines()) == len(rows) and "\x1b" not in text and "\u202e" not in text


# ----------------------------------------------------------------------------- the verdict and the audit
def _finding(code, severity):
    from tim_plugins.parity.findings import make_finding

    return make_finding(code, severity, f"{code} message", "a", "b").to_dict()


def test_reconcile_rule_deliberate_errors_keep_the_status_others_raise_it():
    from tim_plugins.parity.findings import CODES
    from tim_plugins.report.parity import reconcile

    ok = lambda: verdict({"tim/token/kl_k3": 1e-5}, ("tim/token/kl_k3",))  # noqa: E731
    dtype, head = _finding("dtype-mismatch", "error"), _finding("lm-head-precision-mismatch", "warning")
    # deliberate: the status stays as measured; the headline says so and a line gives the fix in the framework
    v = reconcile(ok(), [dtype, head], "trl", {"dtype-mismatch": "the bf16 rollout is deliberate in this demo"})
    assert v["status"] == "ok"
    assert v["headline"] == ("OK: every checked metric is inside its healthy range — the bf16 rollout is deliberate "
                             "in this demo; in your run, change the setting below.")
    assert v["extra"][0] == ("dtype-mismatch is deliberate here; in your run, fix it (TRL): "
                             + CODES["dtype-mismatch"].fix["trl"])
    assert v["audit"] == [{"code": "dtype-mismatch", "message": "dtype-mismatch message",
                           "deliberate": "the bf16 rollout is deliberate in this demo",
                           "fix": CODES["dtype-mismatch"].fix["trl"]}]
    # not deliberate: at least WATCH, whatever the numbers say; verl's knob in a verl run
    v = reconcile(ok(), [dtype], "verl")
    assert v["status"] == "watch" and v["headline"].startswith(
        "WATCH: the parity audit found a configuration error (dtype-mismatch)")
    assert v["extra"][0].endswith("fix it (verl): " + CODES["dtype-mismatch"].fix["verl"])
    # an ACT stays ACT; warnings and infos alone change nothing
    act = reconcile(verdict({"tim/token/kl_k3": 0.5}, ("tim/token/kl_k3",)), [dtype], "trl")
    assert act["status"] == "act" and act["headline"].startswith("ACT: the parity audit found")
    v = reconcile(ok(), [head, _finding("batch-invariance-off", "info")], "trl")
    assert v["status"] == "ok" and v["headline"] == ok()["headline"] and v["audit"] == []


def test_training_report_puts_the_fix_of_the_run_s_framework_in_its_audit_table(tmp_path):
    """Training summary (the demo's shape): verdict reconciled with the rollout model's own audit, and the
    findings table's fix column holds the registry's TRL knob."""
    import html as html_mod

    from tim_plugins.parity.findings import CODES
    from tim_plugins.report import build_report
    from tim_plugins.report.tokens import load_tokens
    from tim_plugins.report.training_page import training_verdict

    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(6, 12, generator=g) * 3
    TokenDumper(out_dir=str(tmp_path / "dump"), sample_rate=1.0).write(
        1, rollout, rollout + 1e-3 * torch.randn(6, 12, generator=g), torch.ones(6, 12, dtype=torch.bool),
        torch.zeros(6, 12, dtype=torch.long))
    summary = {"kind": "training", "framework": "trl", "settings": {}, "log_history": [],
               "findings": [_finding("batch-invariance-off", "info")],
               "own_audit": [_finding("dtype-mismatch", "error"), _finding("lm-head-precision-mismatch", "warning")],
               "deliberate": {"dtype-mismatch": "the bfloat16 rollout is deliberate in this demo"},
               "attached": {"rollout_source": "custom", "config": {}}, "dumps": {"all steps": "dump"}}
    v = training_verdict(summary, load_tokens(tmp_path / "dump"))
    assert v["status"] == "ok" and "the bfloat16 rollout is deliberate in this demo; in your run" in v["headline"]
    # the audit line counts what the tables show: nothing to fix, the deliberate error apart, the warning
    assert ("Parity audit: 0 errors to fix, 1 deliberate here (dtype-mismatch); 1 warning "
            "(lm-head-precision-mismatch)") in " ".join(v["extra"])
    page = build_report(tmp_path, summary=summary).read_text()
    assert "<th>fix (TRL)</th>" in page
    assert f"<td>{html_mod.escape(CODES['dtype-mismatch'].fix['trl'])}</td>" in page
    assert "<td>error (deliberate here)</td>" in page
    # batch-invariance-off: its TRL knob in a TRL run
    assert f"<td>{html_mod.escape(CODES['batch-invariance-off'].fix['trl'])}</td>" in page
    assert "Largest disagreements" in page
    del summary["deliberate"]
    assert training_verdict(summary, load_tokens(tmp_path / "dump"))["status"] == "watch"


def test_comparison_verdict_names_settings_that_did_not_run_and_reconciles_the_primary_s_audit():
    comps = {"hf-bf16": {"tim/token/kl_k3": 1e-4}, "hf-fp32": {"tim/token/kl_k3": 1e-9}}
    v = measure_verdict({"comparisons": comps, "baseline": "hf-bf16", "primary": "hf-bf16", "framework": "vllm",
                         "skipped": {"vllm": "vLLM is not installed; install it with pip install x"},
                         "audits": {"hf-bf16": [_finding("dtype-mismatch", "error")], "hf-fp32": []}})
    assert "Not run: vllm: vLLM is not installed; install it with pip install x." in v["extra"]
    assert v["status"] == "ok" and "hf-bf16 is the setting this run measures" in v["headline"]
    assert v["extra"][0].startswith("dtype-mismatch is deliberate here; in your run, fix it (vLLM): LLM(dtype=")


def test_context_cut_inside_a_character_drops_the_partial_bytes_not_the_token():
    """A byte-level tokenizer splits "é" (C3 A9) over two tokens: a context window that starts after C3 or ends
    before A9 decodes to U+FFFD at that edge (Python's own UTF-8 decoder is the reference here); the token itself is
    shown as decoded."""
    from tim_plugins.report.disagreements import decode_rows

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    row = {"token_id": 0xC3, "before": [0xA9, *b"x\xc3\xa9y"], "after": [*b"z\xc3"]}
    assert decode(row["before"]) == "\ufffdxéy" and decode(row["after"]) == "z\ufffd"  # what the edges look like
    out = decode_rows([row], decode)[0]
    assert (out["text_before"], out["text"], out["text_after"]) == ("xéy", "\ufffd", "z")
    # inside the context a replacement character stays: only the cut edges are trimmed
    inner = decode_rows([{"token_id": 0x41, "before": [*b"a\xc3b"], "after": []}], decode)[0]
    assert (inner["text_before"], inner["text"], inner["text_after"]) == ("a\ufffdb", "A", "")
