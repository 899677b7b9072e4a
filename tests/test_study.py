"""`python -m benchmarks.study --quick`: real TRL GRPO runs with the TIM callback (exact sampler, the zero-mismatch
control, bf16 and fp16 engines, the measured-profile injector, the length-surge task with LR decay, an IS
correction and the safe vocabulary), the trained policy's held-out evaluation, paired analysis, report and
per-run resume. One quick study shared by the module (~2-3 min); the task, evaluation and analysis pieces are
also checked against naive references."""

from __future__ import annotations

import csv
import json
import logging
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


LOGGERS = ("transformers", "trl", "tim_plugins", "accelerate", "datasets")
LOGGING_AROUND_THE_STUDY = {}


def _logging_state():
    import warnings

    return {name: logging.getLogger(name).level for name in LOGGERS}, list(warnings.filters)


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    LOGGING_AROUND_THE_STUDY["before"] = _logging_state()
    study_main(["--quick", "--out", str(out), "--workers", "2"])
    LOGGING_AROUND_THE_STUDY["after"] = _logging_state()
    return out


def test_the_study_leaves_the_callers_logging_as_found(quick_study):
    # the study silences the libraries for its own runs only: a tim_plugins logger left at ERROR silenced the
    # console lines of every later test in the same process
    before, after = LOGGING_AROUND_THE_STUDY["before"], LOGGING_AROUND_THE_STUDY["after"]
    assert after == before


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
    # The study's worker processes run with one torch thread (main._run_jobs); so does this evaluation. The
    # float32 matmuls reduce in a thread-count-dependent order, and even with one thread here the entropies of a
    # full `make test` run differed from the runs' in the 8th digit (2.8592010537783303 vs ...339101157, 7e-9
    # relative; identical when this file runs alone): the comparison allows float32 rounding of a mean (1e-6
    # relative) for the entropy, far below what a changed policy, prompt or seed moves; the rest is exact.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = {mode: evaluate_policy(model, tok, prompts, QUICK["budget"], temperature=t, seed=4321)
               for mode, t in (("greedy", 0.0), ("sample", 1.0))}
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.get_rng_state(), state) and model.training  # RNG and mode restored
    # the runs' step-0 evaluation is this one (same weights, same prompts, same seed), for every engine:
    # the bf16/fp16 engines patched onto the instance are bypassed
    for arm in ("exact", "control", "bf16", "fp16", "profile_x30"):
        row = _rows(quick_study / "runs" / arm / "seed0.eval.csv")[0]
        assert int(row["step"]) == 0
        for mode in ("greedy", "sample"):
            for key, value in got[mode].items():
                tol = 1e-6 if key == "entropy" else 1e-12  # the sampled tokens, rewards and lengths: exact
                assert float(row[f"eval/{mode}/{key}"]) == pytest.approx(value, rel=tol, abs=1e-12), (arm, key)
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


@pytest.fixture(scope="module")
def reference_rollouts(quick_study):
    """Naive references, computed here from the warm start the runs began with: completions of the runs' first
    training prompts (extended to 32 prompts × 8, T = 1, top-k/top-p off, the runs' budget) sampled by an
    fp32 / bf16 / fp16 copy of the model with ``generate``'s own KV cache, as the runs' engines do. Per dtype:
    the engine's log-softmax at each completion position, the fp32 model's (one full forward) and the mask of
    completion tokens up to and including the first EOS (TRL's completion mask)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.study.task import make_prompts, task_spec

    study = json.loads((quick_study / "study.json").read_text())
    cfg = study["config"]
    path = study["model_paths"]["chain"]
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    spec = task_spec("chain")
    held_out = frozenset(make_prompts(cfg["eval_prompts"], spec, seed=999_999))
    prompts = [p for p in make_prompts(32, spec, seed=1000, exclude=held_out) for _ in range(8)]
    enc = tok(prompts, return_tensors="pt", padding=True)
    n_prompt = enc["input_ids"].shape[1]
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        engine = copy.deepcopy(model).to(dtype).eval()
        torch.manual_seed(0)
        with torch.no_grad():
            gen = engine.generate(**enc, do_sample=True, temperature=cfg["temperature"], top_k=0, top_p=1.0,
                                  max_new_tokens=cfg["budget"], pad_token_id=tok.pad_token_id, output_logits=True,
                                  return_dict_in_generate=True)
            comp = gen.sequences[:, n_prompt:]
            engine_lp = torch.log_softmax(torch.stack(gen.logits, 1).double() / cfg["temperature"], -1)
            attn = torch.cat([enc["attention_mask"], torch.ones_like(comp)], 1)
            logits = model(input_ids=gen.sequences, attention_mask=attn).logits[:, n_prompt - 1:-1]
            fp32_lp = torch.log_softmax(logits.double() / cfg["temperature"], -1)
        eos = comp == tok.eos_token_id
        mask = (eos.long().cumsum(1) - eos.long()) == 0
        out[name] = (engine_lp, fp32_lp, comp, mask)
    return out


def test_engines_order_their_mismatch(quick_study, reference_rollouts):
    import torch

    control = _k3(quick_study, "control")
    # the control is fp32 HF generate (KV cache) vs the fp32 full forward: rounding-level, not zero
    assert all(0.0 <= k < 1e-9 for k in control), control
    # Real low-precision engines (a bf16/fp16 copy of the policy generates) against the mismatch of the same
    # engine computed naively here on the warm start (d = log p_fp32 - log p_engine over its own samples:
    # mean |d| and mean expm1(d) - d). Measured: bf16 k3 7.4-8.2e-6 per step against 7.6e-6, mean |d| within 3%;
    # fp16 (3 more mantissa bits, ~8x smaller |d|, ~64x smaller k3) 0.96-1.31e-7 against 1.1e-7: a step's 32
    # completions vary k3 by ~20% and mean |d| by ~10%, and the policy moves a little over 3 steps.
    for arm in ("bf16", "fp16"):
        engine_lp, fp32_lp, comp, mask = reference_rollouts[arm]
        d = (fp32_lp.gather(-1, comp[..., None]) - engine_lp.gather(-1, comp[..., None]))[..., 0][mask]
        want_k3, want_abs = float((torch.expm1(d) - d).mean()), float(d.abs().mean())
        for r in _rows(quick_study / "runs" / arm / "seed0.csv"):
            assert want_k3 / 1.5 < float(r["tim/token/kl_k3"]) < want_k3 * 1.5, (arm, r["step"], want_k3)
            assert float(r["tim/token/abs_diff_mean"]) == pytest.approx(want_abs, rel=0.2), (arm, r["step"])
    assert all(0.0 < f < b for f, b in zip(_k3(quick_study, "fp16"), _k3(quick_study, "bf16")))


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


def _meta(study, arm):
    return json.loads((study / "runs" / arm / "seed0.json").read_text())["tim_config"]


def test_token_tis_reweighted_the_loss(quick_study):
    """Token TIS on the injected arm, against its paired arm without it (same seed: the same first rollouts)
    and against the configured clip C: the weights are min(ρ, C) (the largest is C where ρ exceeds it, the
    smallest is the smallest ρ, their mean is below both the mean ρ and C), and they reach TRL's loss: on
    policy, GRPO's unweighted loss is the mean of zero-sum group advantages (0), the weighted one is not."""
    from tim_plugins.corrections import CorrectionConfig

    meta = _meta(quick_study, "profile_x30+token_tis")
    assert meta["is_correction"] == "token_tis"
    clip = meta["is_correction_options"].get("token_clip", CorrectionConfig().token_clip)
    tis = _rows(quick_study / "runs" / "profile_x30+token_tis" / "seed0.csv")
    plain = _rows(quick_study / "runs" / "profile_x30" / "seed0.csv")
    first, paired = tis[0], plain[0]
    for key in ("reward", "completions/mean_length", "tim/tokens"):  # the same step-1 rollouts
        assert first[key] == paired[key], key
    for key in ("tim/token/ratio_min", "tim/token/ratio_max", "tim/token/kl_k3"):
        assert float(first[key]) == pytest.approx(float(paired[key]), rel=1e-5), key
    assert "tim/is/weight_max" not in paired
    for r in tis:
        rho_min, rho_max, rho_mean = (float(r[f"tim/token/ratio_{k}"]) for k in ("min", "max", "mean"))
        assert rho_max > clip  # 30x the measured profile: the clip binds at every step
        assert float(r["tim/is/weight_max"]) == clip
        assert float(r["tim/is/weight_min"]) == pytest.approx(min(rho_min, clip), rel=1e-5)
        assert float(r["tim/is/weight_mean"]) < min(rho_mean, clip)
        assert float(r["tim/correction/kept_frac"]) == 1.0  # token TIS reweights, it drops no token
        assert abs(float(r["loss"])) > 1e-3, r["step"]
    assert all(abs(float(r["loss"])) < 1e-6 for r in plain)
    assert float(first["grad_norm"]) != float(paired["grad_norm"])


def test_safe_vocab_changed_the_trainer_distribution(quick_study, reference_rollouts):
    """The safe-vocabulary arm's trainer scores over the min-p set: TRL's own logged entropy (computed from the
    distribution its loss forward returns) and the pruned mass match a naive min-p truncation of the warm start
    computed here (fp32 samples of the same prompts; the run samples from the injected engine, measured 0.003
    apart in entropy, 13% in pruned mass at step 1), and the entropy sits below the full vocabulary's by the
    naive gap (0.08 nats), where a trainer that ignored the setting would log the full-vocabulary entropy."""
    import torch

    study = json.loads((quick_study / "study.json").read_text())
    min_p = study["config"]["min_p"]
    assert _meta(quick_study, "profile_x30+safe_vocab")["safe_vocab"]
    _, lp, _, mask = reference_rollouts["fp32"]
    p = lp.exp()
    keep = p >= min_p * p.amax(-1, keepdim=True)
    safe_lp = torch.where(keep, lp - torch.logsumexp(lp.masked_fill(~keep, -math.inf), -1, keepdim=True), 0.0)
    entropy_full = float(-(p * lp).sum(-1)[mask].mean())
    entropy_safe = float(-(safe_lp.exp() * safe_lp * keep).sum(-1)[mask].mean())
    pruned = float((1.0 - (p * keep).sum(-1))[mask].mean())
    gap = entropy_full - entropy_safe
    assert gap > 0.05 and pruned > 0.01  # the reference itself prunes a real tail
    first = _rows(quick_study / "runs" / "profile_x30+safe_vocab" / "seed0.csv")[0]
    assert float(first["entropy"]) == pytest.approx(entropy_safe, abs=gap / 3)
    assert float(first["tim/safe_vocab/pruned_mass_mean"]) == pytest.approx(pruned, rel=0.3)
    paired = _rows(quick_study / "runs" / "profile_x30" / "seed0.csv")[0]
    assert float(paired["entropy"]) == pytest.approx(entropy_full, abs=gap / 3)


def test_lr_decay_replays_through_the_core_controller(quick_study):
    """The surge arm's controller saw TRL's logged mean completion length each step: the core controller fed
    those lengths gives every logged tim/lr/* value, and TRL's logged LR carries its scale."""
    from tim_plugins.lr_control import LengthTriggeredLRDecay

    meta = _meta(quick_study, "control+lr_decay@surge")
    assert meta["lr_decay"] and meta["lr_decay_signals"] == []
    reference = LengthTriggeredLRDecay(**meta["lr_decay_options"])
    rows = _rows(quick_study / "runs" / "control+lr_decay@surge" / "seed0.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        scale = reference.observe(int(r["step"]), float(r["completions/mean_length"]))
        want = reference.metrics()
        logged = {k: float(v) for k, v in r.items() if k.startswith("tim/lr/")}
        assert logged.keys() == want.keys()
        assert all(logged[k] == want[k] or (math.isnan(logged[k]) and math.isnan(want[k])) for k in want), \
            {k: (logged[k], want[k]) for k in want}
        assert float(r["tim/lr/scale"]) == scale
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
