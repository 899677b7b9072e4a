"""The sync check's engine reads across processes (``integrations/vllm/worker_reads.py``): what a vLLM worker answers
is plain data (it crosses msgpack and Ray), one engine's tensor-parallel answers merge into the reads of the whole
tensor, and the check run on the merged answers finds what it finds on the engine read in one piece. The reference is
an engine held as plain tensors here, sharded by the test (rows of a column-parallel weight, columns of a
row-parallel one), and the check's result on the unsharded engine."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tim_plugins.integrations.vllm.worker_reads import (WorkerReads, decode_read, encode_read, read_requests,
                                                        sync_requests)
from tim_plugins.weight_sync import EngineRead, SyncCheck, SyncCheckConfig

SHAPES = {"model.embed_tokens.weight": (50, 8), "model.layers.0.q.weight": (12, 8), "model.layers.0.o.weight": (8, 12),
          "model.layers.0.norm.weight": (8,), "model.layers.1.q.weight": (12, 8), "model.scale": ()}
# how the test shards each tensor over two "workers": the dim split in halves (None: every worker holds it whole)
SPLIT = {"model.embed_tokens.weight": 0, "model.layers.0.q.weight": 0, "model.layers.0.o.weight": 1,
         "model.layers.1.q.weight": 0}


def _weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


class ShardEngine:
    """One tensor-parallel worker's engine: the half ``rank`` of each split tensor (``held``; outside it the read
    says NaN, as vLLM's reader does), the whole of the others; the reader interface ``read_requests`` takes
    (``dtype``, ``read``)."""

    def __init__(self, held: dict, rank: int | None, dtype=torch.float32, missing=(), unreadable=()):
        self.held, self.rank, self.dtype = held, rank, dtype
        self.missing, self.unreadable = set(missing), set(unreadable)

    def read(self, name, shape, index):
        if name in self.unreadable:
            return None
        if name in self.missing:
            return EngineRead(missing=True)
        t = self.held[name].to(self.dtype)
        values = t[tuple(index.T)].double() if t.dim() else t.reshape(1).double()
        dim = SPLIT.get(name)
        if self.rank is not None and dim is not None:
            half = shape[dim] // 2
            mine = (index[:, dim] >= half) if self.rank else (index[:, dim] < half)
            values = torch.where(mine, values, torch.full_like(values, math.nan))
            return EngineRead(values=values, dtype=self.dtype, held=mine)
        return EngineRead(values=values, dtype=self.dtype)


def _sync(check, held, weights, step, *, ranks, skip=()):
    record = check.begin(step)
    for name, tensor in record.observing(list(weights.items())):
        if name not in skip:
            held[name] = tensor.clone()
    requests = sync_requests(record)
    # what a worker answers crosses msgpack / Ray: JSON-serialisable plain data, NaN included
    answers = [json.loads(json.dumps(read_requests(ShardEngine(held, r), requests))) for r in ranks]
    return check.finish(record, WorkerReads(requests, answers))


@pytest.mark.parametrize("ranks", [[None], [0, 1], [1, 0]], ids=["whole", "tp2", "tp2-reversed"])
def test_merged_shards_find_what_the_whole_engine_finds(ranks):
    reference, sharded = SyncCheck(SyncCheckConfig(elements_per_tensor=16)), SyncCheck(
        SyncCheckConfig(elements_per_tensor=16))
    held_ref, held = {}, {}
    w0, w1 = _weights(0), _weights(1)
    for step, weights, skip in ((0, w0, ()), (1, w1, ("model.layers.1.q.weight", "model.layers.0.o.weight"))):
        want = _sync(reference, held_ref, weights, step, ranks=[None], skip=skip)
        got = _sync(sharded, held, weights, step, ranks=ranks, skip=skip)
        assert got.statuses == want.statuses
        assert [c.code for c in got.causes] == [c.code for c in want.causes]
    # the skipped tensors, by the test's own fault: stale at the second sync, the others ok
    assert {n for n, s in got.statuses.items() if s != "ok"} == set(skip)
    assert got.names("stale") == sorted(skip, key=list(SHAPES).index)
    assert [c.code for c in got.causes] == ["sync-tensors-stale"]


def test_a_read_round_trips_and_merging_fills_each_element_once():
    values = torch.tensor([1.5, math.nan, -2.0, math.nan], dtype=torch.float64)
    held = torch.tensor([True, False, True, False])
    atol = torch.tensor([0.1, 0.0, 0.2, 0.0], dtype=torch.float64)
    read = EngineRead(values=values, dtype=torch.bfloat16, atol=atol, quantized=True, held=held)
    back = decode_read(json.loads(json.dumps(encode_read(read))))
    assert back.dtype == torch.bfloat16 and back.quantized and not back.missing
    assert torch.equal(back.held, held)
    assert torch.equal(back.values[held], values[held])
    assert torch.equal(back.atol, atol)
    assert decode_read(encode_read(None)) is None and decode_read(encode_read(EngineRead(missing=True))).missing
    whole = decode_read(encode_read(EngineRead(values=values, dtype=torch.float32)))
    assert whole.atol == 0.0 and whole.held is None
    # the other worker holds the other two elements (with its own bounds), one of them NaN in its engine: merged,
    # each element from its holder, the NaN kept as the engine's value
    other = EngineRead(values=torch.tensor([0.0, 7.0, 0.0, math.nan], dtype=torch.float64), dtype=torch.bfloat16,
                       atol=torch.tensor([0.0, 0.3, 0.0, 0.4], dtype=torch.float64), quantized=True, held=~held)
    request = [["w", [4], [[0], [1], [2], [3]]]]
    answers = [{"dtype": "bfloat16", "reads": [encode_read(r)]} for r in (read, other)]
    merged = WorkerReads(request, answers).read("w", (4,), torch.arange(4).view(-1, 1))
    assert merged.values[:3].tolist() == [1.5, 7.0, -2.0] and math.isnan(merged.values[3])
    assert merged.held is None  # every element held by some worker
    assert merged.atol.tolist() == [0.1, 0.3, 0.2, 0.4]
    assert merged.quantized and merged.dtype == torch.bfloat16
    # an element no worker holds stays out
    alone = WorkerReads(request, answers[:1]).read("w", (4,), torch.arange(4).view(-1, 1))
    assert torch.equal(alone.held, held)


def test_a_shard_holding_nan_is_named_across_workers():
    """A NaN in one worker's shard (a corrupted load on one tensor-parallel rank) is the engine's value, not an
    element held elsewhere: named ``differs`` on the merged answers, as on the engine read whole."""
    name = "model.layers.0.q.weight"  # rows split over the two workers
    for ranks in ([None], [0, 1]):
        check, held = SyncCheck(SyncCheckConfig(elements_per_tensor=16)), {}
        _sync(check, held, _weights(0), 0, ranks=ranks)
        record = check.begin(1)
        for n, tensor in record.observing(list(_weights(1).items())):
            held[n] = tensor.clone()
        held[name][SHAPES[name][0] // 2:] = math.nan  # the second worker's rows
        requests = sync_requests(record)
        answers = [json.loads(json.dumps(read_requests(ShardEngine(held, r), requests))) for r in ranks]
        report = check.finish(record, WorkerReads(requests, answers))
        assert {c.code: c.tensors for c in report.causes} == {"sync-tensors-differ": (name,)}, ranks
        rows = check.index(name, SHAPES[name])[:, 0]
        n_bad = int((rows >= SHAPES[name][0] // 2).sum())
        assert 0 < n_bad < len(rows)
        assert report.detail[name].startswith(f"{n_bad} of {len(rows)} sampled values NaN"), ranks


def test_missing_and_unreadable_tensors_keep_their_meaning():
    check = SyncCheck(SyncCheckConfig(elements_per_tensor=16))
    record = check.begin(0)
    held = {n: t.clone() for n, t in record.observing(list(_weights(0).items()))}
    requests = sync_requests(record)
    answers = [read_requests(ShardEngine(held, r, missing={"model.scale"}, unreadable={"model.layers.0.norm.weight"}),
                             requests) for r in (0, 1)]
    report = check.finish(record, WorkerReads(requests, answers))
    assert report.statuses["model.scale"] == "missing" and report.statuses["model.layers.0.norm.weight"] == "unread"
    assert [c.code for c in report.causes] == ["sync-tensors-missing"]
    assert report.checked_tensors == len(SHAPES) - 1


def test_a_reader_that_raises_costs_that_tensor_only():
    class Broken(ShardEngine):
        def read(self, name, shape, index):
            if name == "model.layers.0.q.weight":
                raise RuntimeError("an unknown layout")
            return super().read(name, shape, index)

    check = SyncCheck(SyncCheckConfig())
    record = check.begin(0)
    held = {n: t.clone() for n, t in record.observing(list(_weights(0).items()))}
    answer = read_requests(Broken(held, None), sync_requests(record))
    assert answer["dtype"] == "float32"
    assert [r is None for r in answer["reads"]] == [n == "model.layers.0.q.weight" for n in SHAPES]
    with pytest.raises(ValueError, match="at least one"):
        WorkerReads(sync_requests(record), [])


def test_a_shard_one_worker_could_not_read_leaves_the_tensor_unread():
    """Worker 1 cannot read its half of the q weight (its reader raised): the tensor is unread (counted), not
    checked on worker 0's half alone, where a fault in worker 1's shard would go unseen. The norm, which both
    workers hold whole, stays checked on worker 0's read."""
    class Broken(ShardEngine):
        def read(self, name, shape, index):
            if self.rank == 1 and name in ("model.layers.0.q.weight", "model.layers.0.norm.weight"):
                raise RuntimeError("an unknown layout")
            return super().read(name, shape, index)

    check = SyncCheck(SyncCheckConfig(elements_per_tensor=16))
    record = check.begin(0)
    held = {n: t.clone() for n, t in record.observing(list(_weights(0).items()))}
    requests = sync_requests(record)
    answers = [read_requests(Broken(held, r), requests) for r in (0, 1)]
    report = check.finish(record, WorkerReads(requests, answers))
    assert report.statuses["model.layers.0.q.weight"] == "unread"
    assert report.statuses["model.layers.0.norm.weight"] == "ok"
    assert report.names("unread") == ["model.layers.0.q.weight"] and report.causes == []
