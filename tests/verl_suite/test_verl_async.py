"""verl's asynchronous trainer mode through its own ``python -m verl.trainer.main_ppo`` (#39): ``tim_colocate_async``
(verl's ``colocate_async`` with the tim hooks: rollout and actor share the devices, generation runs on while the
actor trains, ``num_warmup_batches`` batches ahead), GRPO, FSDP2 actor, vLLM CPU-build rollout, the toy model, fp32
on both sides, and a mismatch of known size injected from the first step (``cpu_site/inject_mismatch.py``: the
rollout's stored log-probs shifted by ±DELTA token by token). One run, 6 steps, verl's default one warm-up batch and
two PPO epochs: the batches of the odd steps are drawn by the weights that score them, those of the even steps one
weight version (two optimizer steps) earlier, and every batch trains twice.

References, independent of tim's accumulators: verl's own ``training/off_policy/trajectory_staleness_worst/*``
(computed by verl's driver from the same weight-version tags) for the lags, verl's ``response_length/mean`` for the
token counts, and the injected DELTA for the mismatch floor. Checked: each token is keyed by its sample's lag; the
monitor measures the samples drawn by the weights that score them only (lag 0: the injected mismatch, on every step
whatever the staleness of the rest); the k3 by lag is flat at that floor at lag 0 and above it at every lag beyond; the report
of the run's dump answers "Mismatch or staleness?" by lag, with the fix in verl's terms; every weight sync is checked
and clean, and the staleness by lag is named live where its rule says.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

import main_ppo_run as M  # noqa: E402

pytestmark = pytest.mark.slow

STEPS, WARMUP, EPOCHS, DELTA = 6, 1, 2, 0.1
BATCH, N = 4, 2  # prompts per step, samples per prompt (base_overrides)
RUN_TIMEOUT_S = 900
# d = ±DELTA per token plus fp32 noise (~1e-7): k3 = mean(exp(d) - 1 - d) between the two signs' values
K3_LO, K3_HI = math.exp(-DELTA) - 1 + DELTA, math.exp(DELTA) - 1 - DELTA


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_model_path):
    wd = tmp_path_factory.mktemp("verl_async")
    files = M.prepare(wd, toy_model_path)
    dump = wd / "tim_dump"
    overrides = M.base_overrides(files, wd, steps=STEPS, batch=BATCH, n=N) + M.CPU_OVERRIDES + [
        "trainer.v1.trainer_mode=tim_colocate_async",
        f"trainer.v1.colocate_async.num_warmup_batches={WARMUP}",
        f"actor_rollout_ref.actor.ppo_epochs={EPOCHS}",
        "+tim.monitor.enable=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"+tim.dump.dir={dump}",
        "+tim.dump.sample_rate=1.0",
    ]
    result = M.run_main_ppo(overrides, cwd=wd, timeout=RUN_TIMEOUT_S, log_path=wd / "run.log",
                            extra_env={"TIM_TEST_INJECT_MISMATCH": f"1:{DELTA}"})
    print(f"[verl_async] exit {result.returncode} after {result.seconds:.0f} s; log {wd / 'run.log'}")
    if result.returncode != 0:
        pytest.fail(f"main_ppo failed (exit {result.returncode}):\n{result.output[-4000:]}")
    return result, dump


def _lags(m: dict) -> dict[int, tuple[float, float]]:
    """{lag: (tokens, k3)} of one step's tim/by_lag/*."""
    return {int(k.split("/")[2]): (v, m[k.replace("/count", "/kl_k3")]) for k, v in m.items()
            if k.startswith("tim/by_lag/") and k.endswith("/count") and v > 0}


def test_each_token_is_keyed_by_the_lag_verl_reports_for_its_trajectory(run):
    result, _ = run
    assert sorted(result.steps) == list(range(1, STEPS + 1))
    seen = set()
    for step, m in sorted(result.steps.items()):
        lags = _lags(m)
        # EPOCHS optimizer steps per weight version (one mini-batch): the lag in optimizer steps is EPOCHS × the
        # trajectory's age in versions, counted from its oldest one (verl's "worst" staleness), plus the updates
        # since the step began (0 .. EPOCHS - 1)
        assert min(lags) == EPOCHS * m["training/off_policy/trajectory_staleness_worst/min"], (step, lags)
        assert max(lags) == EPOCHS * m["training/off_policy/trajectory_staleness_worst/max"] + EPOCHS - 1, (step, lags)
        # every response token of the step, once per epoch (single-turn: the response length is its trained tokens)
        tokens = m["response_length/mean"] * BATCH * N
        assert sum(n for n, _ in lags.values()) == pytest.approx(EPOCHS * tokens, rel=1e-9)
        # the monitor measures the samples drawn by the weights that score them, and only those
        assert m.get("tim/tokens", 0.0) == lags.get(0, (0.0, 0.0))[0], step
        assert not any(k.startswith(("tim/split/", "tim/staleness/")) for k in m), step
        assert m.get("tim/diag/async_lag_unknown", 0.0) == 0.0
        seen |= set(lags)
    assert seen == {0, 1, 2, 3}, seen  # fresh and one-version-old batches, each trained twice


def test_the_mismatch_floor_is_flat_at_lag_0_and_every_stale_lag_lies_above_it(run):
    result, _ = run
    pooled: dict[int, list[float]] = {}
    for step, m in sorted(result.steps.items()):
        for lag, (n, k3) in _lags(m).items():
            pooled.setdefault(lag, [0.0, 0.0])
            pooled[lag][0] += n
            pooled[lag][1] += n * k3
        if m.get("tim/tokens", 0) > 0:
            # the lag-0 samples of every step carry the injected mismatch and nothing else (fp32 both sides)
            assert K3_LO * (1 - 1e-3) <= m["tim/token/kl_k3"] <= K3_HI * (1 + 1e-3), (step, m["tim/token/kl_k3"])
            assert m["tim/by_lag/0/kl_k3"] == pytest.approx(m["tim/token/kl_k3"], rel=1e-3), step
    k3 = {lag: total / n for lag, (n, total) in pooled.items()}
    print("[verl_async] pooled k3 by lag:", {lag: round(v, 6) for lag, v in sorted(k3.items())})
    assert K3_LO * (1 - 1e-3) <= k3[0] <= K3_HI * (1 + 1e-3), k3
    # the policy moved between sampling and training: every lag above the floor. Not monotonic beyond that (seen
    # run to run): a second epoch re-scores tokens the first one trained on, and a PPO update can move them toward
    # the rollout as well as away from it.
    assert all(k3[lag] > K3_HI for lag in (1, 2, 3)), k3


def test_the_report_answers_mismatch_or_staleness_by_lag_in_verls_terms(run):
    from html import escape as html_escape

    from tim_plugins.fixes import part_fix
    from tim_plugins.report import build_report

    _, dump = run
    html = build_report(dump, dump.parent / "async_report.html").read_text()
    assert "Mismatch or staleness?" in html and "statistical: by policy lag" in html
    assert "Staleness dominates" in html
    assert html_escape(part_fix("staleness_async", "verl")) in html and "num_warmup_batches" in html


def test_every_weight_sync_is_checked_and_only_the_staleness_by_lag_is_named(run, toy_model_path):
    """colocate_async syncs the rollout after each step's update (verl's naive checkpoint engine): each step's window
    holds one checked sync that compared every tensor the actor streamed (transformers' state dict of the checkpoint)
    and found none bad; the injected ±DELTA mismatch is a floor, not a cause. What is named is staleness, at the
    steps where the tokens trained at lag >= 1 (two PPO epochs at this toy's learning rate of 1e-3, and the samples
    drawn a version back) have a k3 whose part above the lag-0 floor is at least half of it and above 0.015
    (``CauseConfig``; measured: 0.1-0.9 against 0.005), recomputed from the step's logged k3 by lag (checked against
    verl's own lags and the injected floor above: ``main_ppo_run.Run.lag_staleness_steps``), and the run closes with
    its one line."""
    from transformers import AutoModelForCausalLM

    from tim_plugins.causes import cause_fix

    result, _ = run
    n = len(AutoModelForCausalLM.from_pretrained(str(toy_model_path)).state_dict())
    want = result.lag_staleness_steps()
    assert want, "no step trained stale tokens past the rule: the test's premise failed"
    for step, m in sorted(result.steps.items()):
        assert m["tim/cause/confident_disagreements"] == 0.0, step
        assert m["tim/cause/sync_checked_tensors"] == n and m["tim/cause/sync_bad_tensors"] == 0.0, step
        assert not any(k.startswith("tim/diag/sync_check") for k in m), step
        assert m["tim/cause/named"] == (1.0 if step in want else 0.0), step
    causes = [x for x in result.output.splitlines() if "tim-plugins cause [" in x]
    assert causes and all("tim-plugins cause [staleness]" in x for x in causes)
    span = f"at step {want[0]}" if len(want) == 1 else f"in {len(want)} windows, steps {want[0]} to {want[-1]}"
    closing = [x for x in result.output.splitlines() if "tim-plugins: this run named [" in x]
    assert len(closing) == 1 and f"this run named [staleness] {span} (first: " in closing[0]
    assert closing[0].endswith(f"Fix (verl): {cause_fix('staleness', 'verl')}")
