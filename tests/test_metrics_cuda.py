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


_TRITON_PATHS = ("triton", "triton-options")


def _use_options(monkeypatch) -> None:
    import tim_plugins._mismatch_launch as launch

    # The settings the default does not use: the block histogram with few copies, metrics derived on the host.
    for name, value in launch.ALTERNATE_OPTIONS.items():
        monkeypatch.setitem(launch.TUNING, name, value)


@pytest.fixture(params=["default", "options", "device"])
def kernel_variant(request, monkeypatch) -> str:
    """The Triton kernel as configured by default, with the alternate TUNING options, and with compute()
    synchronising the device instead of polling the launch id."""
    if request.param == "options":
        _use_options(monkeypatch)
    elif request.param == "device":
        import tim_plugins._mismatch_launch as launch

        monkeypatch.setitem(launch.TUNING, "WAIT", "device")
    return request.param


def _monitor(path: str, monkeypatch) -> MismatchMonitor:
    """'triton': the CUDA default; 'triton-options': with the alternate TUNING options; 'compiled':
    torch.compile (the fallback without Triton); 'eager'."""
    if path == "triton-options":
        _use_options(monkeypatch)
    mon = MismatchMonitor(compile=path != "eager")
    mon._triton_failed = path not in _TRITON_PATHS
    return mon


@pytest.mark.parametrize("path", ["triton", "triton-options", "compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 17), (7, 129), (33, 1001), (70, 2050)])
def test_cuda_matches_reference(path, dtype, shape, monkeypatch):
    rollout, train, mask = _with_bad_tokens(*shape, dtype=dtype)
    mon = _monitor(path, monkeypatch).update(rollout.cuda(), train.cuda(), mask.cuda())
    assert (mon._device_metrics is not None) == (path == "triton")  # the default derives them on the device
    got = mon.compute()
    assert not mon._triton_failed or path not in _TRITON_PATHS
    assert not mon._compile_failed
    assert got["tim/invalid_tokens"] == 3
    assert_matches(got, reference(rollout, train, mask), rtol=1e-5)


@pytest.mark.parametrize("path", ["triton", "triton-options", "compiled"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_cuda_equals_cpu_including_histograms(path, mask_dtype, monkeypatch):
    rollout, train, mask = _with_bad_tokens(16, 257)
    mask = mask.to(mask_dtype)
    w = torch.rand(16, 257) * 2
    w[w < 0.3] = 0.0
    cpu = MismatchMonitor(compile=False)
    gpu = _monitor(path, monkeypatch)
    for seed in range(2):  # two updates: the state accumulates, the kernel's scratch is reset between
        r, t = (rollout, train) if seed == 0 else make_batch(16, 257, seed=1)[:2]
        cpu.update(r, t, mask, is_weights=w)
        gpu.update(r.cuda(), t.cuda(), mask.cuda(), is_weights=w.cuda())
    assert not gpu._triton_failed or path not in _TRITON_PATHS
    a, b = cpu.compute(), gpu.compute()
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9, nan_ok=True), key
    # Histogram counts are integers: histc on CUDA and bincount on the CPU give them exactly.
    for name, (counts, _) in cpu.histograms().items():
        assert (gpu.histograms()[name][0] == counts).all(), name


def test_cell_counts_histc_equals_bincount_beyond_float32_exact_range():
    n_cells = N_BUCKETS * 701 + 1
    g = torch.Generator().manual_seed(0)
    n = 2**24 + 4099  # more than float32 counts exactly in one histc call
    cell = torch.randint(0, n_cells + 1, (n,), generator=g)  # n_cells itself is the dropped cell
    cell[: 2**23] = 7  # one very busy cell
    want = torch.bincount(cell, minlength=n_cells + 1)[:n_cells].double()
    assert torch.equal(cell_counts(cell.cuda(), n_cells).cpu(), want)  # the CPU path: tests/test_metrics.py


def test_cuda_update_does_not_sync_with_the_host(kernel_variant):
    rollout, train, mask = (x.cuda() for x in make_batch(8, 64))
    mon = MismatchMonitor()  # the Triton path
    mon.update(rollout, train, mask)  # compile outside the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        mon.update(rollout, train, mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(mon.compute()["tim/token/kl_k3"])


def _same_metrics(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """Two monitors' compute() dicts: same keys, values within rtol, NaN where the other has NaN."""
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=rtol, abs=1e-9, nan_ok=True), (key, got[key], want[key])


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """The same values, contiguous, at an address 4 bytes off a 16-byte boundary."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    out = flat[1:].view(x.shape)
    out.copy_(x)
    return out


def test_triton_launches_with_every_specialisation(kernel_variant):
    """The fast launcher reuses a compiled kernel only for the same dtypes, pointer alignment and integer
    properties: a sequence that changes each of them, in one monitor and in fresh ones, equals the CPU."""
    batches = []
    for i, (B, T) in enumerate([(4, 4096), (4, 4097), (1, 1), (1, 33), (5, 1), (17, 8192), (3, 4096)]):
        r, t, m = _with_bad_tokens(B, T) if B > 1 and T > 3 else make_batch(B, T, seed=i)
        batches.append((r, t, m))
    r, t, m = make_batch(6, 1000, seed=9)
    batches.append((r.bfloat16(), t, m.long()))
    cpu_all = MismatchMonitor(compile=False)
    gpu_all = MismatchMonitor()
    for i, (r, t, m) in enumerate(batches):
        rc, tc, mc = r.cuda(), t.cuda(), m.cuda()
        if i % 2:
            rc, tc = _misaligned(rc), _misaligned(tc)
            assert rc.data_ptr() % 16 and rc.is_contiguous()
        gpu_all.update(rc, tc, mc)
        cpu_all.update(r, t, m)
        one = MismatchMonitor().update(rc, tc, mc)
        assert not one._triton_failed
        want = MismatchMonitor(compile=False).update(r, t, m).compute()
        _same_metrics(one.compute(), want)
    assert not gpu_all._triton_failed
    _same_metrics(gpu_all.compute(), cpu_all.compute())
    launcher = gpu_all._kernel_scratch["launcher"]
    assert len(launcher.compiled) >= 4  # distinct specialisations were compiled and kept

    class _NoJit:
        def __getitem__(self, grid):
            raise AssertionError("the JIT path ran: the fast path did not take a known key")

    launcher.kernel = _NoJit()  # a repeated key must go through the kept compiled kernel only
    rc, tc, mc = (x.cuda() for x in batches[0])
    gpu_all.reset()
    gpu_all.update(rc, tc, mc)
    assert not gpu_all._triton_failed
    _same_metrics(gpu_all.compute(), MismatchMonitor(compile=False).update(*batches[0]).compute())


def test_repeated_batch_shapes_launch_from_the_plan_with_their_own_tensors(kernel_variant):
    """Training repeats a few batch shapes: from a key's third call on, the launch comes from its kept plan.
    Every call must still read its own tensors, fresh after a reset and accumulating without one."""
    mon = MismatchMonitor()
    for seed in range(4):
        r, t, m = _with_bad_tokens(8, 1000) if seed == 2 else make_batch(8, 1000, seed=seed)
        mon.reset()
        got = mon.update(r.cuda(), t.cuda(), m.cuda()).compute()
        _same_metrics(got, MismatchMonitor(compile=False).update(r, t, m).compute())
    want = MismatchMonitor(compile=False).update(r, t, m)  # the state after the last reset
    for seed in range(10, 14):
        r, t, m = make_batch(8, 1000, seed=seed)
        mon.update(r.cuda(), t.cuda(), m.cuda())
        want.update(r, t, m)
        _same_metrics(mon.compute(), want.compute())
    assert not mon._triton_failed
    if mon._kernel_scratch["launcher"].enabled:  # a Triton whose launcher convention was read
        assert [len(keys) for keys in mon._kernel_scratch["plans"].values()] == [2]  # fresh and accumulating


def test_planned_launches_and_the_checked_path_share_one_monitor(kernel_variant):
    """update() launches inputs like an earlier launch's from its plan, as passed (requires_grad included),
    and sends the others through the input checks: a strided view, no mask, a Parameter, weights, one
    sequence. Mixed in one monitor, every step equals the CPU."""
    r, t, m = make_batch(6, 1000, seed=5)
    w = torch.rand(6, 1000)
    cases = [  # (CUDA inputs, the same on the CPU): rollout, train, mask, is_weights
        lambda rc, tc, mc, wc: ((rc, tc, mc, None), (r, t, m, None)),
        lambda rc, tc, mc, wc: ((rc, tc.clone().requires_grad_(), mc, None), (r, t, m, None)),
        lambda rc, tc, mc, wc: ((rc, tc.t().contiguous().t(), mc, None), (r, t, m, None)),
        lambda rc, tc, mc, wc: ((rc, tc, None, None), (r, t, None, None)),
        lambda rc, tc, mc, wc: ((torch.nn.Parameter(rc.clone(), requires_grad=False), tc, mc, None), (r, t, m, None)),
        lambda rc, tc, mc, wc: ((rc, tc, mc, wc), (r, t, m, w)),
        lambda rc, tc, mc, wc: ((rc[2], tc[2], mc[2], None), (r[2], t[2], m[2], None)),
    ]
    mon = MismatchMonitor()
    for step in range(3):  # the first step makes the plans, later ones launch from them
        mon.reset()
        want = MismatchMonitor(compile=False)
        for case in cases:
            (rc, tc, mc, wc), (rr, tt, mm, ww) = case(r.cuda(), t.cuda(), m.cuda(), w.cuda())
            mon.update(rc, tc, mc, is_weights=wc)
            want.update(rr, tt, mm, is_weights=ww)
        _same_metrics(mon.compute(), want.compute())
    assert not mon._triton_failed and mon.updates == len(cases)
    if mon._kernel_scratch["launcher"].enabled:
        assert mon._planned is not None and mon._kernel_scratch["plans"]


def test_triton_reset_overwrites_the_reused_buffer(kernel_variant):
    mon = MismatchMonitor()
    r, t, m = (x.cuda() for x in _with_bad_tokens(9, 300))
    mon.update(r, t, m).update(r, t, m)
    mon.compute()
    mon.reset()
    r2, t2, m2 = make_batch(5, 77, seed=3)
    mon.update(torch.zeros(0, 7).cuda(), torch.zeros(0, 7).cuda())  # an empty first batch
    mon.update(r2.cuda(), t2.cuda(), m2.cuda())
    assert not mon._triton_failed
    _same_metrics(mon.compute(), MismatchMonitor(compile=False).update(r2, t2, m2).compute())
    mon.reset()
    mon.update(r2.cuda(), t2.cuda(), m2.cuda())
    _same_metrics(mon.compute(), MismatchMonitor(compile=False).update(r2, t2, m2).compute())


def test_triton_last_program_reduction_is_exact_and_repeatable(kernel_variant):
    """Thousands of programs race for the ticket; the last one folds everyone's totals. A stale read would
    change the result between runs; only the order of float64 atomic additions may (last bits)."""
    g = torch.Generator().manual_seed(5)
    B, T = 1024, 8192
    rollout = -torch.rand(B, T, generator=g) * 6
    train = rollout + 0.05 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    w = torch.rand(B, T, generator=g)
    want = MismatchMonitor(compile=False).update(rollout, train, mask, is_weights=w)
    args = (rollout.cuda(), train.cuda(), mask.cuda())
    results, hists = [], []
    for _ in range(5):
        mon = MismatchMonitor().update(*args, is_weights=w.cuda())
        results.append(mon.compute())
        assert not mon._triton_failed
        hists.append(mon.histograms()["abs_diff"][0])
        assert hists[-1].sum() == results[-1]["tim/tokens"]  # no histogram atomic lost or read early
    for other in hists[1:]:
        assert (other == hists[0]).all()
    # Against the CPU: libdevice's and torch's log10 differ in the last bit for a few of the 6.7M tokens
    # that lie on a bin edge: such a token moves to the neighbouring bin (each move counts twice here).
    cpu_hist = want.histograms()["abs_diff"][0]
    assert cpu_hist.sum() == hists[0].sum()
    assert abs(hists[0] - cpu_hist).sum() <= 2e-5 * cpu_hist.sum()
    for other in results[1:]:
        _same_metrics(other, results[0], rtol=1e-12)
        assert other["tim/tokens"] == results[0]["tim/tokens"]  # counts and maxima: exact
        assert other["tim/token/abs_diff_max"] == results[0]["tim/token/abs_diff_max"]
    _same_metrics(results[0], want.compute())


def test_device_metric_vector_equals_the_host_derivation():
    """With DEVICE_METRICS, compute() reads the kernel's metric vector: it must equal the metrics compute()
    derives on the host from the same state (last bits may differ where the GPU fuses a multiply-add), over
    accumulated updates, IS weights on and off, an all-masked batch and a reset. The default writes the
    vector into pinned host memory."""
    mon = MismatchMonitor()
    r, t, m = (x.cuda() for x in _with_bad_tokens(40, 3000))
    w = torch.rand(40, 3000, device="cuda")
    steps = [(r, t, m, None), (r, t, m, w), (r, t, torch.zeros_like(m), None), "reset", (r[:0], t[:0], m[:0], None),
             (r, t, torch.zeros_like(m), None), (r[:3], t[:3], m[:3], w[:3])]
    for step in steps:
        if step == "reset":
            mon.reset()
            continue
        mon.update(*step[:3], is_weights=step[3])
        assert not mon._triton_failed
        if step[0].shape[0]:  # a launch: the vector describes the state (an empty first batch launches none)
            assert mon._device_metrics is not None and mon._device_metrics.is_pinned()
        got = mon.compute()
        kept, mon._device_metrics = mon._device_metrics, None
        want = mon.compute()  # the same state, derived on the host
        mon._device_metrics = kept
        _same_metrics(got, want, rtol=1e-12)


@pytest.mark.parametrize("wait", ["device", "flag"])
def test_pinned_metric_vector_is_read_after_a_launch_on_another_stream(wait, monkeypatch):
    """compute() reads the vector the kernel writes into host memory: it must wait for the launch even when
    that ran on a stream other than the current one, held back here behind a ~25 ms sleep (longer than the
    flag is polled: then compute() synchronises the device)."""
    import tim_plugins._mismatch_launch as launch

    monkeypatch.setitem(launch.TUNING, "WAIT", wait)
    r, t, m = (x.cuda() for x in _with_bad_tokens(64, 4096))
    want = MismatchMonitor(compile=False).update(r, t, m).compute()
    mon = MismatchMonitor()
    mon.update(r[:2], t[:2], m[:2])  # compiles; its vector describes another batch
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        mon.reset()
        mon.update(r, t, m)
    assert mon._device_metrics.is_pinned()
    _same_metrics(mon.compute(), want)


@pytest.mark.parametrize("wait", ["device", "flag"])
def test_every_compute_reads_the_vector_of_its_own_launch(wait, monkeypatch):
    """compute() straight after update(), 100 times, each batch with its own mask: a wait that returned
    before the launch had written its whole vector would show the previous batch's values in some slot."""
    import tim_plugins._mismatch_launch as launch

    monkeypatch.setitem(launch.TUNING, "WAIT", wait)
    g = torch.Generator().manual_seed(0)
    r = -torch.rand(64, 2048, generator=g) * 4.0
    t = r + 0.05 * torch.randn(64, 2048, generator=g)
    masks = [torch.rand(64, 2048, generator=g) < (i % 25 + 1) / 26 for i in range(100)]
    wants = [MismatchMonitor(compile=False).update(r, t, m).compute() for m in masks]
    rc, tc, mcs = r.cuda(), t.cuda(), [m.cuda() for m in masks]
    mon = MismatchMonitor()
    torch.cuda.synchronize()
    for mc, want in zip(mcs, wants):
        mon.reset()
        _same_metrics(mon.update(rc, tc, mc).compute(), want)
    assert not mon._triton_failed and mon._device_metrics.is_pinned()
    assert (mon._kernel_scratch["wait"] is not None) == (wait == "flag")


def test_the_compile_environment_variable_is_read_at_the_first_cuda_update(monkeypatch):
    """TIM_PLUGINS_COMPILE=0 turns the kernel off for monitors whose first CUDA update() comes after it is
    set; a monitor keeps the path it chose (the lookup is not repeated per micro-batch), until its
    ``compile`` setting changes."""
    r, t, m = (x.cuda() for x in make_batch(4, 300))
    kernel = MismatchMonitor().update(r, t, m)
    monkeypatch.setenv("TIM_PLUGINS_COMPILE", "0")
    eager = MismatchMonitor().update(r, t, m)
    assert kernel.update(r, t, m)._device_metrics is not None  # still the kernel
    assert eager._device_metrics is None and eager._triton_choice == ("auto", False)
    eager.compile = True
    assert eager.update(r, t, m)._device_metrics is not None
