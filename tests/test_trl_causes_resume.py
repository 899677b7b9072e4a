"""A TRL checkpoint saved inside a logging window, through ``GRPOTrainer.train(resume_from_checkpoint=...)``: the
window in progress (the monitor's tokens, the cause tracker's counts and the cause a weight-sync check found in it)
is carried across the resume, so the resumed run logs at the window's close what the uninterrupted run logs there,
closes with the same tally, and does not print the cause again. Reference: the uninterrupted run with the same seed,
steps and fault."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("trl")

from test_dump_resume import _SyncFaultAt  # noqa: E402
from test_trl_callback import make_trainer  # noqa: E402
from test_trl_mitigations import _StopAt  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402

STEPS, LOGGING, SAVE = 4, 2, 3  # the checkpoint after step 3 cuts the window of steps 3-4
FAULT = 3  # a broken sync before step 3: found inside that window, before the checkpoint
LIVE = "cause [sync-noop]"  # the line printed when a cause is found (the run's closing lines name it too)
KEYS = ("tim/tokens", "tim/cause/named", "tim/cause/confident_disagreements", "tim/token/abs_diff_mean")


def _run(toy_model_path, folder, *, fault: bool, stop: int | None = None, resume: str | None = None, **overrides):
    trainer = make_trainer(toy_model_path, folder, max_steps=STEPS, logging_steps=LOGGING, **overrides)
    cb = TIMCallback(trainer, TIMConfig(log_detail=True))
    trainer.add_callback(cb)
    if fault:
        trainer.add_callback(_SyncFaultAt(cb, FAULT))
    if stop is not None:
        trainer.add_callback(_StopAt(stop))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, cb


def _logged(trainer, step: int) -> dict:
    return next(h for h in trainer.state.log_history if h.get("step") == step and "tim/tokens" in h)


def test_a_window_a_trl_checkpoint_cut_logs_after_the_resume_what_the_uninterrupted_run_logs(toy_model_path,
                                                                                             tmp_path, caplog):
    full, full_cb = _run(toy_model_path, tmp_path / "full", fault=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        first, _ = _run(toy_model_path, tmp_path / "cut", fault=True, stop=SAVE, save_strategy="steps",
                        save_steps=SAVE)
    assert first.state.global_step == SAVE
    assert sum(LIVE in r.getMessage() for r in caplog.records) == 1  # printed when found
    assert not any(h.get("step") == STEPS for h in first.state.log_history)  # the window did not close
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        second, second_cb = _run(toy_model_path, tmp_path / "cut", fault=False, save_strategy="steps",
                                 save_steps=SAVE, resume=str(tmp_path / "cut" / "out" / f"checkpoint-{SAVE}"))
    assert not any(LIVE in r.getMessage() for r in caplog.records)  # the first attempt printed it

    want, got = _logged(full, STEPS), _logged(second, STEPS)
    assert want["tim/cause/named"] == 1.0
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    assert second_cb.pipeline.causes.tally == full_cb.pipeline.causes.tally
    assert second_cb.pipeline.causes.summary_lines() == full_cb.pipeline.causes.summary_lines()
    assert "[sync-noop]" in second_cb.pipeline.causes.summary_lines()[0]
