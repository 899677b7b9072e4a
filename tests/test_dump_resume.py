"""A run resumed from a checkpoint after a crash, as its dump folder and ``tim-plugins report`` see it: the steps
after the checkpoint that the crashed attempt wrote (per-token files of every rank, log_history.jsonl rows,
causes.jsonl rows) are not the run's; the report shows only what training went on from, and the abandoned
attempt's data stays readable in ``superseded/``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")


def _batch(B=8, T=12, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 3
    train = rollout + torch.randn(B, T, generator=g) * 0.01
    mask = torch.ones(B, T, dtype=torch.bool)
    tokens = torch.randint(0, 100, (B, T), generator=g)
    return rollout, train, mask, tokens


def _rows(files) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(f).num_rows for f in files)


class _CrashAt:
    """A TRL callback that kills the run at the end of ``step`` (after the TIM callback closed its window: the step's
    row and causes are written, as a crash in the next step's start would leave them)."""

    def __new__(cls, step):
        from transformers import TrainerCallback

        class Crash(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step:
                    raise RuntimeError(f"crashed after step {step}")

        return Crash()


class _SyncFaultAt:
    """A TRL callback that has the TIM callback's cause tracker find a broken weight sync at the sync before ``step``
    (what ``sync_check`` hands it: ``CauseTracker.add_found``), so the window of ``step`` names it."""

    def __new__(cls, cb, step):
        from transformers import TrainerCallback

        from tim_plugins.causes import Cause

        class Fault(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == step:
                    cb.pipeline.causes.add_found([Cause("sync-noop", step - 1, "at the weight sync after optimizer "
                                                        f"step {step - 1}, none of the 3 checked tensors changed")])

        return Fault()


def test_a_trl_run_resumed_after_a_crash_reports_only_what_training_went_on_from(toy_model_path, tmp_path):
    """Attempt 1 (two ranks' dump files: rank 1's written as its second process would) checkpoints at step 2, names a
    broken sync in step 3's window and crashes after step 3. Attempt 2 resumes from checkpoint-2 on one process,
    with no fault, to step 4. The report names no cause, reads rank 1's files of steps 1-2 (before the checkpoint)
    but not of step 3, and step 3's row is attempt 2's; attempt 1's step-3 data is in ``superseded/``."""
    from test_trl_callback import make_trainer

    from tim_plugins.dump import CAUSES_LOG, LOG_HISTORY, TokenDumper, dump_files, read_log_history
    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.report import build_report
    from tim_plugins.report.causes import read_causes
    from tim_plugins.report.tokens import load_tokens

    dump = tmp_path / "dump"
    config = dict(dump_dir=str(dump), dump_options={"sample_rate": 1.0}, log_detail=True)
    first = make_trainer(toy_model_path, tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    cb = TIMCallback(first, TIMConfig(**config))
    first.add_callback(cb)
    first.add_callback(_SyncFaultAt(cb, 3))
    first.add_callback(_CrashAt(3))
    with pytest.raises(RuntimeError, match="crashed after step 3"):
        first.train()
    cb.detach()  # the crashed process is gone: nothing of it stays installed
    second_rank = TokenDumper(out_dir=str(dump), sample_rate=1.0)
    for step in (1, 2, 3):
        second_rank.write(step, *_batch(seed=step)[:3], _batch(seed=step)[3], rank=1)
    assert [c["code"] for c in read_causes(dump)] == ["sync-noop"]  # the fault is on disk before the resume
    assert {p.name for p in dump_files(dump)} >= {"step_00000003-rank_0000.parquet",
                                                  "step_00000003-rank_0001.parquet"}
    crashed_rows = {p.name: _rows([p]) for p in dump_files(dump) if "step_00000003" in p.name}
    crashed_log = [r for r in read_log_history(dump / LOG_HISTORY) if r["step"] == 3]

    second = make_trainer(toy_model_path, tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    second.add_callback(TIMCallback(second, TIMConfig(**config)))
    second.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))

    names = [p.name for p in dump_files(dump)]
    assert names == [f"step_{s:08d}-rank_{r:04d}.parquet" for s, r in
                     [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (4, 0)]]
    assert read_causes(dump) in (None, [])
    logged = {h["step"]: h for h in second.state.log_history if "loss" in h}
    history = read_log_history(dump / LOG_HISTORY)
    assert [r["step"] for r in history] == [1, 2, 3, 4]  # each step once, attempt 2's rows after the checkpoint
    assert [r["tim/tokens"] for r in history[2:]] == [logged[3]["tim/tokens"], logged[4]["tim/tokens"]]
    # the report pools exactly those files' rows and names no cause
    tokens = load_tokens(dump)
    assert tokens.rows == _rows(dump_files(dump))
    html = build_report(dump).read_text()
    assert "sync-noop" not in html and "ACT:" not in html

    # attempt 1's step 3, readable where it was moved (a dump folder of its own: `tim-plugins report` renders it)
    [moved] = list((dump / "superseded").iterdir())
    assert {p.name: _rows([p]) for p in dump_files(moved)} == crashed_rows
    assert [c["code"] for c in read_causes(moved)] == ["sync-noop"]
    assert read_log_history(moved / LOG_HISTORY) == crashed_log
    assert (moved / CAUSES_LOG).exists() and "sync-noop" in build_report(moved).read_text()


def crashed_attempt(folder: Path, steps=(1, 2, 3, 4), ranks=(0, 1), fault_window=3) -> None:
    """What a two-rank attempt leaves in ``folder`` when it crashes after ``steps[-1]``, written by the writers the
    adapters use: each rank's dump files, the log rows, and a broken sync after step ``fault_window - 1`` named in
    the window of ``fault_window`` (a cause's step is the optimizer step before the sync)."""
    from tim_plugins.causes import Cause
    from tim_plugins.dump import TokenDumper, append_causes, append_log_history

    for rank in ranks:
        dumper = TokenDumper(out_dir=str(folder), sample_rate=1.0)
        for step in steps:
            rollout, train, mask, tokens = _batch(seed=100 * rank + step)
            dumper.write(step, rollout, train, mask, tokens, rank=rank)
    for step in steps:
        append_log_history(folder, step, {"tim/tokens": 100.0 + step, "tim/token/kl_k3": 1e-5})
        if step == fault_window:
            append_causes(folder, [Cause("sync-noop", step - 1, f"at the weight sync after optimizer step {step - 1}, "
                                         "none of the 3 checked tensors changed")], window=step)


def resumed_attempt(folder: Path, steps=(3,)) -> None:
    """The resumed attempt on one rank, no fault: its dump files and log rows."""
    from tim_plugins.dump import TokenDumper, append_log_history

    dumper = TokenDumper(out_dir=str(folder), sample_rate=1.0)
    for step in steps:
        rollout, train, mask, tokens = _batch(seed=1000 + step)
        dumper.write(step, rollout, train, mask, tokens, rank=0)
        append_log_history(folder, step, {"tim/tokens": 200.0 + step, "tim/token/kl_k3": 2e-5})


def check_resumed_folder(folder: Path, first_step: int, kept_steps, resumed_steps) -> Path:
    """The report of ``folder`` after ``crashed_attempt``, ``supersede_from(folder, first_step)`` (by whoever) and
    ``resumed_attempt(folder, resumed_steps)``: only the rows training went on from. Returns the superseded folder."""
    from report_reference import load_tokens as reference_tokens

    from tim_plugins.dump import LOG_HISTORY, SUPERSEDED, dump_files, read_log_history
    from tim_plugins.report import build_report
    from tim_plugins.report.causes import read_causes
    from tim_plugins.report.tokens import load_tokens, metrics_by_step

    want = [f"step_{s:08d}-rank_{r:04d}.parquet" for s in kept_steps for r in (0, 1)] + [
        f"step_{s:08d}-rank_0000.parquet" for s in resumed_steps]
    assert [p.name for p in dump_files(folder)] == sorted(want)
    assert read_causes(folder) in (None, [])
    assert [(r["step"], r["tim/tokens"]) for r in read_log_history(folder / LOG_HISTORY)] == [
        (s, 100.0 + s) for s in kept_steps] + [(s, 200.0 + s) for s in resumed_steps]
    # the report's per-step numbers are those of the kept files alone (the reference reads them whole)
    ref = reference_tokens(folder)
    steps, per_step = metrics_by_step(load_tokens(folder))
    assert list(steps) == list(kept_steps) + list(resumed_steps)
    for step, got in zip(steps, per_step):
        rows = ref.step == step
        assert got["tim/tokens"] == rows.sum()
        assert got["tim/token/abs_diff_max"] == pytest.approx(abs(ref.train[rows] - ref.rollout[rows]).max(), rel=1e-6)
    html = build_report(folder).read_text()
    assert "sync-noop" not in html and "ACT:" not in html
    [moved] = list((folder / SUPERSEDED).iterdir())
    assert moved.name.endswith(f"-from-step-{first_step}")
    return moved


def test_supersede_moves_every_ranks_later_steps_rows_and_causes_and_the_report_reads_the_rest(tmp_path):
    """A two-rank attempt crashed after step 4 (checkpoint 2); the run resumes at step 3 on one rank and stops after
    step 3 (crashed again, or a shorter schedule): the report reads steps 1-2 of both ranks and the new step 3 alone,
    no log row of step 4, no cause of the crashed attempt (its sync-noop's own step, 2, is before the checkpoint: it
    goes by the window that named it, 3). The moved files and rows read as they were, in ``superseded/``."""
    from tim_plugins.dump import CAUSES_LOG, LOG_HISTORY, dump_files, read_log_history, supersede_from
    from tim_plugins.report.causes import read_causes

    crashed_attempt(tmp_path)
    before = {p.name: p.read_bytes() for p in dump_files(tmp_path)}
    rows_before = read_log_history(tmp_path / LOG_HISTORY)
    causes_before = read_causes(tmp_path)
    moved_to, moved = supersede_from(tmp_path, 3)
    assert moved == {"files": 4, "log_rows": 2, "causes": 1}
    resumed_attempt(tmp_path, steps=(3,))
    moved_dir = check_resumed_folder(tmp_path, 3, kept_steps=(1, 2), resumed_steps=(3,))
    assert moved_dir == moved_to
    assert {p.name: p.read_bytes() for p in dump_files(moved_to)} == {
        name: data for name, data in before.items() if int(name[5:13]) >= 3}
    assert read_log_history(moved_to / LOG_HISTORY) == rows_before[2:]
    assert read_causes(moved_to) == causes_before and (moved_to / CAUSES_LOG).is_file()
    # nothing of a later step left: a second resume at the same step moves nothing and makes no folder
    resumed_steps_files = sorted(p.name for p in dump_files(tmp_path))
    assert supersede_from(tmp_path, 4) == (None, {"files": 0, "log_rows": 0, "causes": 0})
    assert sorted(p.name for p in dump_files(tmp_path)) == resumed_steps_files
    assert len(list((tmp_path / "superseded").iterdir())) == 1


def test_supersede_reads_old_cause_rows_by_their_step_and_drops_a_torn_last_line(tmp_path):
    """causes.jsonl rows written before the window field go by their own step; the crashed attempt's torn last
    lines (killed mid-append) do not survive into the rewritten logs; rows without a step stay."""
    from tim_plugins.dump import CAUSES_LOG, LOG_HISTORY, read_log_history, supersede_from
    from tim_plugins.report.causes import read_causes

    old = [{"code": "floor-jump", "step": s, "message": "m"} for s in (2, 3)]
    (tmp_path / CAUSES_LOG).write_text("".join(json.dumps(c) + "\n" for c in old) + '{"code": "floor-ju')
    (tmp_path / LOG_HISTORY).write_text("".join(json.dumps({"step": s, "tim/tokens": 1.0}) + "\n" for s in (1, 2, 3))
                                        + json.dumps({"note": "no step"}) + "\n" + '{"step": 4, "tim/to')
    moved_to, moved = supersede_from(tmp_path, 3)
    assert moved == {"files": 0, "log_rows": 1, "causes": 1}
    assert read_causes(tmp_path) == old[:1] and read_causes(moved_to) == old[1:]
    assert read_log_history(tmp_path / LOG_HISTORY) == [{"step": 1, "tim/tokens": 1.0}, {"step": 2, "tim/tokens": 1.0},
                                                        {"note": "no step"}]
    assert (tmp_path / LOG_HISTORY).read_text().endswith("}\n")  # the next append starts a line of its own
