"""The TRL examples run as they stand. The README's TRL example is a complete script
(integrations/trl/examples/quickstart.py): the README shows exactly the file's marked region, and the file,
executed end to end, trains (the reward varies within each group: non-zero loss and grad norm at every step, the
weights move) and logs the compact set of tim/ metrics in TRL's log_history, agreeing with TRL's own counts. The
longer example docs/trl.md points to (integrations/trl/examples/grpo_with_tim.py) runs with each of its documented
command lines."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "integrations" / "trl" / "examples" / "quickstart.py"
START, END = "# --8<-- [start:quickstart]\n", "# --8<-- [end:quickstart]"


def _region() -> str:
    text = EXAMPLE.read_text()
    if text.count(START) != 1 or text.count(END) != 1:
        raise AssertionError(f"{EXAMPLE.name}: one start and one end marker expected")
    return text.split(START)[1].split(END)[0]


def _readme_block() -> str:
    section = (ROOT / "README.md").read_text().split("## TRL: one callback\n")[1].split("\n## ")[0]
    return section.split("```python\n")[1].split("```")[0]


def test_readme_shows_the_example_file_verbatim():
    assert _readme_block() == _region()
    # a complete script: every name it uses comes from an import in it (no `...`, no GRPOTrainer from nowhere)
    assert "..." not in _region()
    for line in ("from trl import GRPOConfig, GRPOTrainer", "from datasets import Dataset",
                 "from tim_plugins.integrations.trl import TIMCallback, TIMConfig", "trainer.train()"):
        assert line in _region()


@pytest.mark.trl
def test_example_runs_end_to_end_trains_and_logs_tim_metrics(tmp_path, monkeypatch):
    """The example trains: within each GRPO group the reward varies, so every logged step has a non-zero loss and
    grad norm, and the policy's weights move from the checkpoint's. Its log holds the compact tim/ set
    (tim_plugins.log_keys), counting what TRL counted."""
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)  # the example writes its output_dir under the working directory
    env = runpy.run_path(str(EXAMPLE), run_name="__main__")
    trainer, args = env["trainer"], env["args"]
    from tim_plugins.integrations.trl import TIMCallback
    from tim_plugins.log_keys import in_step_log

    assert any(isinstance(cb, TIMCallback) for cb in trainer.callback_handler.callbacks)
    assert (tmp_path / args.output_dir).is_dir()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2, 3] == list(range(1, args.max_steps + 1))
    completions = args.per_device_train_batch_size  # completions scored per optimizer step (one generation batch)
    for h in steps:
        # GRPO learns from the spread of rewards inside a group: every step has some, so the policy term is not 0
        assert h["reward_std"] > 0 and h["frac_reward_zero_std"] < 1, h
        assert h["loss"] != 0.0 and h["grad_norm"] > 0, h
        # tim/ metrics in the same entries as TRL's own, and counting what TRL counted: every completion token
        # (TRL's completions/mean_length includes the EOS, as TRL's completion mask does)
        assert h["tim/tokens"] == pytest.approx(h["completions/mean_length"] * completions, abs=1e-9)
        # both sides are the same fp32 weights on the same tokens: only kernel-order noise
        assert 0.0 <= h["tim/token/kl_k3"] < 1e-8 and h["tim/token/abs_diff_p99"] < 1e-3
        assert h["tim/token/ratio_outside_frac"] == 0.0
        # the compact log: the metrics read each step, none of the detail families
        tim_keys = [k for k in h if k.startswith("tim/")]
        assert all(in_step_log(k) for k in tim_keys) and 5 <= len(tim_keys) <= 15, tim_keys
    # the policy moved: its weights differ from the checkpoint it started from
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(env["model"]).state_dict()
    moved = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v.cpu(), start[k])]
    assert moved, "no parameter changed"


GRPO_WITH_TIM = ROOT / "integrations" / "trl" / "examples" / "grpo_with_tim.py"


@pytest.mark.trl
@pytest.mark.parametrize("flags", [[], ["--safe-vocab", "--lr-decay", "--is-correction", "token_tis"]],
                         ids=["plain", "mitigations"])
def test_the_longer_example_runs_its_documented_command_lines(tmp_path, flags):
    """Each command line of the example's docstring (the toy model; fewer steps): it trains, prints one row per
    step, and counts the completion tokens TRL counted; with --safe-vocab both sides prune the same tail."""
    if flags:
        assert " ".join(flags) in GRPO_WITH_TIM.read_text()
    main = runpy.run_path(str(GRPO_WITH_TIM))["main"]
    out = main(["--steps", "2", "--output-dir", str(tmp_path / "out"), *flags])
    trainer = out["trainer"]
    from tim_plugins.integrations.trl import TIMCallback

    (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, TIMCallback)]
    assert (cb.config.safe_vocab, cb.config.lr_decay, cb.config.is_correction) == (
        "--safe-vocab" in flags, "--lr-decay" in flags, "token_tis" if flags else None)
    logged = {h["step"]: h for h in trainer.state.log_history if "tim/tokens" in h}
    assert [r["step"] for r in out["rows"]] == sorted(logged) == [1, 2]
    completions = trainer.args.per_device_train_batch_size
    for row in out["rows"]:
        h = logged[row["step"]]
        assert row["tim/tokens"] == pytest.approx(h["completions/mean_length"] * completions, abs=1e-9)
        # HF generate in fp32 against the fp32 trainer, the same tail pruned on both sides with --safe-vocab
        assert 0.0 <= row["tim/token/kl_k3"] < 1e-6, row
