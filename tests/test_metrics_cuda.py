"""The monitor on a CUDA device (the Triton kernel by default there) against the float64 reference and the CPU.

Skipped without a GPU; CI has none. On a GPU machine: ``bash benchmarks/gpu_checks.sh`` (these tests, then the
benchmark against verl), or ``pytest tests/test_metrics_cuda.py`` alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_metrics import (
    assert_k3_and_chi2_of_cancelling_batches,
    assert_k3_and_chi2_per_token,
    assert_matches,
    assert_prob_abs_diff_per_token,
    make_batch,
    reference,
    small_d_tokens,
)
from test_metrics_triton import assert_same_state

from tim_plugins._mismatch_layout import N_BUCKETS, N_SIGNED_BINS, OFFSETS
from tim_plugins._mismatch_pass import cell_counts
from tim_plugins.metrics import MismatchMonitor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _with_bad_tokens(B, T, dtype=torch.float32, seed=0):
    rollout, train, mask = make_batch(B, T, dtype=dtype, seed=seed)
    mask[0] = False  # a fully masked row
    rollout[1, 0] = float("nan")
    train[1, 1] = float("inf")
    rollout[1, 2] = -9999.0
    mask[1, :3] = True
    return rollout, train, mask


def _monitor(path: str) -> MismatchMonitor:
    """'kernel': the CUDA default; 'compiled': torch.compile (the path without Triton); 'eager'."""
    mon = MismatchMonitor(compile=path != "eager")
    mon._kernel_failed = path != "kernel"  # the monitor's own switch to the torch pass
    return mon


def _same_metrics(got: dict, want: dict, rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=rtol, abs=1e-9, nan_ok=True), (key, got[key], want[key])


@pytest.mark.parametrize("path", ["kernel", "compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 17), (7, 129), (33, 1001), (70, 2050), (2, 40000)])
def test_cuda_matches_reference(path, dtype, shape):
    rollout, train, mask = _with_bad_tokens(*shape, dtype=dtype)
    w = torch.rand(shape) * 2
    w[w < 0.3] = 0.0
    mon = _monitor(path).update(rollout.cuda(), train.cuda(), mask.cuda(), is_weights=w.cuda())
    got = mon.compute()
    assert not mon._compile_failed and (path != "kernel" or not mon._kernel_failed)
    assert got["tim/invalid_tokens"] == 3
    assert_matches(got, reference(rollout, train, mask, w), rtol=1e-5)


@pytest.mark.parametrize("path", ["kernel", "compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_k3_and_chi2_per_token_to_float32_rounding(path, dtype):
    """|d| from 1e-7 to 3, both signs: k3 (the series below |d| = 1) and chi2 per token against float64, with
    the GPU's own exp, log and expm1."""
    assert_k3_and_chi2_per_token(lambda: _monitor(path), *small_d_tokens(dtype), device="cuda")


@pytest.mark.parametrize("path", ["kernel", "compiled", "eager"])
def test_cuda_prob_abs_diff_of_extreme_valid_tokens(path):
    """|p_train − p_rollout| where e^r underflows while ρ − 1 overflows: |e^t − e^r|, not 0 · inf."""
    assert_prob_abs_diff_per_token(lambda: _monitor(path), device="cuda")


@pytest.mark.parametrize("path", ["kernel", "compiled", "eager"])
def test_cuda_k3_and_chi2_when_the_ratios_cancel_across_tokens(path):
    assert_k3_and_chi2_of_cancelling_batches(lambda: _monitor(path), device="cuda")


@pytest.mark.parametrize("path", ["kernel", "compiled"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_cuda_state_equals_the_cpu_pass(path, mask_dtype):
    """Two updates with weights: the CUDA state equals the CPU torch pass's, field by field (counts, histogram,
    maxima exact up to a token at a bin edge; sums to float rounding)."""
    cpu = MismatchMonitor(compile=False)
    gpu = _monitor(path)
    for seed in range(2):
        r, t, m = _with_bad_tokens(16, 257, seed=seed)
        m = m.to(mask_dtype)
        w = torch.rand(16, 257) * 2
        w[w < 0.3] = 0.0
        cpu.update(r, t, m, is_weights=w)
        gpu.update(r.cuda(), t.cuda(), m.cuda(), is_weights=w.cuda())
    assert not gpu._kernel_failed or path != "kernel"
    assert_same_state(gpu._state.cpu(), cpu._state)
    _same_metrics(gpu.compute(), cpu.compute())


def test_cuda_inputs_as_users_pass_them():
    """A strided view, no mask, a Parameter with requires_grad, one sequence, a misaligned start, an empty batch,
    and a state restored from a checkpoint (CPU), all into one monitor: equal to the CPU."""
    r, t, m = make_batch(6, 1000, seed=5)
    flat = torch.empty(6 * 1000 + 1, device="cuda")
    misaligned = flat[1:].view(6, 1000)
    misaligned.copy_(t.cuda())
    cases = [
        ((r.cuda(), t.cuda().t().contiguous().t(), m.cuda()), (r, t, m)),
        ((r.cuda(), t.cuda(), None), (r, t, None)),
        ((torch.nn.Parameter(r.cuda().clone()), t.cuda(), m.cuda()), (r, t, m)),
        ((r[2].cuda(), t[2].cuda(), m[2].cuda()), (r[2], t[2], m[2])),
        ((r.cuda(), misaligned, m.cuda()), (r, t, m)),
        ((r[:0].cuda(), t[:0].cuda(), m[:0].cuda()), (r[:0], t[:0], m[:0])),
    ]
    mon, want = MismatchMonitor(), MismatchMonitor(compile=False)
    for gpu_args, cpu_args in cases:
        mon.update(*gpu_args)
        want.update(*cpu_args)
    restored = MismatchMonitor()
    restored.load_state_dict(mon.state_dict())
    restored.update(r.cuda(), t.cuda(), m.cuda())
    want.update(r, t, m)
    assert not mon._kernel_failed and not restored._kernel_failed
    _same_metrics(restored.compute(), want.compute())


def test_cuda_update_does_not_sync_with_the_host():
    rollout, train, mask = (x.cuda() for x in make_batch(8, 64))
    mon = MismatchMonitor()
    mon.update(rollout, train, mask)  # compile outside the checked region
    mon.reset()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mon.update(rollout, train, mask)
        mon.update(rollout, train, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not mon._kernel_failed
    assert math.isfinite(mon.compute()["tim/token/kl_k3"])


def test_kernel_counts_are_exact_and_repeatable():
    """1024 rows racing their atomics into one state: counts, histogram and maxima are the same in every run;
    only the order of float64 additions may change the sums' last bits."""
    g = torch.Generator().manual_seed(5)
    B, T = 1024, 8192
    rollout = -torch.rand(B, T, generator=g) * 6
    train = rollout + 0.05 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    w = torch.rand(B, T, generator=g)
    args = (rollout.cuda(), train.cuda(), mask.cuda())
    states = [MismatchMonitor().update(*args, is_weights=w.cuda())._state.cpu() for _ in range(5)]
    for state in states[1:]:
        assert_same_state(state, states[0], rtol=1e-12)
    cpu = MismatchMonitor(compile=False).update(rollout, train, mask, is_weights=w)
    hist = slice(OFFSETS["hist"], OFFSETS["hist"] + N_SIGNED_BINS)
    # The GPU's log and torch's log10 on the CPU round differently for the few of the 6.7M tokens that lie on a
    # bin edge: such a token moves to the neighbouring bin (each move counts twice here).
    assert states[0][hist].sum() == cpu._state[hist].sum()
    assert (states[0][hist] - cpu._state[hist]).abs().sum() <= 2e-5 * cpu._state[hist].sum()


def test_cell_counts_histc_equals_bincount_beyond_float32_exact_range():
    n_cells = N_BUCKETS * 701 + 1
    g = torch.Generator().manual_seed(0)
    n = 2**24 + 4099  # more than float32 counts exactly in one histc call
    cell = torch.randint(0, n_cells + 1, (n,), generator=g)  # n_cells itself is the dropped cell
    cell[: 2**23] = 7  # one very busy cell
    want = torch.bincount(cell, minlength=n_cells + 1)[:n_cells].double()
    assert torch.equal(cell_counts(cell.cuda(), n_cells).cpu(), want)  # the CPU path: tests/test_metrics.py


def test_compile_setting_and_environment_choose_the_path(monkeypatch):
    r, t, m = (x.cuda() for x in make_batch(4, 300))
    assert MismatchMonitor()._path(r.device) == "kernel"
    assert MismatchMonitor(compile=False)._path(r.device) == "eager"
    monkeypatch.setenv("TIM_PLUGINS_COMPILE", "0")
    assert MismatchMonitor()._path(r.device) == "eager"
    assert MismatchMonitor(compile=True)._path(r.device) == "kernel"
    want = MismatchMonitor(compile=False).update(r.cpu(), t.cpu(), m.cpu()).compute()
    _same_metrics(MismatchMonitor().update(r, t, m).compute(), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernel_runs_on_the_inputs_device():
    r, t, m = make_batch(5, 700, seed=3)
    with torch.cuda.device(0):
        mon = MismatchMonitor().update(r.to("cuda:1"), t.to("cuda:1"), m.to("cuda:1"))
    assert mon._state.device == torch.device("cuda:1") and not mon._kernel_failed
    _same_metrics(mon.compute(), MismatchMonitor(compile=False).update(r, t, m).compute())
