"""verl's own ``python -m verl.trainer.main_ppo`` (V1 trainer, GRPO, FSDP2 actor, vLLM CPU-build rollout, the toy
model) with a mismatch injected from step 3 on (``cpu_site/inject_mismatch.py``: the rollout's stored log-probs
shifted by ±DELTA token by token, seen by verl's own metrics and by tim's monitor alike), fp32 on both sides before
it, sampling with a user's ``top_p=0.8`` / ``top_k=20`` and verl's fused kernels kept as set, and the safe vocabulary
over that cut alone (``+tim.safe_vocab.enable=true``: no min-p pruning, no logits processor in vLLM; #48). One run,
5 steps, checks what #38 asks of verl:

- the LR decay's ``kl_k3`` signal fires through verl's engine and optimizer at the injected step, as the core
  controller replayed on the logged series says, and the effective LR verl logs follows;
- ``+tim.dump.dir`` writes the same per-token Parquet dump as TRL (a file per global step and DP rank, the sampled
  sequences with their token ids), whose per-step k3 recomputed naively equals the logged one;
- ``tim-plugins report <tim.dump.dir>`` renders it: the start-up audit with the fix column in verl's terms and the
  largest disagreements decoded with the run's tokenizer (the model folder named in the driver's summary.json);
- and what #48 asks of a verl run that keeps its sampler and kernels: the actor renormalises over the sampler's own
  cut (the ratio is 1 to fp32 noise before the injection, where a full-vocabulary actor reads the kept mass), the
  kept set is said to be recomputed at start-up, and the report's truncation section names the overrides as set.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

import main_ppo_run as M  # noqa: E402
from bounded import run_bounded  # noqa: E402

pytestmark = pytest.mark.slow

STEPS, INJECT_FROM, DELTA = 5, 3, 0.3
BASE_LR = 1e-4  # constant schedule; small enough that the injected mismatch outweighs the staleness of one update
# The length never fires (its floor is out of reach): the only trigger is the k3 signal.
LR_OPTIONS = {"warmup_steps": 1, "window": 1, "patience": 1, "cooldown": 100, "length_floor": 1e9,
              "signals": "[kl_k3]"}
RUN_TIMEOUT_S = 900
# Before the injection both sides run fp32: k3 is kernel noise (~1e-13, test_verl_main_ppo.py).
FP32_K3_MAX = 1e-9
# With d = ±DELTA per token (plus fp32 noise ~1e-7), k3 = mean(exp(d) - 1 - d) lies between the two signs' values.
K3_LO, K3_HI = math.exp(-DELTA) - 1 + DELTA, math.exp(DELTA) - 1 - DELTA
# verl's rollout_corr/k3_kl on the same tokens: float32 exp(r) - r - 1 at r ~ DELTA is exact to ~1e-7 relative per
# token; the means agree to float32 summation (test_verl_main_ppo.py K3_REL).
K3_REL = 1e-4
# The dump stores float32 log-probs (the monitor's inputs) and the monitor accumulates in float64: a naive float64 k3
# over the dump's rows agrees to float32 rounding of d (~1e-7 relative at |d| ~ DELTA, summed).
DUMP_K3_REL = 1e-5
# Sampled tokens of one step that an update moves across the recomputed top-p / top-k cut (the second PPO epoch's
# loss leaves them out): 0 or 1 measured on ~60 tokens a step at BASE_LR.
MOVED_ACROSS_THE_CUT = 2
# A user's nucleus and top-k sampling and verl's fused kernels (its torch backend), kept as set.
TOP_P, TOP_K = 0.8, 20
USER_SAMPLER = [f"actor_rollout_ref.rollout.top_p={TOP_P}", f"actor_rollout_ref.rollout.top_k={TOP_K}",
                "actor_rollout_ref.model.use_fused_kernels=true"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_model_path):
    wd = tmp_path_factory.mktemp("dump_report")
    files = M.prepare(wd, toy_model_path)
    dump = wd / "tim_dump"
    overrides = M.base_overrides(files, wd, steps=STEPS, lr=BASE_LR) + M.CPU_OVERRIDES + [
        "trainer.v1.trainer_mode=tim_sync",
        "+tim.monitor.enable=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.actor.optim.optimizer_impl=tim_plugins.integrations.verl.optim",
        "actor_rollout_ref.actor.optim.optimizer=AdamW",
        # no decoupled weight decay (verl's default 0.01): without a gradient the weights stay as they are, so the
        # staleness of an unmoved step is forward noise alone, not lr * weight_decay per optimizer step
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "+tim.lr_decay.enable=true",
        *[f"+tim.lr_decay.options.{k}={v}" for k, v in LR_OPTIONS.items()],
        f"+tim.dump.dir={dump}",
        "+tim.dump.sample_rate=1.0",
        # two optimizer steps per batch: the second trains on a stale batch (the split's staleness part)
        "actor_rollout_ref.actor.ppo_epochs=2",
        *USER_SAMPLER,
        "+tim.safe_vocab.enable=true",
        "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs",
    ]
    # the default log: verl's console has the tim/* metrics read each step, the dump's log_history.jsonl all of them
    result = M.run_main_ppo(overrides, cwd=wd, timeout=RUN_TIMEOUT_S, log_path=wd / "run.log",
                            extra_env={"TIM_TEST_INJECT_MISMATCH": f"{INJECT_FROM}:{DELTA}"}, log_detail=False)
    print(f"[dump_report] exit {result.returncode} after {result.seconds:.0f} s; log {wd / 'run.log'}")
    if result.returncode != 0:
        pytest.fail(f"main_ppo failed (exit {result.returncode}):\n{result.output[-4000:]}")
    from tim_plugins.dump import complete_log_history, read_log_history

    # the tests below read each step's row: verl's console row with the dump history's tim/* metrics added
    result.console = result.steps
    full = read_log_history(dump / "log_history.jsonl")
    rows = complete_log_history([{"step": s, **m} for s, m in sorted(result.steps.items())], full)
    result.steps = {row.pop("step"): row for row in rows}
    return result, dump, files


def test_the_injected_mismatch_is_named_a_floor_jump_from_its_step_and_nothing_else(run):
    """The lag-0 floor (``tim/token/abs_diff_mean``) is fp32 noise for INJECT_FROM - 1 steps, then DELTA: named
    ``floor-jump`` at INJECT_FROM with verl's fix, and counted at each later step (a jumped value stays out of the
    trailing median, so a floor that stays up keeps being named; the console line is printed once per cause); nothing
    is named before it, and nothing else (the sync check compares every tensor, fault-free). The two PPO epochs'
    staleness is named exactly where the logged split meets the rule (its share >= staleness_share and its k3 above
    CauseConfig.staleness_k3, PPO's usual early stop): recomputed here from each step's logged split. Alone on this
    machine the second epoch's k3 is 0.004 at most (not named); in one full CI run, under load, it met the rule at
    step 2 (the run is not deterministic there; why, not investigated)."""
    from tim_plugins.causes import CauseConfig

    result, _, _ = run
    c = CauseConfig()
    stale = [s for s, m in sorted(result.steps.items())
             if m.get("tim/split/staleness_var_share", math.nan) >= c.staleness_share
             and m.get("tim/staleness/token/kl_k3", math.nan) > c.staleness_k3]
    print(f"[dump_report] staleness k3 by step "
          f"{ {s: m.get('tim/staleness/token/kl_k3') for s, m in sorted(result.steps.items())} }; named at {stale}")
    want = sorted([("floor-jump", INJECT_FROM)] + ([("staleness", stale[0])] if stale else []), key=lambda x: x[1])
    assert result.causes() == want, result.causes()
    for step, m in result.steps.items():
        named = (1.0 if step >= INJECT_FROM else 0.0) + (1.0 if step in stale else 0.0)
        assert m["tim/cause/named"] == named, (step, m["tim/cause/named"])
        assert m["tim/cause/sync_bad_tensors"] == 0.0 and m["tim/cause/sync_checked_tensors"] > 0, step
    line = next(x for x in result.output.splitlines() if "tim-plugins cause [floor-jump]" in x)
    assert f"at step {INJECT_FROM}: lag-0 mean |Δ log p| " in line and "Fix (verl):" in line, line
    # the driver closes the run with one line per code named: its windows, first and last steps, and verl's fix
    closing = [x.split("tim-plugins: this run named ", 1)[1] for x in result.output.splitlines()
               if "tim-plugins: this run named [" in x]
    jumps = [s for s in result.steps if s >= INJECT_FROM]
    (jump_line,) = [x for x in closing if x.startswith("[floor-jump]")]
    assert jump_line.startswith(f"[floor-jump] in {len(jumps)} windows, steps {INJECT_FROM} to {max(jumps)} (first: "
                                "lag-0 mean |Δ log p| ") and "Fix (verl):" in jump_line, jump_line
    assert len(closing) == len(want), closing


def test_the_console_logs_the_compact_set_and_the_dump_history_every_metric(run):
    """The default log: verl's tracker (the console here) gets the tim/* metrics read each step (tim_plugins.log_keys),
    the same values as the dump's log_history.jsonl, which also holds the detail families the report reads."""
    from tim_plugins.dump import read_log_history
    from tim_plugins.log_keys import in_step_log

    result, dump, _ = run
    full = {r["step"]: r for r in read_log_history(dump / "log_history.jsonl")}
    assert sorted(result.console) == sorted(full) == list(range(1, STEPS + 1))
    for step, console in result.console.items():
        logged = {k for k in console if k.startswith("tim/")}
        assert logged and all(in_step_log(k) for k in logged) and len(logged) <= 15, (step, sorted(logged))
        assert {"tim/token/kl_k3", "tim/lr/scale", "tim/safe_vocab/boundary_frac"} <= logged
        assert [k for k in logged if console[k] != pytest.approx(full[step][k], rel=1e-12)] == [], step
        for family in ("tim/by_lag/", "tim/by_position/", "tim/split/", "tim/staleness/", "tim/by_prob/"):
            assert any(k.startswith(family) for k in full[step]), (step, family)


def test_k3_is_fp32_noise_then_the_injected_mismatch_as_verl_measures_it(run):
    """verl's k3 counts every response token, tim's leaves out the sampled tokens outside the actor's recomputed
    kept set (boundary tokens, at most one a step with fp32 on both sides): compared on the steps without one."""
    result, _, _ = run
    assert sorted(result.steps) == list(range(1, STEPS + 1))
    compared = 0
    for step, m in sorted(result.steps.items()):
        k3 = m["tim/token/kl_k3"]
        if step < INJECT_FROM:
            assert 0.0 <= k3 < FP32_K3_MAX, step
        else:
            assert K3_LO * (1 - 1e-3) < k3 < K3_HI * (1 + 1e-3), (step, k3)
            if m["tim/safe_vocab/boundary_frac"] == 0.0:
                compared += 1
                assert k3 == pytest.approx(m["rollout_corr/k3_kl"], rel=K3_REL), step
    assert compared >= 1, "every injected step had a boundary token: nothing compared with verl's k3"


def test_the_actor_renormalises_over_the_samplers_own_cut(run):
    """``+tim.safe_vocab.enable=true`` with the user's top_p / top_k and fused kernels: before the injection the
    ratio is 1 to fp32 noise (a full-vocabulary actor would read the kept mass, ~0.8: verl #6240, trl #6789), the
    actor really cut (kept mass in (0, 1), at most top_k tokens kept), at most one sampled token a step falls on the
    other side of the recomputed cut, and every response token is counted (verl's response_length × samples)."""
    result, _, _ = run
    for step, m in sorted(result.steps.items()):
        tokens = m["tim/safe_vocab/tokens"]
        assert tokens == m["response_length/mean"] * 8, step  # 4 prompts x 2 samples
        assert m["tim/safe_vocab/boundary_frac"] * tokens <= 1.0, step
        assert m["tim/tokens"] == round(tokens * (1 - m["tim/safe_vocab/boundary_frac"])), step
        assert 0.0 < m["tim/safe_vocab/pruned_mass_mean"] <= m["tim/safe_vocab/pruned_mass_max"] < 1.0, step
        assert 1.0 <= m["tim/safe_vocab/size_mean"] <= TOP_K, step
        if step < INJECT_FROM:
            assert abs(m["tim/token/ratio_mean"] - 1.0) < 1e-3, step
            # what the same actor over the whole vocabulary reads instead: ρ ≈ the kept mass, far from 1
            assert 1.0 - m["tim/safe_vocab/pruned_mass_mean"] < 1.0 - 1e-2, step


def test_the_kept_set_line_says_recompute_once(run):
    import importlib.metadata

    from tim_plugins.kept_set import kept_set_line

    result, _, _ = run
    line = kept_set_line("verl", importlib.metadata.version("verl"))
    assert "kept set by recompute" in line and result.output.count(line) == 1


def test_the_k3_signal_fires_at_the_injected_step_as_the_core_controller_replays_it(run):
    from tim_plugins.lr_control import LengthTriggeredLRDecay

    result, _, _ = run
    options = dict(LR_OPTIONS, signals=("kl_k3",))
    ctrl = LengthTriggeredLRDecay(**options)
    steps = sorted(result.steps)
    # the engine closes each optimizer step (ppo_epochs=2: two per global step, on the whole batch) with the batch's
    # DP-mean response length (verl's response_length/mean); the step's k3 goes with the first, the second finds the
    # step's monitor empty (NaN: not an observation of the signal)
    def observe(s, k3):
        return ctrl.observe(None, result.steps[s]["response_length/mean"], kl_k3=k3)

    replayed = [(observe(s, result.steps[s]["tim/token/kl_k3"]), observe(s, math.nan))[1] for s in steps]
    logged = [result.steps[s]["tim/lr/scale"] for s in steps]
    assert logged == pytest.approx(replayed, rel=1e-12)
    # the length alone (the same options without the k3 signal) never fires on this run
    length_only = LengthTriggeredLRDecay(**dict(LR_OPTIONS, signals=()))
    assert [length_only.observe(None, result.steps[s]["response_length/mean"]) for s in steps for _ in range(2)] \
        == [1.0] * 2 * len(steps)
    fired_at = next(s for s, scale in zip(steps, logged) if scale < 1.0)
    assert fired_at == INJECT_FROM
    assert result.steps[STEPS]["tim/lr/trigger_count"] == 1.0
    for s in steps:  # verl's own LR log is the scheduler's LR times the scale in force
        assert result.steps[s]["actor/lr"] == pytest.approx(BASE_LR * result.steps[s]["tim/lr/scale"], rel=1e-9), s


def test_the_dump_holds_every_step_and_its_k3_is_the_logged_one(run):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from tim_plugins.dump import DUMP_COLUMNS

    result, dump, files = run
    names = sorted(p.name for p in dump.glob("step_*-rank_*.parquet"))
    assert names == [f"step_{s:08d}-rank_0000.parquet" for s in range(1, STEPS + 1)]
    vocab = len(AutoTokenizer.from_pretrained(files["model"]))
    for s in range(1, STEPS + 1):
        t = pq.read_table(dump / f"step_{s:08d}-rank_0000.parquet").to_pydict()
        assert set(DUMP_COLUMNS) - {"entropy"} <= set(t)
        assert set(t["step"]) == {s}
        d = np.asarray(t["train_logprob"], dtype=np.float64) - np.asarray(t["rollout_logprob"], dtype=np.float64)
        k3 = float(np.mean(np.expm1(d) - d))
        m = result.steps[s]
        # sample_rate 1: every sequence of the step, so every monitored token
        assert len(d) == m["tim/tokens"]
        assert len(set(t["sequence"])) == 8  # 4 prompts x 2 samples (base_overrides)
        assert all(0 <= tok < vocab for tok in t["token_id"])
        if s >= INJECT_FROM:
            assert k3 == pytest.approx(m["tim/token/kl_k3"], rel=DUMP_K3_REL), s
        else:
            assert k3 < FP32_K3_MAX
    from report_reference import assert_same_numbers

    assert_same_numbers(dump)  # the report's streaming queries equal the in-memory computation on verl's own dump


def test_tim_plugins_report_renders_the_verl_dump(run, tmp_path):
    result, dump, files = run
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["framework"] == "verl"
    assert summary["settings"]["model"] == str(files["model"])
    out = tmp_path / "report.html"
    proc, timed_out = run_bounded([sys.executable, "-m", "tim_plugins.apps.cli", "report", str(dump), "--out",
                                   str(out)], 300)
    assert not timed_out and proc.returncode == 0, proc.stdout[-3000:]
    html = out.read_text()
    assert "Parity audit" in html and "fix (verl)" in html
    # the truncation section, in verl's overrides as the run set them (not a min_p=0 it never wrote)
    assert "Truncation (safe vocabulary)" in html and "Kept set: recompute." in html
    assert (f"+tim.safe_vocab.enable=true actor_rollout_ref.rollout.top_p={TOP_P:g} "
            f"actor_rollout_ref.rollout.top_k={TOP_K} ") in html
    # the driver's per-step tim/* series beside the dump (the LR panel draws it)
    from tim_plugins.dump import read_log_history

    history = read_log_history(dump / "log_history.jsonl")
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert [h["tim/lr/scale"] for h in history] == [result.steps[s]["tim/lr/scale"] for s in range(1, STEPS + 1)]
    assert [h["tim/token/kl_k3"] for h in history] == [result.steps[s]["tim/token/kl_k3"] for s in range(1, STEPS + 1)]
    # verl's own reward of each step (its mean sequence score, computed after the update) is the report's reward
    scores = [result.steps[s]["critic/score/mean"] for s in range(1, STEPS + 1)]
    assert [h["critic/score/mean"] for h in history] == scores
    from tim_plugins.report.training_page import step_table

    assert step_table({"log_history": history}, None)["reward"].tolist() == scores
    assert "TIM LR scale (not logged)" not in html and "verl&#x27;s global step" in html.replace("'", "&#x27;")
    # decoded with the run's tokenizer (found through summary.json), not token ids only
    assert "Token ids only" not in html
    assert f"{int(sum(result.steps[s]['tim/tokens'] for s in result.steps))} tokens" in html


def test_the_split_of_the_reused_batch(run):
    """ppo_epochs=2: the first pass over the batch is at lag 0 (staleness exactly 0, the whole log-ratio is the
    mismatch the monitor measured), the second at lag 1 (after the first update). Until the first non-zero gradient
    (GRPO advantages all 0 while every group's rewards tie: verl's grad_norm 0) AdamW moves nothing (weight decay
    off: verl's default 0.01 moves every weight by lr * 0.01 per optimizer step, ~1e-4 nats on a log-prob after
    three) and the staleness part is at most the fp32 noise of another forward (exactly 0 at engine level); from
    then on its momentum moves the weights at every update, even at a zero gradient (2.6e-2 nats or more in two runs).
    After the injection the injected ±DELTA dominates Var(d).

    Each pass counts the tokens its loss trains: the safe vocabulary's boundary tokens of that pass's own forward
    are out of the loss. The first pass is at the measurement's weights (its tokens are the monitor's); the second
    recomputes the top-p / top-k cut after an update, which can move a sampled token across it (one of 59 tokens at
    step 5 in one run)."""
    from tim_plugins.report import build_report

    result, dump, _ = run
    moved_steps = []
    for step, m in sorted(result.steps.items()):
        n, lag0, lag1 = m["tim/tokens"], m["tim/by_lag/0/count"], m["tim/by_lag/1/count"]
        assert m["tim/split/tokens"] == m["tim/staleness/tokens"] == lag0 + lag1  # both passes
        assert lag0 == n and "tim/by_lag/2/count" not in m
        assert n - MOVED_ACROSS_THE_CUT <= lag1 <= n, (step, n, lag1)
        shares = (m["tim/split/staleness_var_share"], m["tim/split/mismatch_var_share"], m["tim/split/cov_share"])
        assert sum(shares) == pytest.approx(1.0, abs=1e-9), step
        moved = bool(moved_steps) or m["actor/grad_norm"] > 0
        moved_steps += [step] if moved else []
        # |s| of one more forward at unchanged weights: 0 or fp32 noise; after an update: far beyond it
        assert (m["tim/staleness/token/abs_diff_max"] > 1e-4) == moved, (step, m["tim/staleness/token/abs_diff_max"])
        if step >= INJECT_FROM:
            # lag 0: the training pass at the rollout's weights against the rollout, i.e. the monitor's measurement
            # up to another forward's fp32 noise
            assert m["tim/by_lag/0/kl_k3"] == pytest.approx(m["tim/token/kl_k3"], rel=1e-3), step
            assert shares[1] > 0.5, (step, shares)
    assert any(s >= INJECT_FROM for s in moved_steps), moved_steps  # the run did update after the injection
    html = build_report(dump, dump.parent / "split_report.html").read_text()
    # pooled over the run (weighted by Var(d)), the injected steps dominate: the verdict's fix in verl's terms
    assert "Mismatch or staleness?" in html and "Mismatch dominates" in html and "logprobs_mode" in html
