"""verl's own ``python -m verl.trainer.main_ppo`` with two actor ranks (``trainer.n_gpus_per_node=2`` on two logical
Ray GPUs: two FSDP2 workers in one gloo group, parameters sharded, and two vLLM CPU rollout servers), the recipe's
tim overrides and a bf16 rollout against the fp32 actor (a real mismatch, k3 2e-5 .. 6e-5 per token here). 3 steps of 4 prompts x 2
samples; each rank measures its half of the batch in two micro-batches.

References, independent of tim's merge:
- verl's own metrics, which the driver computes on the whole batch: ``rollout_corr/k3_kl``, ``rollout_corr/kl``,
  ``rollout_corr/chi2_token``, ``training/rollout_probs_diff_{max,mean}``, ``response_length/mean``;
- each rank's own unmerged statistics, recorded inside the Ray workers at the merge by the test-only
  ``cpu_site/rank_values.py``: the logged values are their merge by definition (token-weighted means, sums,
  extremes) and differ from each rank's, so the checks against verl's full-batch metrics could fail.

Cost on the 2-core machine (measured): 1.5 min idle, up to 4 min under other load (start-up: Ray, two FSDP
workers, two vLLM servers; step 1 25-35 s, later steps ~3 s); the process tree peaks at 8.5 GiB PSS with
``CPU_OVERRIDES``' one reward worker, one TransferQueue storage unit and 64 MiB KV caches (14.8 GiB with verl's
defaults and 1 GiB KV caches).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

import main_ppo_run as M  # noqa: E402
from test_verl_main_ppo import K3_FP32_ABS, K3_REL, MIN_P  # noqa: E402

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 900
STEPS = (1, 2, 3)
PROMPTS, SAMPLES = 4, 2
RESPONSES = PROMPTS * SAMPLES  # per step, over both ranks
# verl computes its full-batch metrics in float32 on the driver, tim sums float64 over float32 per-token values:
# means of O(1e-2) per-token values agree to ~1e-6 relative; verl's chi2 = E[ρ²] − 1 and |p_train − p_rollout|
# (exp of each side, then the difference) carry float32 rounding at 1, ~1.2e-7 absolute.
MEAN_REL = 1e-4
FP32_AT_ONE = 2 * 2.0**-23
# tim's own merge: each rank's sums (mean x count) added again here, rounding only (float64).
MERGE_REL = 1e-12


def _overrides(files: dict, wd: Path) -> list[str]:
    base = M.base_overrides(files, wd, steps=len(STEPS), batch=PROMPTS, n=SAMPLES)
    one_gpu = ("trainer.n_gpus_per_node=", "+ray_kwargs.ray_init.num_gpus=")
    cpu = [o for o in M.CPU_OVERRIDES if not o.startswith(one_gpu)]
    return base + cpu + M.recipe_tim_overrides(MIN_P) + [
        "trainer.n_gpus_per_node=2",
        "+ray_kwargs.ray_init.num_gpus=2",  # two logical GPUs: two actor ranks, one vLLM server each
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # two micro-batches per rank
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.dtype=bfloat16",  # a real mismatch against the fp32 actor
        "++tim.parity.strict=false",  # the audit reports the dtype mismatch as an error
        # the LR controller's length signal, unsmoothed (window 1) and never triggering: tim/lr/window_length is
        # the step's mean response length, merged over both ranks
        "+tim.lr_decay.options.window=1", "+tim.lr_decay.options.warmup_steps=100",
        # Each rank gets its half of the batch in order (see _prompts): verl's balancing reorders the rows so that
        # the ranks get equal token counts, and a run where it did so exactly on every step (17/17, 16/16, 42/42
        # response tokens) left no step where a rank's own mean length differs from the merged one.
        "trainer.balance_batch=false",
        # the per-token dump, every sequence: one file per step and rank
        f"+tim.dump.dir={wd / 'tim_dump'}", "+tim.dump.sample_rate=1.0",
    ]


def _prompts(steps: int = len(STEPS)) -> list[str]:
    """Each step's PROMPTS prompts: two arithmetic ones, then two sorting ones. With ``trainer.balance_batch=false``
    rank 0 gets the arithmetic half of the batch (a prompt's samples side by side, as verl repeats them) and rank 1
    the sorting half: two independent draws of 4 responses each (measured 31/26, 33/38, 37/26 tokens), equal on a
    step only by coincidence (a few % per step), so on some step a rank's own mean length differs from the
    merged one and the checks that tell a merged value from one rank's own can fail. With verl's balancing the
    ranks' token counts were made equal, and on the failing run they were on every step."""
    from tim_plugins.toy_model import synthetic_prompts

    toy = synthetic_prompts(3 * PROMPTS * steps)
    arithmetic, sorting = toy[0::3], toy[1::3]  # synthetic_prompts cycles arithmetic, sorting, free text
    half = PROMPTS // 2
    return [p for i in range(steps) for p in arithmetic[i * half:(i + 1) * half] + sorting[i * half:(i + 1) * half]]


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_model_path):
    wd = tmp_path_factory.mktemp("main_ppo_two_ranks")
    files = M.prepare(wd, toy_model_path, prompts=_prompts())
    values = wd / "rank_values"
    values.mkdir()
    result = M.run_main_ppo(_overrides(files, wd), cwd=wd, timeout=RUN_TIMEOUT_S, log_path=wd / "run.log",
                            extra_env={"TIM_TEST_RANK_VALUES_DIR": str(values)})
    print(f"[main_ppo 2 ranks] exit {result.returncode} after {result.seconds:.0f} s; per-step seconds "
          f"{ {s: round(t, 2) for s, t in result.step_times.items()} }; log {wd / 'run.log'}")
    assert result.returncode == 0, result.output[-4000:]
    records = {}
    for path in sorted(values.glob("rank_values-*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        records[lines[0]["rank"]] = lines
    return result, records, wd


def _rank_steps(records: dict) -> dict[int, list[dict]]:
    """{step: [rank 0's record, rank 1's record]}: each rank merges once per step (after the old-log-prob pass)."""
    assert sorted(records) == [0, 1]
    for lines in records.values():
        assert len(lines) == len(STEPS)
    return {step: [records[r][i] for r in (0, 1)] for i, step in enumerate(STEPS)}


def test_two_actor_ranks_merge_once_per_step(run):
    result, records, _ = run
    assert sorted(result.steps) == list(STEPS)
    per_step = _rank_steps(records)
    for step, (r0, r1) in per_step.items():
        assert r0["pid"] != r1["pid"]  # two worker processes, one gloo group of two
        assert (r0["group_rank"], r1["group_rank"], r0["group_size"], r1["group_size"]) == (0, 1, 2, 2)
        assert r0["sync"] and r1["sync"]
        assert r0["merged"] == r1["merged"]  # every rank holds the merged values
        logged = result.steps[step]
        for key, value in r0["merged"].items():  # the driver logs them as merged (console: full float repr)
            if key.startswith("tim/lr/"):  # the LR controller's state after the update, collected later
                continue
            assert logged[key] == value or (math.isnan(value) and math.isnan(logged[key])), (step, key)
    # one console line per step carries the tim/ metrics
    lines = [line for line in result.output.splitlines() if "tim/tokens:" in line]
    assert [int(re.search(r"step:(\d+) - ", line).group(1)) for line in lines] == list(STEPS)


def test_counts_are_the_whole_batch(run):
    result, records, _ = run
    for step, ranks in _rank_steps(records).items():
        m = result.steps[step]
        local = [r["local"] for r in ranks]
        # every response token of the step, over both ranks: verl's own mean response length x responses
        assert m["tim/safe_vocab/tokens"] == m["response_length/mean"] * RESPONSES
        assert m["tim/safe_vocab/tokens"] == sum(v["tim/safe_vocab/tokens"] for v in local)
        assert m["tim/tokens"] == sum(v["tim/tokens"] for v in local)
        assert m["tim/tokens"] == round(m["tim/safe_vocab/tokens"] * (1 - m["tim/safe_vocab/boundary_frac"]))
        assert m["tim/seq/count"] == RESPONSES == sum(v["tim/seq/count"] for v in local)
        for key in [k for k in m if k.startswith("tim/by_prob/") and k.endswith("/count")]:
            assert m[key] == sum(v[key] for v in local), (step, key)
        assert all(0 < v["tim/tokens"] < m["tim/tokens"] for v in local)
        # the LR controller's length (window 1): the step's mean response length over both ranks, as verl logs it;
        # a rank's own (its 4 responses) differs on some step (_prompts)
        assert m["tim/lr/window_length"] == pytest.approx(m["response_length/mean"], rel=1e-12)
        print(f"step {step}: tokens rank0 {local[0]['tim/tokens']:.0f} rank1 {local[1]['tim/tokens']:.0f} logged "
              f"{m['tim/tokens']:.0f} (verl: {m['response_length/mean']} x {RESPONSES}); boundary "
              f"{m['tim/safe_vocab/boundary_frac']:.3g}")
    assert any(v["tim/safe_vocab/tokens"] / v["tim/seq/count"] != result.steps[step]["response_length/mean"]
               for step, ranks in _rank_steps(records).items() for v in (r["local"] for r in ranks))


def test_means_and_extremes_equal_verl_full_batch_metrics(run):
    """On the steps where tim measured every response token (no boundary token left out), tim's statistics and
    verl's full-batch ones are the same quantities over the same tokens; each rank's own value is not."""
    result, records, _ = run
    pairs = {  # tim key: (verl key, relative, absolute tolerance)
        "tim/token/kl_k3": ("rollout_corr/k3_kl", K3_REL, K3_FP32_ABS),
        "tim/token/kl_k1": ("rollout_corr/kl", MEAN_REL, FP32_AT_ONE),
        "tim/token/chi2": ("rollout_corr/chi2_token", MEAN_REL, FP32_AT_ONE),
        "tim/token/prob_abs_diff_max": ("training/rollout_probs_diff_max", MEAN_REL, FP32_AT_ONE),
        "tim/token/prob_abs_diff_mean": ("training/rollout_probs_diff_mean", MEAN_REL, FP32_AT_ONE),
    }
    compared, discriminated = 0, set()
    for step, ranks in _rank_steps(records).items():
        m = result.steps[step]
        if m["tim/safe_vocab/boundary_frac"] != 0.0:
            continue
        compared += 1
        # bf16 vs fp32 on the toy model's short answers: k3 2e-5 .. 8e-5; verl's float32 k3 sits on a grid of
        # ~1.2e-7, so the tolerance is a few % of the signal; one rank's own k3 differed from both ranks' by
        # 0.6-70 % (measured)
        assert 20 * K3_FP32_ABS < m["tim/token/kl_k3"]
        for key, (verl_key, rel, abs_) in pairs.items():
            # verl's kl is E[log p_rollout − log p_train]; tim's k1 the same estimator of KL(rollout ‖ train)
            assert m[key] == pytest.approx(m[verl_key], rel=rel, abs=abs_), (step, key, m[key], m[verl_key])
            # would one rank's value have failed? (a maximum: the rank that does not hold it)
            differ = [r["local"][key] != pytest.approx(m[verl_key], rel=rel, abs=abs_) for r in ranks]
            if any(differ) if key.endswith("_max") else all(differ):
                discriminated.add(key)
        print(f"step {step}: k3 rank0 {ranks[0]['local']['tim/token/kl_k3']:.6g} rank1 "
              f"{ranks[1]['local']['tim/token/kl_k3']:.6g} logged {m['tim/token/kl_k3']:.6g} verl "
              f"{m['rollout_corr/k3_kl']:.6g}")
    assert compared >= 2, "boundary tokens on most steps: nothing to compare with verl's full-batch metrics"
    # Rollouts differ run to run, and on one step the two ranks' values may happen to lie close together: each
    # comparison must have been able to fail on some step.
    assert discriminated == set(pairs), sorted(set(pairs) - discriminated)


def test_logged_values_merge_the_ranks_own(run):
    """Every statistic logged is the exact merge of the two ranks' own: token-weighted means, sums, extremes."""
    result, records, _ = run
    weights = {"tim/safe_vocab/": "tim/safe_vocab/tokens", "tim/seq/log_ratio_mean": "tim/seq/count"}
    maxima = ("_max", "_p99", "_p999")  # p99/p999: the histograms merge, here capped at each rank's max
    for step, ranks in _rank_steps(records).items():
        m = result.steps[step]
        local = [r["local"] for r in ranks]
        for key in local[0]:
            values = [v[key] for v in local]
            if key.endswith(("/count", "tokens")):
                want = sum(values)
            elif key.endswith("ratio_min"):
                want = min(values)
            elif key.endswith(maxima) and not key.endswith(("_p99", "_p999")):
                want = max(values)
            elif key.endswith(("_p99", "_p999")):
                continue  # a quantile of the merged histogram, not a function of the ranks' quantiles
            elif key.startswith("tim/by_prob/"):
                count = key.rsplit("/", 1)[0] + "/count"
                n = [v[count] for v in local]
                want = sum(x * k for x, k in zip(values, n) if k) / sum(n) if sum(n) else math.nan
            else:
                weight = next((w for p, w in weights.items() if key.startswith(p)), "tim/tokens")
                n = [v[weight] for v in local]
                want = sum(x * k for x, k in zip(values, n)) / sum(n)
            if math.isnan(want):
                assert math.isnan(m[key]), (step, key)
            else:
                assert m[key] == pytest.approx(want, rel=MERGE_REL, abs=1e-15), (step, key, m[key], want)


def test_each_rank_dumps_its_own_half_and_the_union_is_the_logged_step(run):
    import numpy as np
    import pyarrow.parquet as pq

    result, records, wd = run
    folder = wd / "tim_dump"
    names = sorted(p.name for p in folder.glob("step_*-rank_*.parquet"))
    assert names == [f"step_{s:08d}-rank_{r:04d}.parquet" for s in STEPS for r in (0, 1)]
    for step, ranks in _rank_steps(records).items():
        d_all = []
        for r, rec in enumerate(ranks):
            t = pq.read_table(folder / f"step_{step:08d}-rank_{r:04d}.parquet").to_pydict()
            assert set(t["rank"]) == {r} and set(t["step"]) == {step}
            assert len(t["token_id"]) == rec["local"]["tim/tokens"]  # this rank's own measured tokens
            d_all.append(np.asarray(t["train_logprob"], np.float64) - np.asarray(t["rollout_logprob"], np.float64))
        d = np.concatenate(d_all)
        assert len(d) == result.steps[step]["tim/tokens"]
        assert float(np.mean(np.expm1(d) - d)) == pytest.approx(result.steps[step]["tim/token/kl_k3"], rel=1e-5)



def test_the_weight_syncs_of_both_replicas_are_checked_and_name_no_cause(run):
    """Each rank reads its own replica's vLLM server at each sync and the reports meet on the first rank that holds
    outputs (through the world group): every step's window compared every tensor the actor streams (transformers'
    state dict of the checkpoint; the window keeps the largest report's count, so this does not tell the two
    replicas' reports apart) and named nothing (a bf16 rollout: the actor's fp32 cast to bf16 is what it holds)."""
    from transformers import AutoModelForCausalLM

    result, _, wd = run
    n = len(AutoModelForCausalLM.from_pretrained(str(wd / "model")).state_dict())
    for step, m in result.steps.items():
        assert m["tim/cause/named"] == 0.0 and m["tim/cause/confident_disagreements"] == 0.0, step
        assert m["tim/cause/sync_checked_tensors"] == n and m["tim/cause/sync_bad_tensors"] == 0.0, step
        assert not any(k.startswith("tim/diag/sync_check") for k in m), step
    assert "tim-plugins cause [" not in result.output
