"""A checkpoint saved inside a logging window (TRL's ``save_steps`` need not be a multiple of its ``logging_steps``):
the cause tracker carries the window in progress as the monitor does, so the window that closes after the resume
names what the uninterrupted run names there. References: the same batches and syncs through one uninterrupted
pipeline, the confident disagreements counted token by token in the test, the rows beside the dump."""

from __future__ import annotations

import json
import logging
import math

import torch

from tim_plugins.causes import Cause, CauseConfig
from tim_plugins.dump import DumpConfig
from tim_plugins.pipeline import StepPipeline, pipeline_config
from tim_plugins.weight_sync import SyncReport

KEYS = ("tim/tokens", "tim/cause/named", "tim/cause/confident_disagreements", "tim/cause/sync_bad_tensors",
        "tim/cause/sync_checked_tensors")


def _pipeline(folder=None):
    dump = DumpConfig(out_dir=str(folder), sample_rate=1.0) if folder is not None else None
    return StepPipeline(pipeline_config(causes=CauseConfig(), probe=None, dump=dump), framework="trl")


def _batch(seed: int, confident: int):
    """Lag-0 log-probs with rounding-sized noise and ``confident`` tokens the engine gave p >= 0.5 scored 3 nats
    lower by the trainer."""
    g = torch.Generator().manual_seed(seed)
    rollout = torch.log(torch.rand(64, 8, generator=g) * 0.98 + 0.01)
    train = rollout + 1e-3 * torch.randn(64, 8, generator=g)
    idx = (rollout >= math.log(0.5)).flatten().nonzero().flatten()[:confident]
    train.view(-1)[idx] = rollout.view(-1)[idx] - 3.0
    return rollout, train, torch.ones(64, 8, dtype=torch.bool)


def _naive_disagreements(batches) -> int:
    return sum(int(m and r >= math.log(0.5) and r != 0.0 and t < r - 2.0)
               for rollout, train, mask in batches
               for r, t, m in zip(rollout.flatten().tolist(), train.flatten().tolist(), mask.flatten().tolist()))


def _report(step: int) -> SyncReport:
    report = SyncReport(step, 1, statuses={"a": "ok", "model.layers.1.q.weight": "stale"})
    report.causes = [Cause("sync-tensors-stale", step, f"at the weight sync after optimizer step {step}",
                           tensors=("model.layers.1.q.weight",))]
    return report


def _rows(folder):
    return [(r["code"], r["step"], r["window"]) for r in map(json.loads, (folder / "causes.jsonl").read_text()
                                                                      .splitlines())]


def _run(folder, *, cut: bool, monkeypatch=None, load_rank: int = 0):
    """Window 1-10, then window 11-20 holding a faulty sync and one confident disagreement before step 15 (the
    checkpoint: ``cut`` resumes a new pipeline from it there) and one after."""
    pipe = _pipeline(folder)
    pipe.measure(*_batch(1, 0))
    pipe.compute(10, sync=False)
    before, after = _batch(2, 1), _batch(3, 1)
    pipe.sync_checked(_report(11))
    pipe.measure(*before)
    if cut:
        state = pipe.state_dict()
        pipe = _pipeline(folder)
        if load_rank:
            import tim_plugins.causes as causes

            monkeypatch.setattr(causes, "_rank", lambda: load_rank)
        pipe.load_state_dict(state)
    pipe.measure(*after)
    out = pipe.compute(20, sync=False)[0]
    return pipe, out, (before, after)


def test_a_window_cut_by_a_checkpoint_names_what_the_uninterrupted_run_names(tmp_path, caplog):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    want_pipe, want, (before, after) = _run(whole, cut=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tim_plugins.causes"):
        got_pipe, got, _ = _run(cut, cut=True)
    assert want["tim/cause/confident_disagreements"] == _naive_disagreements([before, after]) == 2
    assert {k: got[k] for k in KEYS} == {k: want[k] for k in KEYS}
    assert got["tim/cause/named"] == 2  # engine-stale (2 >= confident_min_tokens) and the sync's cause
    assert got_pipe.causes.tally == want_pipe.causes.tally
    assert sorted(got_pipe.causes.tally) == ["engine-stale", "sync-tensors-stale"]
    # the sync's cause was logged and written at the sync, before the checkpoint: not again after the resume
    assert _rows(cut) == _rows(whole) == [("sync-tensors-stale", 11, 12), ("engine-stale", 20, 20)]
    logged = [r.getMessage() for r in caplog.records]
    assert sum("[sync-tensors-stale]" in m for m in logged) == 1 and sum("[engine-stale]" in m for m in logged) == 1


def test_another_ranks_window_in_progress_is_not_taken(tmp_path, monkeypatch):
    """TRL saves the main process's state and every rank loads it: a rank other than the one that saved it takes
    the floor and the causes named, not the saving rank's window in progress (the merge over ranks would count it
    once per rank). Reference: the tokens after the checkpoint alone."""
    pipe, out, (_, after) = _run(tmp_path, cut=True, monkeypatch=monkeypatch, load_rank=1)
    assert out["tim/cause/confident_disagreements"] == _naive_disagreements([after]) == 1
    assert out["tim/cause/named"] == 0 and math.isnan(out["tim/cause/sync_bad_tensors"])
    assert pipe.causes.tally == {}


def _resume_worker(rank: int, world: int, port: int, queue) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logging.getLogger("tim_plugins").setLevel(logging.ERROR)
        pipe = _pipeline()
        pipe.measure(*_batch(10 + rank, 1))  # each rank's window in progress at the checkpoint
        if rank == 0:
            pipe.sync_checked(_report(11))
        saved = [pipe.state_dict() if rank == 0 else None]
        dist.broadcast_object_list(saved, 0)  # TRL saves trainer_state.json on the main process; all read it
        resumed = _pipeline()
        resumed.load_state_dict(saved[0], shared_only=rank != 0)
        resumed.measure(*_batch(20 + rank, 1))
        out = resumed.compute(20)[0]
        queue.put((rank, {k: out[k] for k in KEYS[1:]}, sorted(resumed.causes.tally)))
    finally:
        dist.destroy_process_group()


def test_two_ranks_resuming_from_the_main_processs_state_count_its_window_once():
    """Two ranks (gloo) resume from rank 0's state as TRL does: rank 0's window in progress (one confident
    disagreement, a faulty sync) is counted once in the merged window, rank 1's is what a resume loses, as the
    monitor's. Reference: the disagreements of rank 0's batches and of both ranks' batches after the resume, counted
    in the test."""
    from spawn_ranks import spawn_ranks

    (_, out0, tally0), (_, out1, tally1) = spawn_ranks(_resume_worker, 2, timeout=180)
    want = _naive_disagreements([_batch(10, 1), _batch(20, 1), _batch(21, 1)])
    assert want == 3
    assert out0 == out1 and out0["tim/cause/confident_disagreements"] == want
    assert out0["tim/cause/named"] == 2 and out0["tim/cause/sync_bad_tensors"] == 1
    assert tally0 == tally1 == ["engine-stale", "sync-tensors-stale"]
