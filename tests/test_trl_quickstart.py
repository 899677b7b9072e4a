"""The README's TRL example is a complete script (integrations/trl/examples/quickstart.py) that runs as it stands:
the README shows exactly the file's marked region, and the file, executed end to end, logs tim/ metrics in TRL's
log_history that agree with TRL's own counts."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

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
def test_example_runs_end_to_end_and_logs_tim_metrics(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)  # the example writes its output_dir under the working directory
    env = runpy.run_path(str(EXAMPLE), run_name="__main__")
    trainer, args = env["trainer"], env["args"]
    from tim_plugins.integrations.trl import TIMCallback

    assert any(isinstance(cb, TIMCallback) for cb in trainer.callback_handler.callbacks)
    assert (tmp_path / args.output_dir).is_dir()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2, 3] == list(range(1, args.max_steps + 1))
    completions = args.per_device_train_batch_size  # completions scored per optimizer step (one generation batch)
    for h in steps:
        # tim/ metrics in the same entries as TRL's own, and counting what TRL counted: every completion token
        # (TRL's completions/mean_length includes the EOS, as TRL's completion mask does)
        assert h["tim/tokens"] == pytest.approx(h["completions/mean_length"] * completions, abs=1e-9)
        assert h["tim/seq/count"] == completions
        # both sides are the same fp32 weights on the same tokens: only kernel-order noise
        assert 0.0 <= h["tim/token/kl_k3"] < 1e-8 and h["tim/token/abs_diff_max"] < 1e-3
        assert h["tim/token/ratio_outside_frac"] == 0.0
