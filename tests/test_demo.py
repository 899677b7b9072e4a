"""``tim-plugins demo``: the pieces (rewards, config checks and per-model defaults, the bf16 rollout_func and its
weight sync, the status lines before the heavy imports) and short end-to-end GRPO runs through the real TRL
GRPOTrainer with TIMCallback, on the toy model and on SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")

from tim_plugins.apps.cli import UsageError, main  # noqa: E402
from tim_plugins.apps.demo import REAL_MODEL_DEFAULTS, TOY_DEFAULTS, DemoConfig, _BF16Rollouts  # noqa: E402
from tim_plugins.apps.demo_tasks import chat_prompts, chat_reward, toy_reward  # noqa: E402
from tim_plugins.dump import read_dump  # noqa: E402


def test_toy_reward_grades_each_prompt_kind():
    prompts = ["Q: 12 + 30 = ? A:", "Q: 12 + 30 = ? A:", "Q: 0 + 0 = ? A:", "sort 3 1 2 ->", "sort 3 1 2 ->",
               "The cat dog", "The cat dog", "The cat dog"]
    completions = [" 42.", " 40.", " 0.", " 1 3 2.", " x", " is a red fish.", " is a red fish", " a b c d e f g h i."]
    assert toy_reward(prompts, completions) == pytest.approx(
        [1.0, 1 - 2 / 42, 1.0, 1 / 3, 0.0, 4 / 8, 0.0, 1.0])


def test_chat_reward_grades_sums_and_one_sentence_answers():
    sum_prompt = "<|im_start|>user\nWhat is 12 plus 30? Reply with the number only.<|im_end|>\n<|im_start|>assistant\n"
    question = "<|im_start|>user\nWhy is the sky blue? Answer in one short sentence.<|im_end|>\n"
    prompts = [sum_prompt] * 4 + [question] * 4
    completions = ["42", "The answer is 40.", "no idea", "-42",
                   "Light scatters.", "Because " + "very " * 14 + "blue.", "It is", ""]
    assert chat_reward(prompts, completions) == pytest.approx(
        [1.0, 1 - 2 / 42, 0.0, 0.0, 1.0, 12 / 16, 0.0, 0.0])


def test_chat_prompts_alternate_sums_and_questions_in_the_chat_template(toy_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    prompts = chat_prompts(tok, 6, seed=1)
    assert prompts == chat_prompts(tok, 6, seed=1) and len(set(prompts)) > 1
    for i, p in enumerate(prompts):
        assert p.startswith("<user>") and p.endswith("<assistant>")
        if i % 2 == 0:
            a, b = (int(x) for x in p.split("What is ")[1].split("?")[0].split(" plus "))
            assert 0 <= a < 50 and 0 <= b < 50
            assert chat_reward([p], [str(a + b)]) == [1.0]  # the reward reads the rendered prompt
        else:
            assert p.endswith("Answer in one short sentence.<assistant>")


def test_run_size_defaults_by_model():
    toy = DemoConfig()
    assert {k: getattr(toy, k) for k in TOY_DEFAULTS} == TOY_DEFAULTS
    real = DemoConfig(model="smollm2")
    assert {k: getattr(real, k) for k in REAL_MODEL_DEFAULTS} == REAL_MODEL_DEFAULTS
    assert DemoConfig(model="smollm2", steps=7).steps == 7  # an explicit value wins


@pytest.mark.parametrize("command", ["demo", "measure"])
def test_status_lines_come_before_the_heavy_imports(command, tmp_path):
    """The first status lines are printed before TRL, transformers (and vLLM) are imported, and say whether the
    toy model is built first (an empty cache) or read from the cache."""
    code = f"""
import json, sys
import tim_plugins.apps.startup as startup
seen = []
def say(text):
    seen.append([text, sorted(m for m in ("trl", "transformers", "datasets", "vllm") if m in sys.modules)])
    if len(seen) == 2:
        print(json.dumps(seen)); sys.exit(0)
startup.say = say
from tim_plugins.apps.cli import main
main([{command!r}, "--out", {str(tmp_path / "out")!r}])
"""
    for cache, needle in ((tmp_path / "empty-cache", "building the toy model once"),
                          (None, "model: the toy model, cached in")):
        env = {**os.environ, **({"TIM_PLUGINS_CACHE": str(cache)} if cache else {})}
        if cache is None:
            env.pop("TIM_PLUGINS_CACHE", None)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        (first, mods1), (second, mods2) = json.loads(res.stdout.strip().splitlines()[-1])
        assert first.startswith(f"tim-plugins {command}: ") and "report: " in first
        assert needle in second
        assert mods1 == [] and mods2 == [], (mods1, mods2)
        if cache is not None:
            assert str(cache) in second and not cache.exists()  # said, not built: the test stopped before


def test_config_errors_name_value_rule_and_fix(tmp_path):
    with pytest.raises(UsageError, match=r"--steps 0 is invalid: it must be >= 1"):
        DemoConfig(steps=0)
    with pytest.raises(UsageError, match=r"--num-generations 1 is invalid: GRPO needs >= 2"):
        DemoConfig(num_generations=1)
    with pytest.raises(UsageError, match=r"--rollout-dtype 'int8' is unknown"):
        DemoConfig(rollout_dtype="int8")
    with pytest.raises(UsageError, match=r"--model '/nonexistent': no such local folder"):
        DemoConfig(model="/nonexistent")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(UsageError, match=r"needs an HF checkpoint folder .* not a GGUF file; pass 'smollm2'"):
        DemoConfig(model=str(gguf))
    with pytest.raises(UsageError, match=r"--compare 'fp32' is unknown: use one of safe_vocab, rollout_dtype, none"):
        DemoConfig(compare="fp32")
    with pytest.raises(UsageError, match=r"--top-p 1.5 is invalid: it must be in \(0, 1\]"):
        DemoConfig(top_p=1.5)
    with pytest.raises(UsageError, match=r"--safe-vocab needs a sampler that cuts the vocabulary.*--top-p < 1"):
        DemoConfig(compare="none", safe_vocab=True)
    with pytest.raises(UsageError, match=r"--safe-vocab with --compare safe_vocab: .* use --compare none"):
        DemoConfig(safe_vocab=True)
    with pytest.raises(UsageError, match=r"--compare rollout_dtype with --rollout-dtype float32"):
        DemoConfig(compare="rollout_dtype", rollout_dtype="float32")
    with pytest.raises(UsageError, match=r"--is-correction 'tis' is invalid: correction mode 'tis': unknown part"):
        DemoConfig(is_correction="tis")


def test_the_default_comparison_samples_with_top_p_and_its_runs_differ_in_the_safe_vocabulary_alone(tmp_path):
    """``tim-plugins demo`` (= make run): two runs, the sampler's cut a top-p of 0.8 unless a cut is given, the first
    with a full-vocabulary trainer, the second with the safe vocabulary; each in its own folder under OUT."""
    import dataclasses

    from tim_plugins.apps.demo import STORY_TOP_P
    from tim_plugins.apps.demo_command import comparison_runs

    cfg = DemoConfig(out=str(tmp_path))
    assert (cfg.compare, cfg.top_p) == ("safe_vocab", STORY_TOP_P) and STORY_TOP_P < 1
    assert DemoConfig(top_k=20).top_p == 1.0 and DemoConfig(compare="none").top_p == 1.0
    (a_label, a), (b_label, b) = comparison_runs(cfg)
    assert (a_label, b_label) == ("full vocabulary", "safe vocabulary")
    assert (a.safe_vocab, b.safe_vocab) == (False, True) and a.compare == b.compare == "none"
    assert (a.out, b.out) == (str(tmp_path / "full-vocabulary"), str(tmp_path / "safe-vocabulary"))
    differ = {f.name for f in dataclasses.fields(DemoConfig) if getattr(a, f.name) != getattr(b, f.name)}
    assert differ == {"safe_vocab", "out"}
    (_, low), (_, high) = comparison_runs(DemoConfig(compare="rollout_dtype", out=str(tmp_path)))
    assert (low.rollout_dtype, high.rollout_dtype) == ("bfloat16", "float32") and low.top_p == high.top_p == 1.0


def test_the_mitigation_switches_are_options(capsys):
    from tim_plugins.apps.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["demo", "--compare", "none", "--safe-vocab", "--top-p", "0.9", "--is-correction",
                              "token_tis", "--lr-decay"])
    from tim_plugins.apps.cli import config_from_args

    cfg = config_from_args(args, DemoConfig)
    assert (cfg.safe_vocab, cfg.top_p, cfg.is_correction, cfg.lr_decay) == (True, 0.9, "token_tis", True)
    assert config_from_args(parser.parse_args(["demo", "--compare", "none", "--no-safe-vocab"]), DemoConfig
                            ).safe_vocab is False


def test_rollout_func_samples_with_a_synced_low_precision_copy(toy_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's documented experimental hook
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.rollout.batch import RolloutBatch
    from tim_plugins.rollout.scoring import score_completions

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    tok.padding_side = "left"
    cfg = DemoConfig(max_completion_length=10, out=str(tmp_path), compare="none")  # the whole vocabulary
    args = GRPOConfig(output_dir=str(tmp_path / "t"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=10, use_cpu=True, bf16=False, report_to=[], save_strategy="no")
    rollouts = _BF16Rollouts(str(toy_model_path), torch.bfloat16, tok, cfg)
    trainer = GRPOTrainer(model=str(toy_model_path), reward_funcs=toy_reward, args=args, processing_class=tok,
                          train_dataset=datasets.Dataset.from_dict({"prompt": ["a"] * 4}), rollout_func=rollouts)
    with torch.no_grad():  # the policy moved since the checkpoint: the copy must follow it
        for p in trainer.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    prompts = ["Q: 3 + 4 = ? A:", "sort 3 1 ->", "The red cat", "Q: 3 + 4 = ? A:"]
    out = rollouts(prompts, trainer)
    for dst, src in zip(rollouts.model.parameters(), trainer.model.parameters()):
        assert dst.dtype == torch.bfloat16 and torch.equal(dst, src.detach().to(torch.bfloat16))
    assert rollouts.synced_step == trainer.state.global_step
    assert [len(c) for c in out["completion_ids"]] == [len(lp) for lp in out["logprobs"]]
    assert out["prompt_ids"][0] == tok(prompts[0])["input_ids"]
    eos = tok.eos_token_id
    for ids in out["completion_ids"]:  # ends at its first EOS (kept) or at the length limit
        assert eos not in ids[:-1] and (ids[-1] == eos or len(ids) == 10)
    # The log-probs are the bf16 copy's: its own full-sequence recomputation agrees to bf16 precision, and the
    # fp32 trainer's differs by a small but non-zero amount (the mismatch the demo shows).
    width = max(len(c) for c in out["completion_ids"])
    P = max(len(p) for p in out["prompt_ids"])
    pids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in out["prompt_ids"]])
    pmask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in out["prompt_ids"]])
    cids = torch.tensor([c + [eos] * (width - len(c)) for c in out["completion_ids"]])
    cmask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in out["completion_ids"]])
    batch = RolloutBatch(pids, pmask, cids, cmask, torch.zeros(cids.shape))
    got = torch.tensor([lp + [0.0] * (width - len(lp)) for lp in out["logprobs"]])
    with torch.no_grad():  # the trainer's recomputation, with the positions generate used
        own = score_completions(rollouts.model, batch.input_ids, batch.attention_mask, width, temperature=1.0,
                                positions_from_mask=True).logprobs
        fp32 = score_completions(trainer.model, batch.input_ids, batch.attention_mask, width, temperature=1.0,
                                 positions_from_mask=True).logprobs
    m = cmask.bool()
    assert (got - own)[m].abs().max() < 0.1
    d = (fp32.double() - got.double())[m]
    assert 0 < float((d.expm1() - d).mean()) < 1e-2


@pytest.mark.slow
def test_demo_end_to_end_grpo_run(tmp_path, capsys, toy_model_path):
    out = tmp_path / "demo"
    assert main(["demo", "--compare", "none", "--steps", "3", "--prompts-per-step", "2", "--num-generations", "4",
                 "--max-completion-length", "16", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "report:" in printed and str(out / "report.html") in printed
    assert any(word in printed for word in ("OK:", "WATCH:", "ACT:"))
    assert captured.err.startswith("tim-plugins demo: 3 GRPO steps (2 prompts x 4 completions of <= 16 tokens) on "
                                   "the toy model")
    assert f"model: the toy model, cached in {toy_model_path}" in captured.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "training"
    _check_settings_and_timing(summary, str(toy_model_path), steps=3)
    # Steps are TRL's optimizer steps: one logged row and one dump file per step.
    steps = [h["step"] for h in summary["log_history"] if "tim/token/kl_k3" in h]
    assert steps == [1, 2, 3]
    table = read_dump(out / "dump")
    assert sorted(set(table.column("step").to_pylist())) == [1, 2, 3]
    from report_reference import assert_same_numbers

    assert_same_numbers(out / "dump")  # the report's streaming queries equal the in-memory computation
    # The callback's logged k3 of each step equals the naive k3 of that step's dumped tokens (every sequence
    # dumped): the dump, the monitor and the report's per-step series describe the same tokens.
    rows = table.to_pylist()
    for h in summary["log_history"]:
        d = [r["train_logprob"] - r["rollout_logprob"] for r in rows if r["step"] == h["step"]]
        assert len(d) == h["tim/tokens"]
        assert h["tim/token/kl_k3"] == pytest.approx(sum(math.expm1(x) - x for x in d) / len(d), rel=1e-3)
        assert 0 < h["tim/token/kl_k3"] < 1e-2  # bf16 rollouts vs the fp32 trainer
    _no_cause_but_truncation(summary, out / "dump")
    att = summary["attached"]
    assert att["rollout_source"] == "custom" and "GRPOTrainer._compute_loss" in att["hooks"]
    assert att["config_changed"] == {"dump_dir": str(out / "dump"),
                                     "dump_options": {"sample_rate": 1.0, "max_sequences_per_step": 8}}
    assert any(f["code"] == "dtype-mismatch" for f in summary["own_audit"])
    html = (out / "report.html").read_text()
    assert html.count("<img src='data:image/png;base64,") == 6
    assert "Mismatch per optimizer step" in html and "What the callback attached" in html
    assert "Parity audit" in html and "class='verdict" in html
    # The verdict agrees with the audit: the bf16 rollout is the demo's own choice, and it says what to change
    # in a TRL run (the registry's knob) instead of "OK" above an unexplained error.
    from tim_plugins.parity.findings import CODES

    v = summary["verdict"]
    assert summary["framework"] == "trl" and v["audit"][0]["code"] == "dtype-mismatch"
    assert v["audit"][0]["deliberate"].startswith("the bfloat16 rollout is deliberate in this demo")
    assert "deliberate in this demo" in v["headline"] and "in your run" in v["headline"]
    fix_line = f"dtype-mismatch is deliberate here; in your run, fix it (TRL): {CODES['dtype-mismatch'].fix['trl']}"
    assert v["extra"][0] == fix_line and fix_line in printed and v["headline"] in printed
    assert "<th>fix (TRL)</th>" in html
    # Largest disagreements: the naive sort of the dump by |train − rollout|, decoded, printed and in the report.
    want = sorted(rows, key=lambda r: -abs(r["train_logprob"] - r["rollout_logprob"]))[:15]
    got = summary["disagreements"]
    assert [(r["step"], r["sequence"], r["position"], r["token_id"]) for r in got] == [
        (r["step"], r["sequence"], r["position"], r["token_id"]) for r in want]
    assert all("text" in r for r in got) and "Largest disagreements" in printed and "Largest disagreements" in html
    assert f"step {got[0]['step']} pos {got[0]['position']}" in printed


@pytest.mark.slow
def test_demo_shows_a_problem_and_its_fix_on_one_page(tmp_path, capsys, toy_model_path):
    """``tim-plugins demo`` (= make run), small: top-p rollouts against a full-vocabulary trainer, then the same with
    the safe vocabulary. The first run's ratio reads the kept mass: on the tokens both runs sampled alike (the first
    step: same seed, same weights), its mean ρ equals the kept mass the second run's safe vocabulary measured, far
    below 1; the second run's ρ is 1 to bf16 noise. One page compares them."""
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "2", "--prompts-per-step", "2", "--num-generations", "4",
                 "--max-completion-length", "16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    full, safe = (json.loads((out / name / "summary.json").read_text())
                  for name in ("full-vocabulary", "safe-vocabulary"))
    assert (full["settings"]["top_p"], safe["settings"]["top_p"]) == (0.8, 0.8)
    assert (full["settings"]["safe_vocab"], safe["settings"]["safe_vocab"]) == (False, True)
    rows = {name: [r for r in read_dump(out / name / "dump").to_pylist() if r["step"] == 1]
            for name in ("full-vocabulary", "safe-vocabulary")}
    key = lambda r: (r["sequence"], r["position"])  # noqa: E731
    full1 = {key(r): r for r in rows["full-vocabulary"]}
    same = [r for r in rows["safe-vocabulary"] if key(r) in full1 and full1[key(r)]["token_id"] == r["token_id"]]
    assert len(same) == len(rows["safe-vocabulary"]) > 0  # step 1: the same sampled tokens (boundary ones left out)
    rho_full = sum(math.exp(full1[key(r)]["train_logprob"] - full1[key(r)]["rollout_logprob"]) for r in same) / len(same)
    step1 = next(h for h in safe["log_history"] if h["step"] == 1)
    kept = 1 - step1["tim/safe_vocab/pruned_mass_mean"]
    assert rho_full < 0.95 and rho_full == pytest.approx(kept, abs=0.02), (rho_full, kept)
    for h in safe["log_history"]:  # the fix: ρ back to 1, k3 at the bf16 level
        assert abs(h["tim/token/ratio_mean"] - 1) < 1e-2 and h["tim/token/kl_k3"] < 1e-3, h
    k3 = {name: max(h["tim/token/kl_k3"] for h in s["log_history"]) for name, s in (("full", full), ("safe", safe))}
    assert k3["full"] > 10 * k3["safe"]
    # the causes: the problem run names the sampler's truncation at every step, the fixed run names nothing
    full_causes = _no_cause_but_truncation(full, out / "full-vocabulary" / "dump")
    assert [c["step"] for c in full_causes] == [h["step"] for h in full["log_history"]]
    assert _no_cause_but_truncation(safe, out / "safe-vocabulary" / "dump") == []
    # the verdicts: the problem flagged (its audit error marked as what the comparison shows), the fix without it
    assert full["verdict"]["status"] in ("watch", "act")
    assert "sampler-truncation-unmatched" in full["deliberate"]
    codes = {f["code"] for f in safe["findings"] + safe["own_audit"]}
    assert "sampler-truncation-unmatched" not in codes and safe["verdict"]["status"] == "ok"
    html = (out / "report.html").read_text().replace("\n", "")
    assert "<h2>What differs between the runs</h2>" in html and "<h2>Truncation (safe vocabulary)</h2>" in html
    assert "<td>setting: safe_vocab</td><td>False</td><td>True</td>" in html
    assert html.count("class='verdict") == 2
    assert f"report comparing the runs: {out / 'report.html'}" in printed and "Side by side: full vocabulary: ρ mean" in printed
    _report_rebuilds_the_comparison(out, tmp_path, capsys)


def _report_rebuilds_the_comparison(out: Path, tmp_path: Path, capsys) -> None:
    """``tim-plugins report OUT`` on the demo's own folder (docs/report.md: it rebuilds a demo output folder's report)
    writes the page the demo wrote, byte for byte (the same runs, labels and title); without the demo's
    comparison.json (a folder written before it) the error names the run folders, and the command it prints works."""
    rebuilt = tmp_path / "rebuilt.html"
    assert main(["report", str(out), "--out", str(rebuilt)]) == 0
    assert rebuilt.read_bytes() == (out / "report.html").read_bytes()
    (out / "comparison.json").unlink()
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    runs = f"{out / 'full-vocabulary'} {out / 'safe-vocabulary'}"
    assert f"several to compare them on one page (tim-plugins report {runs})" in err, err
    assert main(["report", *runs.split(), "--out", str(tmp_path / "printed.html")]) == 0
    html = (tmp_path / "printed.html").read_text()
    assert "full-vocabulary vs safe-vocabulary" in html and html.count("class='verdict") == 2


def _no_cause_but_truncation(summary: dict, dump_dir) -> list[dict]:
    """The causes a demo run named (``causes.jsonl`` beside its dump), each also counted in that step's logged
    ``tim/cause/named``: at most the sampler's truncation (the demo's top-p against a full-vocabulary trainer, its
    deliberate problem, named only where the audit flagged it); never a broken sync, a stale engine, a floor jump or
    confident disagreements, which no demo run has."""
    path = Path(dump_dir) / "causes.jsonl"
    causes = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    assert {c["code"] for c in causes} <= {"truncation"}, causes
    if causes:
        assert "sampler-truncation-unmatched" in {f["code"] for f in summary["findings"] + summary["own_audit"]}
    for h in summary["log_history"]:
        assert h["tim/cause/named"] == sum(c["step"] == h["step"] for c in causes), h
    return causes


def _check_settings_and_timing(summary: dict, model_path: str, steps: int) -> None:
    """Each run setting once (``model`` is the folder loaded; no model_path / optimizer_steps twins), and
    timings whose parts add up: total = set-up + loop, loop = rollouts + the rest."""
    settings = summary["settings"]
    assert settings["model"] == model_path and settings["steps"] == steps
    assert not {"model_path", "optimizer_steps", "per_device_train_batch_size"} & set(settings)
    t = summary["timing"]
    assert t["setup_seconds"] + t["train_seconds"] == pytest.approx(t["total_seconds"], rel=1e-12)
    assert t["rollout_seconds"] + t["train_other_seconds"] == pytest.approx(t["train_seconds"], rel=1e-12)
    assert 0 < t["rollout_seconds"] < t["train_seconds"] < t["total_seconds"]
    assert t["rollout_tokens"] == sum(h["tim/tokens"] for h in summary["log_history"])


@pytest.mark.slow
def test_demo_on_smollm2_end_to_end(smollm2_path, tmp_path, capsys):
    """``tim-plugins demo --model smollm2``, small (2 steps of 2 prompts x 4 completions x <= 12 tokens): the real
    model's converted folder is what GRPOTrainer trains, its chat prompts and reward are used, and the logged
    mismatch is the naive k3 of the dumped tokens, in the range a bf16 copy of this model gives against fp32.
    Heavy (a 135M-parameter model): run it under the shared lock, e.g.
    ``flock /work/heavy.lock .venv/bin/python -m pytest -q tests/test_demo.py -k smollm2``."""
    out = tmp_path / "smol"
    assert main(["demo", "--model", "smollm2", "--compare", "none", "--steps", "2", "--max-completion-length", "12",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "on SmolLM2-135M-Instruct" in err and f"model: SmolLM2-135M-Instruct, cached in {smollm2_path}" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["title"].startswith("TIM inside a GRPO run on SmolLM2-135M-Instruct: bfloat16 rollouts, float32")
    assert summary["settings"]["reward"] == "chat_reward"
    assert summary["settings"]["prompts_per_step"] == REAL_MODEL_DEFAULTS["prompts_per_step"]
    _check_settings_and_timing(summary, str(smollm2_path), steps=2)
    rows = read_dump(out / "dump").to_pylist()
    assert sorted({r["step"] for r in rows}) == [1, 2]
    for h in summary["log_history"]:
        d = [r["train_logprob"] - r["rollout_logprob"] for r in rows if r["step"] == h["step"]]
        assert len(d) == h["tim/tokens"] > 0
        k3 = sum(math.expm1(x) - x for x in d) / len(d)
        assert h["tim/token/kl_k3"] == pytest.approx(k3, rel=1e-3)
        # bf16 rollouts of this model against its fp32 trainer: k3 measured 7e-4 .. 4e-3 per token (README,
        # test_trl_real_model, test_measure); an fp32 copy would give < 1e-6, a broken weight sync far above 0.1.
        assert K3_FLOOR < h["tim/token/kl_k3"] < K3_CEILING
    _no_cause_but_truncation(summary, out / "dump")
    html = (out / "report.html").read_text()
    assert html.count("<img src='data:image/png;base64,") == 6 and "SmolLM2-135M-Instruct" in html


K3_FLOOR, K3_CEILING = 1e-4, 5e-2
