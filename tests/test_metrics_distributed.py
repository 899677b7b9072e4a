"""Exact merge across 2 real gloo processes: merged == one process on the concatenated data."""

from __future__ import annotations

import math
import os

import pytest
from free_port import free_port
from spawn_ranks import spawn_ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tim_plugins.metrics import MismatchMonitor


def _data(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    T = 17 + 6 * rank  # different lengths per rank
    logits = torch.randn(5, T, 61, generator=g) * 2
    tok = torch.randint(0, 61, (5, T), generator=g)
    r = torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0]
    t = torch.log_softmax(logits + 0.3 * torch.randn(logits.shape, generator=g), -1).gather(-1, tok[..., None])[..., 0]
    m = torch.rand(5, T, generator=g) < 0.7
    m[rank] = False  # each rank has a fully masked row
    r[4, 0], m[4, 0] = float("nan"), True  # and an invalid token
    w = torch.rand(5, T, generator=g)
    return r, t, m, w


def test_is_distributed_is_false_without_a_process_group():
    from tim_plugins.accumulate import collective_device, is_distributed

    assert not dist.is_initialized()
    assert is_distributed() is False and collective_device() == torch.device("cpu")


def _worker(rank: int, world: int, port: int, queue) -> None:
    from tim_plugins.accumulate import collective_device, is_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        assert is_distributed() and collective_device() == torch.device("cpu")  # gloo reduces host tensors
        mon = MismatchMonitor()
        r, t, m, w = _data(rank)
        # Two micro-batches per rank.
        mon.update(r[:2], t[:2], m[:2], is_weights=w[:2])
        mon.update(r[2:], t[2:], m[2:], is_weights=w[2:])
        merged = mon.compute()  # all-reduces
        hist = mon.histograms(sync=True)["abs_diff"][0].tolist()
        queue.put((rank, merged, hist))
    finally:
        dist.destroy_process_group()


def test_two_rank_merge_equals_single_process():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    results.sort(key=lambda x: x[0])
    (_, merged0, hist0), (_, merged1, hist1) = results
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))
    assert merged0.keys() == merged1.keys()
    assert all(same(merged0[k], merged1[k]) for k in merged0)  # every rank sees the same merged numbers
    assert hist0 == hist1
    single_mon = _assert_equals_single_process(merged0)
    assert hist0 == single_mon.histograms()["abs_diff"][0].tolist()
    assert merged0["tim/invalid_tokens"] == 2


def _assert_equals_single_process(merged: dict) -> MismatchMonitor:
    """``merged`` equals one process's monitor on both ranks' ``_data`` (padded to one length; padding is masked
    out), which it returns."""
    parts = [_data(r) for r in range(2)]
    T = max(p[0].shape[1] for p in parts)
    pad = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)
    cat = [torch.cat([pad(p[i], v) for p in parts]) for i, v in enumerate((0.0, 0.0, False, 0.0))]
    single_mon = MismatchMonitor().update(cat[0], cat[1], cat[2], is_weights=cat[3])
    single = single_mon.compute()
    for key, want in single.items():
        got = merged[key]
        if key.endswith(("_max", "_min", "tokens", "count", "p99", "p999")):
            assert got == want or (math.isnan(got) and math.isnan(want)), key  # exact
        else:
            assert got == pytest.approx(want, rel=1e-6, abs=1e-12, nan_ok=True), key
    return single_mon


def _nccl_resume_worker(rank: int, world: int, port: int, queue) -> None:
    from tim_plugins.accumulate import collective_device
    from tim_plugins.pipeline import mean_response_length

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        assert collective_device() == torch.device("cuda", rank)
        r, t, m, w = _data(rank)
        mon = MismatchMonitor()
        mon.load_state_dict(MismatchMonitor().update(r, t, m, is_weights=w).state_dict())  # the state: on the CPU
        queue.put((rank, mon.compute(), mean_response_length(m)))  # merged before any update; a CPU mask
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()),
                    reason="needs 2 CUDA devices and NCCL")
def test_nccl_merges_a_state_loaded_onto_the_cpu():
    """Under NCCL, which refuses host tensors, a monitor whose state was just loaded from a checkpoint (on the CPU)
    merges before its next update, and a CPU mask's mean length merges: both equal one process on both ranks'
    data."""
    (_, merged0, length0), (_, merged1, length1) = spawn_ranks(_nccl_resume_worker)
    assert merged0 == pytest.approx(merged1, nan_ok=True)
    _assert_equals_single_process(merged0)
    masks = [_data(r)[2] for r in range(2)]
    want = sum(float(m.sum()) for m in masks) / sum(m.shape[0] for m in masks)
    assert length0 == length1 == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------------------------- the per-step pipeline
def _pipeline():
    from tim_plugins.corrections import CorrectionConfig
    from tim_plugins.pipeline import PipelineConfig, StepPipeline

    return StepPipeline(PipelineConfig(safe_vocab=True, compile=False,
                                       correction=CorrectionConfig(mode="icepop", icepop_band=(0.8, 1.25))))


def _pipeline_calls(rank: int):
    """What one rank hands its pipeline in one logging window: two micro-batches with the safe set's fields, and
    a problem that only this rank meets (counted under tim/diag/: rank 0 twice a batch without the safe set's
    fields, rank 1 once rollout and trainer log-probs of different shapes)."""
    from tim_plugins.safe_vocab import SafeLogprobs

    r, t, m, _ = _data(rank)
    r, t = r.nan_to_num(-1.0), t + 0.2 * torch.randn(t.shape, generator=torch.Generator().manual_seed(7 + rank))
    g = torch.Generator().manual_seed(200 + rank)
    safe = SafeLogprobs(None, torch.rand(m.shape, generator=g) < 0.9, torch.rand(m.shape, generator=g) * 0.1,
                        torch.randint(1, 60, m.shape, generator=g))
    rows = (slice(0, 2), slice(2, 5))
    calls = [((r[s], t[s], m[s]), {"safe": SafeLogprobs(None, *(x[s] for x in (safe.in_safe, safe.pruned_mass,
                                                                                 safe.size)))}) for s in rows]
    if rank == 0:
        calls += [((r[:1], t[:1], m[:1]), {})] * 2  # safe_vocab_mask_unavailable: measured without the safe set
    else:
        calls += [((r[:1], t[:1, :-1], m[:1]), {})]  # shape_mismatch: not measured
    return calls


def _pipeline_worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pipe = _pipeline()
        for args, kwargs in _pipeline_calls(rank):
            pipe.measure(*args, **kwargs)
        local = {f"tim/diag/{k}": v for k, v in pipe.diag.items()}  # this rank's own, read without a reset
        for part in (pipe.monitor, pipe.safe_vocab_stats, pipe.correction_stats):
            local.update(part.compute(sync=False))
        queue.put((rank, local, pipe.compute(0)[0]))
    finally:
        dist.destroy_process_group()


def test_pipeline_two_rank_merge_equals_single_process():
    """StepPipeline's every statistic (monitor, safe vocabulary, correction, IS weights) and its problem counts
    (tim/diag/*) merged over 2 gloo processes equal one process that made both ranks' calls."""
    import logging

    results = spawn_ranks(_pipeline_worker)
    (_, local0, merged0), (_, local1, merged1) = results
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))  # noqa: E731
    assert merged0.keys() == merged1.keys() and all(same(merged0[k], merged1[k]) for k in merged0)

    quiet, level = logging.getLogger("tim_plugins"), logging.getLogger("tim_plugins").level
    quiet.setLevel(logging.ERROR)  # the problems below are expected; restored for the tests after this one
    try:
        single = _pipeline()
        for rank in range(2):
            for args, kwargs in _pipeline_calls(rank):
                single.measure(*args, **kwargs)
        want = single.compute(0, sync=False)[0]
    finally:
        quiet.setLevel(level)
    assert want["tim/diag/shape_mismatch"] == 1 and want["tim/diag/safe_vocab_mask_unavailable"] == 2
    assert 0 < want["tim/correction/kept_frac"] < 1 and want["tim/safe_vocab/boundary_frac"] > 0
    assert merged0.keys() == want.keys(), sorted(merged0.keys() ^ want.keys())
    for key, value in want.items():
        got = merged0[key]
        if key.endswith(("_max", "_min", "tokens", "count", "p99", "p999")) or key.startswith("tim/diag/"):
            assert same(got, value), key  # exact
        else:
            assert got == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), key
    # one rank's own values differ from the merged ones (and each rank met only its own problem)
    for key in ("tim/tokens", "tim/safe_vocab/tokens", "tim/correction/kept_tokens", "tim/token/kl_k3"):
        assert local0[key] != merged0[key] and local1[key] != merged0[key], key
    assert "tim/diag/shape_mismatch" not in local0 and "tim/diag/safe_vocab_mask_unavailable" not in local1


def _logging_off() -> None:
    import logging

    logging.getLogger("tim_plugins").setLevel(logging.ERROR)  # the problems are expected (a spawned process)


def _resume_worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _logging_off()
        pipe = _pipeline()
        calls = _pipeline_calls(rank)
        for args, kwargs in calls:
            pipe.measure(*args, **kwargs)
        pipe.compute(0)  # a logging window closed: the problem counts merged
        for args, kwargs in calls:  # the window in progress at the checkpoint: each rank's problem again
            pipe.measure(*args, **kwargs)
        own_tokens = pipe.monitor.compute(sync=False)["tim/tokens"]  # this rank's window so far (no reset)
        saved = [pipe.state_dict() if rank == 0 else None]
        dist.broadcast_object_list(saved, 0)  # TRL saves trainer_state.json on the main process; all read it
        resumed = _pipeline()
        resumed.load_state_dict(saved[0], shared_only=rank != 0)
        queue.put((rank, own_tokens, resumed.compute(1)[0]))
    finally:
        dist.destroy_process_group()


def test_a_resume_from_the_main_processs_state_counts_nothing_twice():
    """TRL checkpoints the main process's state alone and every rank resumes from it: the main process takes it
    whole (its window in progress; the problem counts of every rank at the last merged window, plus its own since),
    the others only what every rank shares. Reference: the counts each rank met (rank 0: two a window, rank 1: one)
    and rank 0's own tokens of the window in progress; rank 1's window and its count since the last merge are what a
    resume loses."""
    results = spawn_ranks(_resume_worker)
    (_, tokens0, after0), (_, _, after1) = results
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))  # noqa: E731
    assert after0.keys() == after1.keys() and all(same(after0[k], after1[k]) for k in after0)
    # uninterrupted: 4 and 2; rank 1's second count came after the last merge and is not in rank 0's state
    assert after0["tim/diag/safe_vocab_mask_unavailable"] == 4 and after0["tim/diag/shape_mismatch"] == 1
    assert after0["tim/tokens"] == tokens0 > 0  # rank 0's window, once


def _causes_worker(rank: int, world: int, port: int, queue) -> None:
    from tim_plugins.cause_registry import Cause
    from tim_plugins.causes import CauseTracker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tracker = CauseTracker()
        # window 1: rank 1's engine alone dropped two tensors at the sync after step 3
        if rank == 1:
            tracker.add_found([Cause("sync-tensors-stale", 3, "2 tensors hold their previous values",
                                     tensors=("model.layers.1.q.weight", "model.layers.1.k.weight"),
                                     evidence={"bad": 2})])
        first = tracker.evaluate(4, {})
        # window 2: both ranks' engines found the same code, each its own tensor
        tracker.add_found([Cause("sync-tensors-stale", 5, f"rank {rank}'s tensor", tensors=(f"t{rank}",))])
        second = tracker.evaluate(6, {})
        third = tracker.evaluate(7, {})  # nothing found anywhere
        queue.put((rank, [(values, [c.to_dict() for c in found]) for values, found in (first, second, third)]))
    finally:
        dist.destroy_process_group()


def test_a_cause_one_ranks_check_found_is_named_with_its_tensors_on_every_rank():
    """A sync cause found on rank 1 only reaches rank 0 (whose console and causes.jsonl the user reads) with rank 1's
    step, tensors and evidence; a code both ranks found stays each rank's own; an empty window names nothing."""
    (_, zero), (_, one) = spawn_ranks(_causes_worker)
    tensors = ["model.layers.1.q.weight", "model.layers.1.k.weight"]
    (values0, found0), (values1, found1) = zero[0], one[0]
    assert values0["tim/cause/named"] == values1["tim/cause/named"] == 1
    assert [(c["code"], c["step"], c["tensors"], c["evidence"]) for c in found0] == \
        [("sync-tensors-stale", 3, tensors, {"bad": 2})]
    assert found0[0]["message"] == "2 tensors hold their previous values (on rank 1)"
    assert [(c["step"], c["tensors"], c["message"]) for c in found1] == \
        [(3, tensors, "2 tensors hold their previous values")]
    for rank, result in enumerate((zero, one)):
        values, found = result[1]
        assert values["tim/cause/named"] == 1
        assert [(c["code"], c["tensors"], c["message"]) for c in found] == \
            [("sync-tensors-stale", [f"t{rank}"], f"rank {rank}'s tensor")]
        assert result[2][0]["tim/cause/named"] == 0 and result[2][1] == []
