"""TIMCallback in TRL's AsyncGRPOTrainer with two processes (CPU, gloo, ``torch.distributed.run``): the policy lag
reaches the rank that holds no rollout queue, and every ``tim/by_lag`` value logged is the exact merge of both ranks.

One real ``AsyncGRPOTrainer.train()`` launched as two ranks (tests/trl_async_two_procs_run.py), bounded in time, its
process group killed at the end (tests/bounded.py): the stand-in engine of tests/async_standin.py on rank 0 (TRL
keeps the rollout worker, its queue and ``model_version`` on the main process; its dispatcher sends each rank one
packed row), 4 steps of 2 micro-batches.

References, independent of the callback:
- each trained sample's lag from rank 0's record of every sample it generated (its rollout log-probs -> the policy
  version) and of the step each version was synced at, and the step of the loss call that trained it (a test-side
  wrapper on each rank): per rank, step and lag, the token count must equal that rank's own unmerged count;
- the merge's definition on the ranks' unmerged values (read just before the callback merges them): counts add,
  means are token-weighted, maxima are maxima; the logged values must equal it, and differ from one rank's.

Cost on the shared 2-core machine: ~15 s (start ~8 s per rank).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from tim_plugins._optional import package_version

pytest.importorskip("trl")
pytest.importorskip("datasets")
# The packed AsyncGRPOTrainer (trl.experimental.async_grpo.packing) exists from TRL 1.16 (1.15's async trainer has
# no packing): older releases skip by version; on 1.16 and later a module that moved fails the imports, not a skip.
if Version(package_version("trl")) < Version("1.16"):
    pytest.skip("the packed AsyncGRPOTrainer exists from TRL 1.16", allow_module_level=True)

from bounded import run_bounded  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().parent / "trl_async_two_procs_run.py"
TIMEOUT_S = 300
STEPS = 4


@pytest.fixture(scope="module")
def ranks(toy_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("async2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(RUNNER),
           "--model", str(toy_model_path), "--out", str(out), "--steps", str(STEPS)]
    proc, timed_out = run_bounded(cmd, TIMEOUT_S, cwd=ROOT)
    if timed_out:
        pytest.fail(f"ran past {TIMEOUT_S} s and was killed:\n{proc.stdout[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}:\n{proc.stdout[-6000:]}")
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]


def _expected_counts(rank: dict, samples: dict, synced_at: dict) -> dict[tuple[int, int], int]:
    """(logged step, lag) -> trained tokens of this rank, from the samples its loss calls trained."""
    counts: dict[tuple[int, int], int] = {}
    for p in rank["passes"]:
        for key in p["samples"]:
            lag = p["step"] - synced_at[str(samples[key])]
            counts[(p["step"] + 1, lag)] = counts.get((p["step"] + 1, lag), 0) + len(bytes.fromhex(key)) // 4
    return counts


def test_each_rank_keys_its_own_tokens_by_lag(ranks):
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["backend"] == "gloo"
    assert ranks[0]["diag"] == ranks[1]["diag"] == {}
    samples, synced_at = ranks[0]["samples"], ranks[0]["synced_at"]
    for rank in ranks:
        want = _expected_counts(rank, samples, synced_at)
        got = {}
        for window in rank["local"]:
            for key, value in window["values"].items():
                if key.endswith("/count") and value:
                    got[(window["step"], int(key.split("/")[2]))] = int(value)
        assert got == want, (rank["rank"], got, want)
    lags_on_rank1 = {lag for (_, lag) in _expected_counts(ranks[1], samples, synced_at)}
    assert len(lags_on_rank1) >= 2, lags_on_rank1  # rank 1 holds no queue: its lags came with its packed row


def test_logged_by_lag_is_the_exact_merge_of_the_ranks(ranks):
    logged = {h["step"]: h for h in ranks[0]["log_history"] if "loss" in h}
    assert sorted(logged) == list(range(1, STEPS + 1))
    tim = lambda h: {k: v for k, v in h.items() if k.startswith("tim/")}  # noqa: E731
    # the same merged values on both ranks (TRL's own sample/ and perf/ keys are the main process's)
    assert [tim(h) for h in ranks[1]["log_history"] if "loss" in h] == [tim(h) for h in logged.values()]
    local = [{w["step"]: w["values"] for w in r["local"]} for r in ranks]
    differs = 0
    for step, h in logged.items():
        labels = {k.split("/")[2] for part in (local[0][step], local[1][step]) for k, v in part.items()
                  if k.endswith("/count") and v}
        assert labels == {k.split("/")[2] for k, v in h.items() if k.startswith("tim/by_lag/") and
                          k.endswith("/count") and v}
        for lag in labels:
            parts = [(p.get(f"tim/by_lag/{lag}/count") or 0.0, p) for p in (local[0][step], local[1][step])]
            n = sum(c for c, _ in parts)
            assert h[f"tim/by_lag/{lag}/count"] == n
            for stat in ("abs_diff_mean", "mean", "kl_k3"):
                want = sum(c * p[f"tim/by_lag/{lag}/{stat}"] for c, p in parts if c) / n
                assert h[f"tim/by_lag/{lag}/{stat}"] == pytest.approx(want, rel=1e-6, abs=1e-12), (step, lag, stat)
            want_max = max(p[f"tim/by_lag/{lag}/abs_diff_max"] for c, p in parts if c)
            assert h[f"tim/by_lag/{lag}/abs_diff_max"] == pytest.approx(want_max, rel=1e-7)
            both = all(c for c, _ in parts)
            differs += both and h[f"tim/by_lag/{lag}/kl_k3"] != parts[0][1][f"tim/by_lag/{lag}/kl_k3"]
    assert differs > 0  # some bucket has tokens on both ranks, and its merge is not rank 0's value
    assert not any(k.startswith(("tim/staleness/", "tim/split/")) for h in logged.values() for k in h)  # no π_old
