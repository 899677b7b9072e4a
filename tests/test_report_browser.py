"""The HTML reports render their figures in a real browser (headless Chromium).

Skipped when no Chromium is installed, unless ``TIM_PLUGINS_REQUIRE_BROWSER=1`` (CI sets it after
``apt-get install -y chromium``): then a missing browser fails the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from bounded import run_bounded

pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")

from tim_plugins.dump import TokenDumper  # noqa: E402
from tim_plugins.report import build_report  # noqa: E402

TIMEOUT_S = 120
_PROBE = ("<script>window.addEventListener('load', function () { document.querySelectorAll('img').forEach("
          "function (i) { i.setAttribute('data-probe', i.complete + ':' + i.naturalWidth + 'x' + i.naturalHeight);"
          " }); });</script>")


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("TIM_PLUGINS_REQUIRE_BROWSER") == "1":
        pytest.fail("TIM_PLUGINS_REQUIRE_BROWSER=1 but no chromium on PATH: apt-get install -y chromium")
    pytest.skip("no chromium on PATH (apt-get install -y chromium); set TIM_PLUGINS_REQUIRE_BROWSER=1 to require it")


def _chromium(browser: str, tmp_path, *args: str) -> str:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           f"--user-data-dir={tmp_path / 'profile'}", *args]
    proc, timed_out = run_bounded(cmd, TIMEOUT_S, merge_stderr=False)
    if timed_out:
        pytest.fail(f"chromium ran past {TIMEOUT_S} s")
    out = proc.stdout
    return out


def _assert_renders(report, tmp_path) -> None:
    browser = _browser()
    html = report.read_text()
    n_img = html.count("<img ")
    assert n_img >= 5
    probe = tmp_path / (report.stem + "-probe.html")
    probe.write_text(html.replace("</body>", _PROBE + "</body>"))
    dom = _chromium(browser, tmp_path, "--dump-dom", probe.as_uri())
    loaded = re.findall(r'data-probe="(true|false):(\d+)x(\d+)"', dom)
    assert len(loaded) == n_img, f"{len(loaded)} of {n_img} images reported by the browser"
    for complete, w, h in loaded:
        assert complete == "true" and int(w) >= 300 and int(h) >= 200, (complete, w, h)
    shot = tmp_path / (report.stem + ".png")
    _chromium(browser, tmp_path, f"--screenshot={shot}", "--window-size=1400,3000", report.as_uri())
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
    assert pixels.shape == (3000, 1400)
    # Figures and text, not a blank page: a real share of the page is drawn (plot lines, bars, text).
    drawn = pixels < 200
    assert drawn.mean() > 0.02
    # ... and the drawn pixels reach far down the page (the figures follow the verdict and the tables).
    rows = np.nonzero(drawn.any(axis=1))[0]
    assert rows.max() > 1500


def test_dump_report_renders_in_a_browser(tmp_path):
    g = torch.Generator().manual_seed(0)
    dumper = TokenDumper(out_dir=str(tmp_path / "dump"), sample_rate=1.0)
    for step in range(1, 5):
        rollout = -torch.rand(8, 40, generator=g) * 4
        train = rollout + 0.02 * torch.randn(8, 40, generator=g)
        dumper.write(step, rollout, train, torch.ones(8, 40, dtype=torch.bool), torch.randint(0, 383, (8, 40)))
    _assert_renders(build_report(tmp_path / "dump", tmp_path / "dump.html"), tmp_path)


def test_comparison_of_two_runs_renders_in_a_browser(tmp_path):
    """``tim-plugins report A B``: two dumps (bf16-like and fp32-like noise) overlaid on one page."""
    from tim_plugins.report import build_comparison

    g = torch.Generator().manual_seed(2)
    for name, noise in (("bf16", 2e-2), ("fp32", 1e-6)):
        dumper = TokenDumper(out_dir=str(tmp_path / name), sample_rate=1.0)
        for step in range(1, 5):
            rollout = -torch.rand(8, 40, generator=g) * 4
            train = rollout + noise * torch.randn(8, 40, generator=g)
            dumper.write(step, rollout, train, torch.ones(8, 40, dtype=torch.bool), torch.randint(0, 383, (8, 40)))
    report = build_comparison([tmp_path / "bf16", tmp_path / "fp32"], tmp_path / "cmp.html")
    assert report.read_text().count("class='verdict") == 2
    _assert_renders(report, tmp_path)


def test_training_report_renders_in_a_browser(tmp_path):
    """The demo's page (per-step series, audit, attached hooks) from a synthetic training summary."""
    g = torch.Generator().manual_seed(1)
    run = tmp_path / "run"
    dumper = TokenDumper(out_dir=str(run / "dump"), sample_rate=1.0)
    history = []
    for step in range(1, 9):
        rollout = -torch.rand(16, 24, generator=g) * 4
        train = rollout + 0.01 * step * torch.randn(16, 24, generator=g)
        dumper.write(step, rollout, train, torch.ones(16, 24, dtype=torch.bool), torch.randint(0, 383, (16, 24)))
        history.append({"step": step, "loss": 0.0, "reward": 0.1 * step, "learning_rate": 1e-4,
                        "tim/tokens": 384.0, "tim/token/kl_k3": 1e-5 * step})
    summary = {"kind": "training", "title": "synthetic run", "settings": {"steps": 8}, "log_history": history,
               "findings": [{"severity": "info", "code": "batch-invariance-off", "rollout": "no", "trainer": "no",
                             "message": "neither side is batch invariant"}],
               "attached": {"rollout_source": "hf", "hooks": ["GRPOTrainer._compute_loss"], "config": {}},
               "dumps": {"all steps": "dump"}}
    (run / "summary.json").write_text(json.dumps(summary))
    _assert_renders(build_report(run), tmp_path)


def test_measure_comparison_report_renders_in_a_browser(tmp_path):
    pytest.importorskip("transformers")
    from tim_plugins.apps.measure import MeasureConfig, run_measure

    cfg = MeasureConfig(compare="hf-bf16,hf-fp32,exact", num_prompts=2, max_new_tokens=6, batch_size=2,
                        out=str(tmp_path / "m"))
    report = run_measure(cfg)["report"]
    from pathlib import Path

    _assert_renders(Path(report), tmp_path)
