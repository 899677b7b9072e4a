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
from tim_plugins.report.training_page import step_table  # noqa: E402


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
    assert table["step"].tolist() == [1, 2, 3]
    assert table["k3"][1] == 123.0  # the logged value wins
    for i, step in ((0, 1), (2, 3)):  # the others: the naive formulas on the dumped rows
        r, t = data[step]
        d = t - r
        assert table["k3"][i] == pytest.approx(float((d.expm1() - d).mean()), rel=1e-9)
        rho = d.exp()
        assert table["ess"][i] == pytest.approx(float(rho.sum() ** 2 / (rho.numel() * (rho ** 2).sum())), rel=1e-9)
    assert not table["ess_logged"].any()
    assert table["lr_scale"].tolist() == [1.0, 1.0, 1.0]  # lr decay off: the scale stays 1
    assert np.isnan(table["reward"][0]) and table["reward"][1] == 0.5


def test_page_escapes_text_and_numbers_its_sources():
    page = Page("<title>", {"a": "source A", "b": "source B"})
    page.verdict({"status": "ok", "headline": "fine <b>", "lines": [("ok", "x < 1", "b")]}, ["more & more"])
    page.table(["k", "v"], [["<k>", 1.5], ["n", float("nan")]], [[None, "ok"], [None, None]])
    html = page.html()
    assert "&lt;title&gt;" in html and "fine &lt;b&gt;" in html and "x &lt; 1" in html and "more &amp; more" in html
    assert "<a href='#src1'>[1]</a>" in html and "<li id='src1'>source B</li>" in html and "source A" not in html
    assert "<td class='num ok'>1.5</td>" in html and "<td class='num'>n/a</td>" in html
    assert fmt(3.0) == "3" and fmt(1e-5) == "1e-05" and fmt(None) == "—" and fmt(True) == "yes"
