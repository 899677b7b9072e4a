"""`python -m benchmarks.study --quick`: real TRL GRPO runs with the TIM callback (exact sampler, the zero-mismatch
control, bf16 and fp16 engines, the measured-profile injector, the length-surge task with LR decay, an IS
correction and the safe vocabulary), the trained policy's held-out evaluation, paired analysis, report and
per-run resume. One quick study shared by the module (~2-3 min); the task, evaluation and analysis pieces are
also checked against naive references."""

from __future__ import annotations

import csv
import json
import math
import random
import statistics
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("matplotlib")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from benchmarks.study import analysis  # noqa: E402
from benchmarks.study.arms import SCENARIOS, StudyConfig, build_arms, degradation_rule  # noqa: E402
from benchmarks.study.main import QUICK  # noqa: E402
from benchmarks.study.main import main as study_main  # noqa: E402
from benchmarks.study.task import EOS, VOCAB, chain_stats, reward_for  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.slow]

QUICK_ARMS = QUICK["arms"]
STEPS = QUICK["steps"]


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    study_main(["--quick", "--out", str(out), "--workers", "2"])
    return out


# ------------------------------------------------------------------------------------------- the task
def _naive_stats(prompt, tokens):
    letters = set(prompt[:-1])
    body = tokens[: tokens.index(EOS)] if EOS in tokens else tokens
    ok = [t in letters and (i == 0 or t != body[i - 1]) for i, t in enumerate(body)]
    prefix = next((i for i, good in enumerate(ok) if not good), len(ok))
    return prefix, sum(ok), not all(ok), len(body)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(VOCAB[1:]), max_size=40), st.randoms(use_true_random=False))
def test_chain_stats_matches_a_naive_reference(tokens, rnd):
    prompt = "".join(rnd.sample("abcdefgh", 4)) + "="
    if rnd.random() < 0.5:  # mostly valid chains too
        tokens = [rnd.choice([c for c in prompt[:-1] if not tokens or c != tokens[-1]]) for _ in range(30)] + tokens
    assert chain_stats(prompt, tokens) == _naive_stats(prompt, tokens)


def test_rewards_chain_and_surge():
    ids = {t: i for i, t in enumerate(VOCAB)}
    prompt = "abcd="
    comps = [[ids[c] for c in "abcabd"], [ids[c] for c in "abba"] + [ids[EOS]], [ids[c] for c in "ab"] + [ids["<pad>"]]]
    chain = reward_for("chain", budget=8)
    assert chain([prompt] * 3, None, completion_ids=comps) == [6 / 8, 2 / 8, 2 / 8]
    surge = reward_for("chain_stop", budget=8, surge_after=5)
    early = surge([prompt] * 3, None, completion_ids=comps, trainer_state=SimpleNamespace(global_step=4))
    assert early == [1.0, 3 / 4, 2 / 3]  # valid tokens / length: length-neutral in expectation
    late = surge([prompt] * 3, None, completion_ids=comps, trainer_state=SimpleNamespace(global_step=5))
    assert late == [6 / 8, 2 / 8, 2 / 8]  # valid prefix / budget: favours long valid chains


def test_evaluation_leaves_the_training_run_untouched(quick_study):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.study.evaluate import evaluate_policy
    from benchmarks.study.task import make_prompts, task_spec

    study = json.loads((quick_study / "study.json").read_text())
    path = study["model_paths"]["chain"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    prompts = make_prompts(QUICK["eval_prompts"], task_spec("chain"), seed=999_999)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    got = {mode: evaluate_policy(model, tok, prompts, QUICK["budget"], temperature=t, seed=4321)
           for mode, t in (("greedy", 0.0), ("sample", 1.0))}
    assert torch.equal(torch.get_rng_state(), state) and model.training  # RNG and mode restored
    # the runs' step-0 evaluation is this one (same weights, same prompts, same seed), for every engine:
    # the bf16/fp16 engines patched onto the instance are bypassed
    for arm in ("exact", "control", "bf16", "fp16", "profile_x30"):
        row = _rows(quick_study / "runs" / arm / "seed0.eval.csv")[0]
        assert int(row["step"]) == 0
        for mode in ("greedy", "sample"):
            for key, value in got[mode].items():
                assert float(row[f"eval/{mode}/{key}"]) == pytest.approx(value, rel=1e-12, abs=1e-12), (arm, key)
    # an independent count of the greedy reward: decode, then the naive chain rule
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=QUICK["budget"], pad_token_id=tok.pad_token_id)
    comp = out[:, enc["input_ids"].shape[1]:].tolist()
    naive = [_naive_stats(p, [VOCAB[i] for i in ids])[0] / QUICK["budget"] for p, ids in zip(prompts, comp)]
    assert got["greedy"]["reward"] == pytest.approx(sum(naive) / len(naive))


# ---------------------------------------------------------------------------------------- the runs
def test_outputs_per_arm_and_seed(quick_study):
    evals_at = sorted({s for s in range(0, STEPS + 1) if s % QUICK["eval_every"] == 0} | {STEPS})
    for arm in QUICK_ARMS:
        rows = _rows(quick_study / "runs" / arm / "seed0.csv")
        assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
        for r in rows:  # every step, from trainer.state.log_history
            for key in ("reward", "tim/token/kl_k3", "completions/mean_length", "entropy", "grad_norm",
                        "lr_scale", "step_time_s"):
                assert math.isfinite(float(r[key])), (arm, key, r[key])
        ev = _rows(quick_study / "runs" / arm / "seed0.eval.csv")
        assert [int(r["step"]) for r in ev] == evals_at
        for r in ev:
            for mode in ("greedy", "sample"):
                assert 0.0 <= float(r[f"eval/{mode}/reward"]) <= 1.0
                assert 0.0 <= float(r[f"eval/{mode}/error_frac"]) <= 1.0
    summary = json.loads((quick_study / "summary.json").read_text())
    assert [row["arm"] for row in summary["rows"]] == list(QUICK_ARMS)
    assert summary["degradation_rule"] == degradation_rule()
    pairs = {(c["arm"], c["vs"]) for c in summary["comparisons"]}
    assert ("profile_x30", "control") in pairs and ("bf16", "control") in pairs and ("exact", "control") in pairs
    assert ("profile_x30+token_tis", "profile_x30") in pairs and ("profile_x30+token_tis", "control") in pairs
    assert ("control+lr_decay@surge", "control@surge") in pairs
    html = (quick_study / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4 and "Degradation rule" in html


def test_exact_arm_reads_zero_mismatch_every_step(quick_study):
    rows = _rows(quick_study / "runs" / "exact" / "seed0.csv")
    assert [float(r["tim/token/kl_k3"]) for r in rows] == [0.0] * STEPS  # bitwise, not "small"
    assert [float(r["tim/token/abs_diff_max"]) for r in rows] == [0.0] * STEPS
    assert all(float(r["tim/tokens"]) > 0 for r in rows)


def _k3(study, arm):
    return [float(r["tim/token/kl_k3"]) for r in _rows(study / "runs" / arm / "seed0.csv")]


def test_engines_order_their_mismatch(quick_study):
    control, bf16, fp16 = (_k3(quick_study, a) for a in ("control", "bf16", "fp16"))
    # the control is fp32 HF generate (KV cache) vs the fp32 full forward: rounding-level, not zero
    assert all(0.0 <= k < 1e-9 for k in control), control
    # real low-precision engines: a bf16/fp16 copy of the policy generates; fp16 keeps 3 more mantissa bits
    assert all(1e-7 < k < 1e-2 for k in bf16), bf16
    assert all(0.0 < f < b for f, b in zip(fp16, bf16)), (fp16, bf16)


def test_profiled_injection(quick_study):
    from pathlib import Path

    from tim_plugins.rollout.inject import InjectionProfile

    import benchmarks.study as pkg

    study = json.loads((quick_study / "study.json").read_text())
    measured = json.loads((Path(pkg.__file__).parent / "measured_profile_smollm2.json").read_text())
    assert study["profile"] == InjectionProfile.from_measure_summary(measured, "hf-bf16").to_dict()
    meta = json.loads((quick_study / "runs" / "profile_x30" / "seed0.json").read_text())
    opts = meta["tim_config"]["inject_options"]
    assert opts["scale"] == 30.0 and opts["tau"] == 1.0 and opts["profile"]["p"] == study["profile"]["p"]
    assert all(k > 0.05 for k in _k3(quick_study, "profile_x30"))  # 30x the bf16 profile: k3 of order 1
    control_meta = json.loads((quick_study / "runs" / "control" / "seed0.json").read_text())
    assert control_meta["tim_config"]["rollout"] == "inject"  # same code path, scale 0
    assert control_meta["tim_config"]["inject_options"]["scale"] == 0.0


def test_mitigations_and_lr_decay_were_live(quick_study):
    row = _rows(quick_study / "runs" / "profile_x30+token_tis" / "seed0.csv")[0]
    assert 0.0 < float(row["tim/correction/kept_frac"]) <= 1.0
    row = _rows(quick_study / "runs" / "profile_x30+safe_vocab" / "seed0.csv")[0]
    assert float(row["tim/safe_vocab/pruned_mass_mean"]) > 0.0
    rows = _rows(quick_study / "runs" / "control+lr_decay@surge" / "seed0.csv")
    assert all(0.0 < float(r["tim/lr/scale"]) <= 1.0 for r in rows)
    assert all(float(r["lr_scale"]) == pytest.approx(float(r["tim/lr/scale"])) for r in rows[1:])


def test_resume_skips_finished_runs(quick_study):
    marks = {arm: (quick_study / "runs" / arm / "seed0.csv").stat().st_mtime_ns for arm in QUICK_ARMS}
    (quick_study / "runs" / "bf16" / "seed0.csv").unlink()  # a killed run leaves no CSV: only it is redone
    study_main(["--quick", "--out", str(quick_study), "--arms", "control,bf16", "--no-report"])
    summary = json.loads((quick_study / "summary.json").read_text())
    assert (summary["skipped_runs"], summary["ran_runs"]) == (1, 1)
    assert (quick_study / "runs" / "control" / "seed0.csv").stat().st_mtime_ns == marks["control"]
    assert (quick_study / "runs" / "bf16" / "seed0.csv").exists()


# -------------------------------------------------------------------------------------- the analysis
def _table(endpoints: dict[str, list[float]]):
    return [{"arm": a, "endpoint_by_seed": {str(s): v for s, v in enumerate(vals)}} for a, vals in endpoints.items()]


def test_paired_comparison_and_degradation_rule():
    rule = degradation_rule()
    rng = random.Random(0)
    control = [rng.uniform(0.3, 0.6) for _ in range(4)]
    drops = [-0.05, -0.02, -0.09, -0.04]
    table = _table({"control": control, "worse": [c + d for c, d in zip(control, drops)],
                    "mixed": [c + d for c, d in zip(control, (-0.2, 0.01, -0.1, -0.1))],
                    "small": [c - 0.01 for c in control]})
    res = analysis.paired(table, "worse", "control", rule)
    assert res["deltas"] == pytest.approx(drops)
    assert res["delta_mean"] == pytest.approx(statistics.mean(drops))
    assert res["delta_std"] == pytest.approx(statistics.stdev(drops))
    half = 3.182 * statistics.stdev(drops) / 2  # t(0.975, 3 dof) × s / sqrt(4)
    assert (res["ci95_low"], res["ci95_high"]) == pytest.approx((statistics.mean(drops) - half,
                                                                 statistics.mean(drops) + half))
    assert res["degraded"]
    assert not analysis.paired(table, "mixed", "control", rule)["degraded"]  # one seed improved
    assert not analysis.paired(table, "small", "control", rule)["degraded"]  # consistent but < min_drop
    assert not res["helps"]
    assert analysis.paired(table, "control", "worse", rule)["helps"]  # the mirror rule: every seed gained
    assert not analysis.paired(table, "control", "mixed", rule)["helps"]  # one seed lost
    assert not analysis.paired(table, "control", "small", rule)["helps"]  # consistent but < min_drop
    assert analysis.paired(table, "worse", "absent", rule) is None


def test_config_refusals_and_presets():
    with pytest.raises(ValueError, match="mitigation_cell"):
        StudyConfig(scenarios=("mitigation",))
    with pytest.raises(ValueError, match="unknown"):
        StudyConfig(scenarios=("main", "moon"))
    with pytest.raises(ValueError, match="must be an injected arm"):
        build_arms(StudyConfig(scenarios=SCENARIOS, mitigation_cell="control@lr5x"))
    arms = {a.name: a for a in build_arms(StudyConfig(scenarios=SCENARIOS, mitigation_cell="profile_x30@lr5x"))}
    for name, arm in arms.items():  # every mismatched arm is paired with an arm of its own cell
        if arm.control:
            ctrl = arms[arm.control]
            assert (ctrl.budget, ctrl.learning_rate, ctrl.max_grad_norm, ctrl.task) == \
                (arm.budget, arm.learning_rate, arm.max_grad_norm, arm.task), name
    assert arms["control@lr5x"].max_grad_norm > 1e5 and arms["profile_x30+icepop@lr5x"].is_correction == "icepop"
    import argparse

    from benchmarks.study.main import GPU, _config_from_args, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    gpu = _config_from_args(p.parse_args(["--device", "cuda"]))
    assert (gpu.steps, gpu.budget, gpu.hidden_size, gpu.device) == (GPU["steps"], GPU["budget"], GPU["hidden_size"],
                                                                     "cuda")
    assert _config_from_args(p.parse_args(["--device", "cuda", "--scale", "cpu"])).steps == StudyConfig().steps
