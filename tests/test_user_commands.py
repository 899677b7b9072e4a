"""A user's first commands, typed as the README and docs/demo.md give them, through the installed `tim-plugins`
command and the README's TRL example file, each in its own process from an empty working directory: the main job
(`tim-plugins demo`, short) with its report, `tim-plugins measure` with its report, `tim-plugins report A B` (the
comparison page) and `python integrations/trl/examples/quickstart.py`.

The `latest` lane of `make test` runs this module on the newest release of every dependency (scripts/stack
latest): a command that fails there fails for a user who installs today. The main suite leaves it out (Makefile
test-main): its own tests run the same commands in-process on the locked stack (tests/test_demo.py,
test_measure.py, test_report.py, test_trl_quickstart.py), with finer checks."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

from bounded import run_bounded

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).with_name("tim-plugins")
QUICKSTART = ROOT / "integrations" / "trl" / "examples" / "quickstart.py"
# Each command's bound: several times its ~20 s on 2 loaded cores (the first one also builds the toy model).
TIMEOUT_S = 600
# A short main job: the default run's size per step, fewer steps.
STEPS = 3


def _run(cmd: list[str], cwd: Path) -> str:
    out, timed_out = run_bounded([str(c) for c in cmd], TIMEOUT_S, cwd=cwd)
    assert not timed_out, f"{cmd} ran past {TIMEOUT_S} s:\n{out.stdout[-3000:]}"
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stdout[-6000:]}"
    return out.stdout


def _k3_per_step(summary: dict) -> dict[int, float]:
    return {h["step"]: h["tim/token/kl_k3"] for h in summary["log_history"] if "tim/token/kl_k3" in h}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("user")


@pytest.fixture(scope="module")
def demos(work) -> dict[str, Path]:
    """The main job as one run twice (`--compare none`; its default pair is tests/test_demo.py's): bf16 rollouts,
    and float32 rollouts (the same weights and dtype as the trainer), each `tim-plugins demo --steps 3`."""
    out = {}
    for dtype in ("bfloat16", "float32"):
        out[dtype] = work / f"demo-{dtype}"
        printed = _run([CLI, "demo", "--compare", "none", "--steps", STEPS, "--rollout-dtype", dtype,
                        "--out", out[dtype]], work)
        assert f"report: {out[dtype] / 'report.html'}" in printed
    return out


def test_demo_trains_and_writes_its_report(demos):
    k3 = {}
    for dtype, out in demos.items():
        summary = json.loads((out / "summary.json").read_text())
        assert summary["kind"] == "training" and summary["settings"]["steps"] == STEPS
        k3[dtype] = _k3_per_step(summary)
        assert sorted(k3[dtype]) == list(range(1, STEPS + 1))  # one monitored row per optimizer step
        html = (out / "report.html").read_text()
        assert "class='verdict" in html and "Mismatch per optimizer step" in html
        assert sorted((out / "dump").glob("step_*-rank_*.parquet"))
    # bf16 rollouts against the fp32 trainer disagree per token (k3 ~1e-5..1e-3 on the toy model); fp32 rollouts
    # are the trainer's own numbers up to kernel order (~1e-13)
    for step in range(1, STEPS + 1):
        assert 1e-7 < k3["bfloat16"][step] < 1e-2 and 0 <= k3["float32"][step] < 1e-9


def test_report_compares_the_two_runs(demos, work):
    page = work / "comparison.html"
    _run([CLI, "report", demos["bfloat16"], demos["float32"], "--out", page], work)
    html = page.read_text()
    assert "demo-bfloat16 vs demo-float32" in html
    assert html.count("<img src='data:image/png;base64,") >= 1
    for out in demos.values():
        # each run's token count, read from its dump by the report, is the count its trainer logged
        logged = sum(h["tim/tokens"] for h in json.loads((out / "summary.json").read_text())["log_history"]
                     if "tim/tokens" in h)
        assert re.search(rf"<b>{out.name}</b>[^<]*\b{int(logged)} monitored tokens", html), out.name


def test_measure_writes_its_report(work):
    out = work / "measure"
    printed = _run([CLI, "measure", "--num-prompts", 8, "--max-new-tokens", 16, "--out", out], work)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "measure" and summary["primary"] == "hf-bf16"
    assert (out / "report.html").is_file() and f"summary: {out / 'summary.json'}" in printed


def test_readme_quickstart(work):
    """The README's TRL example as the repository has it: a GRPOTrainer run with TIMCallback, tim/ metrics in its
    log at every step (the script prints them)."""
    cwd = work / "quickstart"
    cwd.mkdir()
    printed = _run([sys.executable, QUICKSTART], cwd)
    (max_steps,) = re.findall(r"max_steps=(\d+)", QUICKSTART.read_text())
    rows = [ast.literal_eval(line) for line in printed.splitlines() if line.startswith("{'step': ")]
    assert [r["step"] for r in rows] == list(range(1, int(max_steps) + 1)), printed[-3000:]
    # the quickstart trains: its reward varies within a group, so the loss is not zero (at every step, on the
    # locked stack: tests/test_trl_quickstart.py), and tim/ sits beside TRL's metrics
    assert any(r["loss"] != 0 for r in rows) and all(r["tim/tokens"] > 0 for r in rows), rows
