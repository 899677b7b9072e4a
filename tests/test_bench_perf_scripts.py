"""The issue-25 performance scripts end to end at tiny sizes, so they cannot rot: the safe-vocab head benchmark,
the TRL step benchmark and the GPU script's staging. Structure and sanity of the results, never speed."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bounded import run_bounded

pytest.importorskip("trl")
pytest.importorskip("datasets")

from benchmarks import bench_safe_vocab  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run_script(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root, bounded (its process group is killed on timeout)."""
    proc, timed_out = run_bounded(cmd, timeout, cwd=REPO, env={**os.environ, "WANDB_MODE": "offline", **(env or {})})
    if timed_out:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{proc.stdout[-3000:]}")
    return proc

def finite_positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_safe_vocab_quick_results_and_float64_check(tmp_path):
    out = tmp_path / "safe_vocab.json"
    proc = run_script([sys.executable, "-m", "benchmarks.bench_safe_vocab", "--quick", "--output", str(out)], 240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    res = json.loads(out.read_text())
    assert res["complete"] and res["quick"] and res["device"] == "cpu" and res["trl_fold"] == "torch"
    assert [(c["dtype"], c["hidden"], c["vocab"], c["n"]) for c in res["cases"]] == [
        ("fp32", 64, 5003, 96), ("bf16", 64, 5003, 96)]
    for case in res["cases"]:
        v = case["variants"]
        for name in ("ours", "trl"):
            times = v[name]["times_s"]
            assert len(times) == 2 and all(finite_positive(t) for t in times)
            assert all(0 < f <= t for f, t in zip(v[name]["fwd_s"], times))  # the forward is part of the step
            assert v[name]["time_s"]["median"] == statistics.median(times)
            if res["peak_memory_measured"]:
                assert all(finite_positive(p) for p in v[name]["peak_mb"])
        if case["dtype"] == "fp32":
            assert len(v["naive"]["times_s"]) == 2
        else:
            assert "skipped" in v["naive"]  # half-precision full logits are not run on CPU
        ratios = res["ratios"][f"{case['dtype']}_H64_N96"]
        # the headline ratio is the ratio of the medians of the raw times, a finite positive number
        assert finite_positive(ratios["time_ours_over_trl"])
        assert ratios["time_ours_over_trl"] == pytest.approx(
            statistics.median(v["ours"]["times_s"]) / statistics.median(v["trl"]["times_s"]), rel=1e-12)
        paired = case["ratios"]["time_ours_over_trl_paired"]
        assert paired["min"] <= paired["median"] <= paired["max"]
        assert set(res["meets"][f"{case['dtype']}_H64_N96"]) >= {"time"}
    # ours and TRL against float64 references of their rules, on the same inputs. On CPU both round the logits
    # exactly as the reference does, so the log-probs agree to fp32 noise whatever the dtype.
    checks = {c["dtype"]: c for c in res["check"]}
    assert set(checks) == {"fp32", "bf16"}
    for dtype, c in checks.items():
        assert c["passed"]
        assert 0.1 < c["pruned_tokens_in_vocab_frac"] < 1.0  # min_p prunes a real tail of these logits
        assert c["ours"]["in_safe_mismatches"] == 0 and c["ours"]["tokens_compared"] > 0
        for name in ("ours", "trl"):
            assert c[name]["logprob_max_abs_err"] < 1e-4
            assert max(c[name]["grad_hidden_rel_err"], c[name]["grad_weight_rel_err"]) < (
                1e-4 if dtype == "fp32" else 1e-2)


class _Wrong:
    """A head with a planted error: log-probs shifted, or the gradient scaled by 1.1 with the values unchanged."""

    def __init__(self, good, kind: str):
        self.good, self.kind = good, kind
        self.DEFAULT_MIN_P, self.default_chunk_rows = good.DEFAULT_MIN_P, good.default_chunk_rows

    def safe_logprobs_from_hidden(self, hidden, weight, tokens, **kw):
        out = self.good.safe_logprobs_from_hidden(hidden, weight, tokens, **kw)
        lp = out.logprobs
        out.logprobs = lp + 1e-3 if self.kind == "value" else lp + 0.1 * (lp - lp.detach())
        return out


@pytest.mark.parametrize("kind", ["value", "grad"])
def test_sanity_check_catches_a_wrong_head(kind):
    good = bench_safe_vocab.load_safe_vocab(None)
    args = ("fp32", 32, 1001, 48, torch.device("cpu"))
    assert bench_safe_vocab.sanity_check(*args, {"ours": good})["passed"]
    res = bench_safe_vocab.sanity_check(*args, {"ours": _Wrong(good, kind)})
    assert not res["passed"] and not res["ours"]["passed"] and res["trl"]["passed"]
    err = res["ours"]["logprob_max_abs_err"] if kind == "value" else res["ours"]["grad_hidden_rel_err"]
    assert err == pytest.approx(1e-3 if kind == "value" else 0.1, rel=0.05)


def test_baseline_copy_runs_as_its_own_variant(tmp_path):
    # --baseline loads another copy of safe_vocab.py as variant "base" (here: the current file)
    base = bench_safe_vocab.load_safe_vocab(str(REPO / "tim_plugins" / "safe_vocab.py"))
    assert base is not bench_safe_vocab.load_safe_vocab(None) and base.__name__.endswith("baseline_safe_vocab")
    h, w, t = bench_safe_vocab.make_inputs(16, 8, 101, "fp32", torch.device("cpu"))
    a = base.safe_logprobs_from_hidden(h, w, t, min_p=1e-3).logprobs
    b = bench_safe_vocab.load_safe_vocab(None).safe_logprobs_from_hidden(h, w, t, min_p=1e-3).logprobs
    assert torch.equal(a, b)


def test_trl_step_quick_arms_and_ratios(tmp_path):
    out = tmp_path / "trl_step.json"
    proc = run_script([sys.executable, "-m", "benchmarks.bench_trl_step", "--quick", "--output", str(out)], 300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    res = json.loads(out.read_text())
    assert res["complete"] and res["quick"] and res["arms"] == ["plain", "tim", "safe"]
    settings = res["settings"]
    for arm in res["arms"]:
        runs = res["runs"][arm]
        assert len(runs) == settings["rounds"]
        for run in runs:
            assert len(run["steps_s"]) == settings["steps"] and all(finite_positive(x) for x in run["steps_s"])
            assert run["step_s"] == statistics.median(run["steps_s"])
            assert 0 < run["completion_length"] <= settings["length"]
    # each arm did what it says: no tim/ metrics without the callback, the monitor's with it, safe-vocab's too
    assert all(not r["tim_keys_logged"] for r in res["runs"]["plain"])
    assert all("tim/token/kl_k3" in r["tim_keys_logged"] for arm in ("tim", "safe") for r in res["runs"][arm])
    assert all(not any(k.startswith("tim/safe_vocab/") for k in r["tim_keys_logged"]) for r in res["runs"]["tim"])
    for r in res["runs"]["safe"]:
        assert 0.0 <= r["safe_vocab_pruned_mass_mean"] < 1.0
    for arm in ("tim", "safe"):
        ratio = res["ratios"][f"{arm}_over_plain"]
        assert finite_positive(ratio)
        assert ratio == pytest.approx(statistics.median([r["step_s"] for r in res["runs"][arm]])
                                      / statistics.median([r["step_s"] for r in res["runs"]["plain"]]), rel=1e-12)
    assert res["ratio"] == res["ratios"]["tim_over_plain"]


def test_gpu_script_stages_the_package_and_stops_cleanly_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this checks the no-GPU refusal")
    stage = tmp_path / "stage"
    proc = run_script(["bash", "benchmarks/gpu_perf.sh"], 120,
                       env={"PYTHON": sys.executable, "STAGE": str(stage), "WHEELS": str(tmp_path / "no-wheels")})
    # the preflight imported trl and tim_plugins.integrations.trl from the staged tree, then found no GPU
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "torch sees no CUDA device" in proc.stdout and "missing Python packages" not in proc.stdout
    assert (stage / "tim_plugins" / "integrations" / "trl" / "__init__.py").is_file()
    assert (stage / "benchmarks" / "bench_safe_vocab.py").is_file()


def test_server_probe_quick_ratios_are_the_raw_timings(tmp_path):
    """benchmarks/bench_server_probe.py at a tiny size (vLLM's CPU build in-process): every part timed each round,
    the server's scoring returned its prompt log-probs (the script raises otherwise), and the ratios are the medians
    of the raw timings."""
    pytest.importorskip("vllm")
    out = tmp_path / "server_probe.json"
    proc = run_script([sys.executable, "-m", "benchmarks.bench_server_probe", "--quick", "--output", str(out)], 300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    res = json.loads(out.read_text())
    raw = res["raw"]
    assert res["quick"] and all(len(raw[k]) == res["rounds"] for k in ("engine", "trainer", "generation", "train"))
    assert all(finite_positive(x) for k in raw for x in raw[k])
    probe = [e + t for e, t in zip(raw["engine"], raw["trainer"])]
    step = [g + t for g, t in zip(raw["generation"], raw["train"])]
    assert res["ratios"]["probe_over_step"] == pytest.approx(statistics.median(probe) / statistics.median(step),
                                                             rel=1e-12)
    assert res["ratios"]["probe_over_generation"] == pytest.approx(
        statistics.median(probe) / statistics.median(raw["generation"]), rel=1e-12)
