"""verl's bypass mode with the monitor: ``algorithm.rollout_correction.bypass_mode=true`` (verl's
``RolloutCorrectionConfig.bypass_*`` presets) copies the rollout's log-probs into ``old_log_probs`` and skips the
old-log-prob pass (``PPOTrainer._compute_old_log_prob``). The actor's first training pass of each step then runs at
the weights that sampled the batch (the sync trainer): the monitor measures the rollout against that pass.

One ``python -m verl.trainer.main_ppo`` run (V1 trainer, GRPO, FSDP2 actor, vLLM CPU-build rollout, the toy model),
fp32 on both sides, a mismatch of known size injected from step INJECT_FROM on (``cpu_site/inject_mismatch.py``: the
rollout's stored log-probs shifted by ±DELTA token by token, before verl copies them into ``old_log_probs``).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

import main_ppo_run as M  # noqa: E402

pytestmark = pytest.mark.slow

STEPS, INJECT_FROM, DELTA = 5, 3, 0.3
BASE_LR = 1e-4
RUN_TIMEOUT_S = 900
SAMPLES = 8  # base_overrides: 4 prompts x 2 samples, one PPO mini-batch
# Before the injection both sides run fp32: k3 is kernel noise (~1e-13, test_verl_main_ppo.py).
FP32_K3_MAX = 1e-9
# d = ±DELTA alternately over the batch's response tokens (plus fp32 noise ~1e-7): per token exp(d) - 1 - d is
# K3_HI for +DELTA and K3_LO for -DELTA.
K3_LO, K3_HI = math.exp(-DELTA) - 1 + DELTA, math.exp(DELTA) - 1 - DELTA
# verl's actor/ppo_kl is a float32 token mean of log π_rollout - log π_θ on the same pass: float32 rounding of d
# (~3e-8 at DELTA) summed over ~100 tokens, against means of up to DELTA / n after the injection.
PPO_KL_ABS = 1e-6


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_model_path):
    wd = tmp_path_factory.mktemp("bypass")
    files = M.prepare(wd, toy_model_path)
    overrides = M.base_overrides(files, wd, steps=STEPS, lr=BASE_LR) + M.CPU_OVERRIDES + [
        "trainer.v1.trainer_mode=tim_sync",
        "+tim.monitor.enable=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.rollout_correction.bypass_mode=true",
        # the whole batch in one micro-batch and one epoch: verl's loss metrics are token means over exactly the
        # tokens of the pass the monitor measures
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={SAMPLES}",
        "actor_rollout_ref.actor.ppo_epochs=1",
    ]
    result = M.run_main_ppo(overrides, cwd=wd, timeout=RUN_TIMEOUT_S, log_path=wd / "run.log",
                            extra_env={"TIM_TEST_INJECT_MISMATCH": f"{INJECT_FROM}:{DELTA}"})
    print(f"[bypass] exit {result.returncode} after {result.seconds:.0f} s; log {wd / 'run.log'}")
    if result.returncode != 0:
        pytest.fail(f"main_ppo failed (exit {result.returncode}):\n{result.output[-4000:]}")
    return result


def test_the_monitor_measures_the_first_training_pass_against_the_rollout(run):
    """fp32 noise before the injection, then the injected mismatch: per token alternately K3_HI and K3_LO, so the
    batch's k3 is their mean up to one token's imbalance (the alternation runs over the same response tokens the
    monitor counts)."""
    assert sorted(run.steps) == list(range(1, STEPS + 1))
    for step, m in sorted(run.steps.items()):
        k3, n = m["tim/token/kl_k3"], m["tim/tokens"]
        assert n == m["response_length/mean"] * SAMPLES, step  # every response token of the batch
        if step < INJECT_FROM:
            assert 0.0 <= k3 < FP32_K3_MAX, (step, k3)
        else:
            mid, imbalance = (K3_HI + K3_LO) / 2, (K3_HI - K3_LO) / (2 * n)
            assert abs(k3 - mid) <= imbalance + 1e-6, (step, k3, mid, imbalance)
        # π_old is the rollout: no exact split of the training passes (the start-up note says so) ...
        assert not [k for k in m if k.startswith(("tim/staleness/", "tim/split/"))], step
        # ... but each pass keyed by its policy lag: one mini-batch, one epoch, so lag 0 alone, the measured pass
        assert {k for k in m if k.startswith("tim/by_lag/") and k.endswith("/count")} == {"tim/by_lag/0/count"}
        assert m["tim/by_lag/0/count"] == n, step
        # the same tokens' k3, summed by another kernel (the monitor's fused sums, by_key's float64 ones): equal to
        # float rounding (4e-9 relative seen), where one token more or less moves it by ~1/n (a few %)
        assert m["tim/by_lag/0/kl_k3"] == pytest.approx(k3, rel=1e-6, abs=1e-15), step
    assert "with no exact split (tim/staleness/*, tim/split/*: π_old is the rollout)" in run.output


def test_the_measured_k1_is_verls_ppo_kl_on_the_same_pass(run):
    """verl's ``actor/ppo_kl`` (the PPO loss's token mean of old - current log-probs, old being the rollout's in
    bypass mode) on the one micro-batch of the one epoch is ``tim/token/kl_k1``, mean(log π_rollout - log π_θ), of
    the pass the monitor measured."""
    for step, m in sorted(run.steps.items()):
        assert m["tim/token/kl_k1"] == pytest.approx(m["actor/ppo_kl"], abs=PPO_KL_ABS), step
        # the same pass keyed by lag: its mean log π_θ - log π_rollout
        assert m["tim/by_lag/0/mean"] == pytest.approx(-m["actor/ppo_kl"], abs=PPO_KL_ABS), step


def test_the_injected_mismatch_is_named_a_floor_jump_and_nothing_else(run):
    assert run.causes() == [("floor-jump", INJECT_FROM)], run.causes()
