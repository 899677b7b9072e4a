"""``tim-plugins demo``: the pieces (reward, config checks, the bf16 rollout_func and its weight sync) and a
short end-to-end GRPO run through the real TRL GRPOTrainer with TIMCallback."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")

from tim_plugins.apps.cli import UsageError, main  # noqa: E402
from tim_plugins.apps.demo import DemoConfig, _BF16Rollouts, toy_reward  # noqa: E402
from tim_plugins.dump import read_dump  # noqa: E402


def test_toy_reward_grades_each_prompt_kind():
    prompts = ["Q: 12 + 30 = ? A:", "Q: 12 + 30 = ? A:", "Q: 0 + 0 = ? A:", "sort 3 1 2 ->", "sort 3 1 2 ->",
               "The cat dog", "The cat dog", "The cat dog"]
    completions = [" 42.", " 40.", " 0.", " 1 3 2.", " x", " is a red fish.", " is a red fish", " a b c d e f g h i."]
    assert toy_reward(prompts, completions) == pytest.approx(
        [1.0, 1 - 2 / 42, 1.0, 1 / 3, 0.0, 4 / 8, 0.0, 1.0])


def test_config_errors_name_value_rule_and_fix():
    with pytest.raises(UsageError, match=r"--steps 0 is invalid: it must be >= 1"):
        DemoConfig(steps=0)
    with pytest.raises(UsageError, match=r"--num-generations 1 is invalid: GRPO needs >= 2"):
        DemoConfig(num_generations=1)
    with pytest.raises(UsageError, match=r"--rollout-dtype 'int8' is unknown"):
        DemoConfig(rollout_dtype="int8")
    with pytest.raises(UsageError, match=r"--model '/nonexistent': no such local folder"):
        DemoConfig(model="/nonexistent")


def test_rollout_func_samples_with_a_synced_low_precision_copy(toy_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's documented experimental hook
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.rollout.batch import RolloutBatch
    from tim_plugins.rollout.scoring import score_completions

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    tok.padding_side = "left"
    cfg = DemoConfig(max_completion_length=10, out=str(tmp_path))
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
def test_demo_end_to_end_grpo_run(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "3", "--prompts-per-step", "2", "--num-generations", "4",
                 "--max-completion-length", "16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "report:" in printed and str(out / "report.html") in printed
    assert any(word in printed for word in ("OK:", "WATCH:", "ACT:"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "training" and summary["settings"]["optimizer_steps"] == 3
    # Steps are TRL's optimizer steps: one logged row and one dump file per step.
    steps = [h["step"] for h in summary["log_history"] if "tim/token/kl_k3" in h]
    assert steps == [1, 2, 3]
    table = read_dump(out / "dump")
    assert sorted(set(table.column("step").to_pylist())) == [1, 2, 3]
    # The callback's logged k3 of each step equals the naive k3 of that step's dumped tokens (every sequence
    # dumped): the dump, the monitor and the report's per-step series describe the same tokens.
    rows = table.to_pylist()
    for h in summary["log_history"]:
        d = [r["train_logprob"] - r["rollout_logprob"] for r in rows if r["step"] == h["step"]]
        assert len(d) == h["tim/tokens"]
        assert h["tim/token/kl_k3"] == pytest.approx(sum(math.expm1(x) - x for x in d) / len(d), rel=1e-3)
        assert 0 < h["tim/token/kl_k3"] < 1e-2  # bf16 rollouts vs the fp32 trainer
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
