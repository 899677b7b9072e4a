"""Exact merge across 2 real gloo processes: merged == one process on the concatenated data."""

from __future__ import annotations

import math
import os
import socket

import pytest
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


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_rank_merge_equals_single_process():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
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

    # Single process on the concatenated data (padded to one length; padding is masked out).
    parts = [_data(r) for r in range(2)]
    T = max(p[0].shape[1] for p in parts)
    pad = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)
    cat = [torch.cat([pad(p[i], v) for p in parts]) for i, v in enumerate((0.0, 0.0, False, 0.0))]
    single_mon = MismatchMonitor().update(cat[0], cat[1], cat[2], is_weights=cat[3])
    single = single_mon.compute()
    for key, want in single.items():
        got = merged0[key]
        if key.endswith(("_max", "_min", "tokens", "count", "p99", "p999")):
            assert got == want or (math.isnan(got) and math.isnan(want)), key  # exact
        else:
            assert got == pytest.approx(want, rel=1e-6, abs=1e-12, nan_ok=True), key
    assert hist0 == single_mon.histograms()["abs_diff"][0].tolist()
    assert merged0["tim/invalid_tokens"] == 2
