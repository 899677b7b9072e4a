"""The monitor on a CUDA device (compiled by default there) against the naive float64 reference.

Skipped without a GPU; CI has none. Run on a GPU machine with ``pytest tests/test_metrics_cuda.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_metrics import assert_matches, make_batch, reference

from tim_plugins._mismatch_pass import N_BUCKETS, cell_counts
from tim_plugins.metrics import MismatchMonitor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _with_bad_tokens(B, T, dtype=torch.float32):
    rollout, train, mask = make_batch(B, T, dtype=dtype)
    mask[0] = False  # a fully masked row
    rollout[1, 0] = float("nan")
    train[1, 1] = float("inf")
    rollout[1, 2] = -9999.0
    mask[1, :3] = True
    return rollout, train, mask


def _monitor(path: str) -> MismatchMonitor:
    """'triton': the CUDA default; 'compiled': torch.compile (the fallback without Triton); 'eager'."""
    mon = MismatchMonitor(compile=path != "eager")
    mon._triton_failed = path != "triton"
    return mon


@pytest.mark.parametrize("path", ["triton", "compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 17), (7, 129), (33, 1001), (70, 2050)])
def test_cuda_matches_reference(path, dtype, shape):
    rollout, train, mask = _with_bad_tokens(*shape, dtype=dtype)
    mon = _monitor(path).update(rollout.cuda(), train.cuda(), mask.cuda())
    got = mon.compute()
    assert not mon._triton_failed or path != "triton"
    assert not mon._compile_failed
    assert got["tim/invalid_tokens"] == 3
    assert_matches(got, reference(rollout, train, mask), rtol=1e-5)


@pytest.mark.parametrize("path", ["triton", "compiled"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_cuda_equals_cpu_including_histograms(path, mask_dtype):
    rollout, train, mask = _with_bad_tokens(16, 257)
    mask = mask.to(mask_dtype)
    w = torch.rand(16, 257) * 2
    w[w < 0.3] = 0.0
    cpu = MismatchMonitor(compile=False)
    gpu = _monitor(path)
    for seed in range(2):  # two updates: the state accumulates, the kernel's scratch is reset between
        r, t = (rollout, train) if seed == 0 else make_batch(16, 257, seed=1)[:2]
        cpu.update(r, t, mask, is_weights=w)
        gpu.update(r.cuda(), t.cuda(), mask.cuda(), is_weights=w.cuda())
    assert not gpu._triton_failed or path != "triton"
    a, b = cpu.compute(), gpu.compute()
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9, nan_ok=True), key
    # Histogram counts are integers: histc on CUDA and index_add_ on the CPU give them exactly.
    for name, (counts, _) in cpu.histograms().items():
        assert (gpu.histograms()[name][0] == counts).all(), name


def test_cell_counts_histc_equals_index_add_beyond_float32_exact_range():
    n_cells = N_BUCKETS * 701 + 1
    g = torch.Generator().manual_seed(0)
    n = 2**24 + 4099  # more than float32 counts exactly in one histc call
    cell = torch.randint(0, n_cells + 1, (n,), generator=g)  # n_cells itself is the dropped cell
    cell[: 2**23] = 7  # one very busy cell
    want = torch.bincount(cell, minlength=n_cells + 1)[:n_cells].double()
    assert torch.equal(cell_counts(cell.cuda(), n_cells).cpu(), want)
    assert torch.equal(cell_counts(cell, n_cells), want)


def test_cuda_update_does_not_sync_with_the_host():
    rollout, train, mask = (x.cuda() for x in make_batch(8, 64))
    mon = MismatchMonitor()  # the Triton path
    mon.update(rollout, train, mask)  # compile outside the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        mon.update(rollout, train, mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(mon.compute()["tim/token/kl_k3"])
