"""The host side of the CUDA path (``_mismatch_launch``): launch plans, the direct launch, and the monitor's
launch from a plan, checked without a GPU. Launches are recorded instead of run: the JIT path keeps a
stand-in compiled kernel, the direct launch records its arguments."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def _launch_inputs(B: int = 3, T: int = 700):
    import math

    import torch

    from tim_plugins.metrics import MismatchMonitor

    lay = MismatchMonitor()._layout
    state = torch.zeros(lay.n_sums + 7, dtype=torch.float64)
    rollout, train = -torch.rand(B, T), -torch.rand(B, T)
    return (state, lay.n_sums, rollout, train, torch.ones(B, T, dtype=torch.bool), torch.rand(B, T),
            math.log(0.5), math.log(2.0), False, lay.n_signed_bins, lay.hist_offset, lay.bucket_count_offset)


def _recorded_launches(monkeypatch):
    """Launches recorded instead of run, without a GPU: the JIT path keeps a stand-in compiled kernel, the
    direct launch appends (grid, args); returns (jitted keys, launched)."""
    import tim_plugins._mismatch_launch as launch

    jitted, launched = [], []
    monkeypatch.setattr(launch, "_INTERPRET", False)
    monkeypatch.setattr(launch, "_launch_hooks_set", lambda: False)
    monkeypatch.setattr(launch, "_current_device", lambda: -1)  # CPU tensors: Tensor.get_device() is -1

    def jit(self, key, grid, args, num_warps):
        jitted.append(key)
        self.compiled[key] = "compiled"

    monkeypatch.setattr(launch._FastLauncher, "jit", jit)
    monkeypatch.setattr(launch._FastLauncher, "launch",
                        lambda self, compiled, index, grid, args: launched.append((grid, args)))
    return jitted, launched


def _expected_launch(inputs, scratch, launch_id):
    import torch

    import tim_plugins._mismatch_launch as launch

    state, max_offset, rollout, train, mask, w, *rest = inputs
    mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask  # as the launch passes it
    grid, want = launch.kernel_arguments(state, max_offset, rollout, train, mask, w, *rest, scratch, launch_id)
    return grid, tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in want)


def _launch_ids(launched) -> list[int]:
    import tim_plugins._mismatch_launch as launch

    slot = [p.name for p in launch._mismatch_kernel.params].index("launch_id")
    return [args[slot] for _, args in launched]


def test_direct_launch_passes_the_jit_arguments_as_addresses(monkeypatch):
    """The direct launch hands the compiled launcher integer addresses: the same arguments, in the same
    order, as the tensors the JIT path gets, both when it builds a key's launch plan and when it launches
    from the plan (checked without a GPU, with the launch recorded)."""
    import tim_plugins._mismatch_launch as launch

    jitted, launched = _recorded_launches(monkeypatch)
    inputs = _launch_inputs()
    scratch: dict = {}
    launch.triton_update(*inputs, scratch)  # first call: the JIT path, which keeps the "compiled" kernel
    assert launched == [] and len(jitted) == 1
    launch.triton_update(*inputs, scratch)  # same key: the direct launch, which keeps a plan
    launch.triton_update(*inputs, scratch)  # launched from the plan
    assert len(jitted) == 1 and len(launched) == 2 and sum(map(len, scratch["plans"].values())) == 1
    assert _launch_ids(launched) == [2, 3] and scratch["launch_id"] == 3  # every launch has its own id
    for (grid, args), launch_id in zip(launched, (2, 3)):
        want_grid, want = _expected_launch(inputs, scratch, launch_id)
        assert len(want) == len(launch._mismatch_kernel.params)
        assert grid == want_grid and args == want


def test_launch_plans_follow_new_inputs_grown_buffers_and_hooks(monkeypatch):
    """A plan is reused for other tensors of the same key (their own addresses), is dropped when the scratch
    buffers grow (it held the old ones' addresses), and steps aside while a launch hook is set."""
    import tim_plugins._mismatch_launch as launch

    jitted, launched = _recorded_launches(monkeypatch)
    scratch: dict = {}
    small, other = _launch_inputs(B=3), _launch_inputs(B=3)
    for _ in range(3):
        launch.triton_update(*small, scratch)
    launch.triton_update(*other, scratch)  # same key, new tensors
    assert launched[-1] == _expected_launch(other, scratch, 4)
    big = _launch_inputs(B=2000, T=20)  # more rows than the scratch holds: its row buffers are replaced
    launch.triton_update(*big, scratch)
    assert "plans" not in scratch
    launched.clear()
    launch.triton_update(*small, scratch)
    assert launched == [_expected_launch(small, scratch, 6)]  # the new buffers' addresses
    monkeypatch.setattr(launch, "_launch_hooks_set", lambda: True)  # a profiler attached
    n_jit = len(jitted)
    launch.triton_update(*small, scratch)
    assert len(jitted) == n_jit + 1 and len(launched) == 1  # through the JIT, where the hook sees it


@pytest.mark.parametrize(
    "version, supported",
    [("3.5.1", False), ("3.6.0", True), ("3.7.1", True), ("3.9.0+git1a2b3c", True), ("3.10.0", False),
     ("4.0.0", False), ("2.3.1", False), ("dev", False)],
)
def test_fast_launch_is_pinned_to_the_triton_versions_read(version, supported):
    from tim_plugins._mismatch_launch import fast_launch_supported

    assert fast_launch_supported(version) is supported


def test_an_unread_triton_version_launches_through_the_jit_every_time(monkeypatch):
    import triton

    import tim_plugins._mismatch_launch as launch

    inputs = _launch_inputs()
    scratch: dict = {}
    jitted, launched = [], []
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    monkeypatch.setattr(launch, "_INTERPRET", False)
    monkeypatch.setattr(launch, "_launch_hooks_set", lambda: False)
    monkeypatch.setattr(launch, "_current_device", lambda: -1)

    class RecordingKernel:  # Triton's JIT as the launcher sees it: kernel[grid](*args) returns the compiled kernel
        def __getitem__(self, grid):
            return lambda *args, num_warps: jitted.append(grid) or "compiled"

    monkeypatch.setattr(launch, "_mismatch_kernel", RecordingKernel())
    monkeypatch.setattr(launch._FastLauncher, "launch", lambda self, *args: launched.append(args))
    for _ in range(3):
        launch.triton_update(*inputs, scratch)
    assert launched == [] and len(jitted) == 3 and scratch["launcher"].compiled == {}


def test_kernel_settings_are_checked_with_the_fix(monkeypatch):
    import tim_plugins._mismatch_launch as launch
    from tim_plugins._mismatch_triton import DEVICE_METRIC_SLOTS
    from tim_plugins.metrics import MismatchMonitor

    keys, is_keys = MismatchMonitor()._metric_keys()
    assert len(keys) + len(is_keys) + 1 == DEVICE_METRIC_SLOTS  # the device vector: values, IS values, IS count
    monkeypatch.setitem(launch.TUNING, "HISTOGRAM", "shared")
    with pytest.raises(ValueError, match=r"TUNING\['HISTOGRAM'\]='shared'.*one of \('global', 'block'\)"):
        launch.kernel_arguments(*_launch_inputs(), {})
    monkeypatch.setitem(launch.TUNING, "HISTOGRAM", "block")
    monkeypatch.setitem(launch.TUNING, "REPLICAS", 0)
    with pytest.raises(ValueError, match=r"TUNING\['REPLICAS'\]=0 must be a positive int"):
        launch.kernel_arguments(*_launch_inputs(), {})
    monkeypatch.setitem(launch.TUNING, "REPLICAS", 4)
    monkeypatch.setitem(launch.TUNING, "WAIT", "spin")
    with pytest.raises(ValueError, match=r"TUNING\['WAIT'\]='spin' is not a way to wait.*\('device', 'flag'\)"):
        launch.kernel_arguments(*_launch_inputs(), {})


# ---------------------------------------------------------------------------------- the monitor's planned launch
def _cuda_path_monitor(monkeypatch):
    """A monitor on its CUDA path (launches recorded, see ``_recorded_launches``), and a count of the calls of
    its input checks: update() skips them only when it launches from a plan."""
    import tim_plugins.metrics as metrics

    jitted, launched = _recorded_launches(monkeypatch)
    checked = []
    real_check = metrics.check_inputs

    def counting_check(*args):
        checked.append(1)
        return real_check(*args)

    monkeypatch.setattr(metrics, "check_inputs", counting_check)
    mon = metrics.MismatchMonitor()
    monkeypatch.setattr(mon, "_use_triton", lambda rollout: True)
    return mon, jitted, launched, checked


def _monitor_launch(mon, rollout, train, mask, w, fresh, launch_id):
    """The launch the full path makes for these inputs (contiguous, as check_inputs passes them on)."""
    import torch

    lay = mon._layout
    mask = torch.ones(rollout.shape, dtype=torch.bool) if mask is None else mask
    inputs = (mon._state, lay.n_sums, rollout, train.contiguous(), mask.contiguous(), w, *mon._log_band, fresh,
              lay.n_signed_bins, lay.hist_offset, lay.bucket_count_offset)
    return _expected_launch(inputs, mon._kernel_scratch, launch_id)


def _warm(mon, batches):
    """Two steps (update each batch, then reset): the first compiles each key, the second keeps its plan."""
    for _ in range(2):
        for r, t, m in batches:
            mon.update(r, t, m)
        mon.reset()


def test_monitor_launches_inputs_like_an_earlier_launch_straight_from_its_plan(monkeypatch):
    """Once a key has a plan, update() launches from it without the input checks, with the same arguments as
    the full path; after reset() the launch overwrites the previous state buffer ("fresh")."""
    import contextlib

    import torch
    from test_metrics import make_batch

    import tim_plugins._mismatch_launch as launch

    mon, jitted, launched, checked = _cuda_path_monitor(monkeypatch)
    first, second = make_batch(3, 700, seed=1), make_batch(3, 700, seed=2)
    _warm(mon, [first, second])
    assert len(jitted) == 2 and mon._kernel_scratch["plans"].keys() == {first[0].shape}
    assert len(mon._kernel_scratch["plans"][first[0].shape]) == 2  # fresh and accumulating keys
    assert checked == [1] * 4 and len(launched) == 2
    spare = mon._spare_state
    launched.clear()
    for seed, (batch, fresh) in enumerate([(first, True), (second, False), (first, False)]):
        mon.update(*batch)
        assert mon._state is spare and mon._spare_state is None and mon.updates == seed + 1
        assert launched[-1] == _monitor_launch(mon, *batch, None, fresh, mon._kernel_scratch["launch_id"])
    assert len(checked) == 4 and len(launched) == 3 and len(jitted) == 2  # no check, no JIT
    # A batch shape without plans is a miss before anything else about the inputs is read.
    assert launch.launch_planned(mon._kernel_scratch, spare, False, torch.zeros(3, 701), None, None, None,
                                 mon._log_band) is False
    # Inputs on a device that is not the current one: launched in their device's context.
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(launch, "_current_device", lambda: 7)
    monkeypatch.setattr(torch.cuda, "device", device)
    mon.update(*second)
    assert entered == [-1] and len(checked) == 4
    assert launched[-1] == _monitor_launch(mon, *second, None, False, mon._kernel_scratch["launch_id"])


@pytest.mark.parametrize("case", ["short mask", "integer train", "not contiguous", "subclass", "train subclass",
                                  "no mask", "float mask", "misaligned", "one sequence", "weights", "other band"])
def test_inputs_no_plan_covers_take_the_checked_path(monkeypatch, case):
    """Inputs whose key has no plan yet go through the input checks, which raise or convert as always; the
    full path then launches them (with a new plan where they qualify)."""
    import torch
    from test_metrics import make_batch

    mon, jitted, launched, checked = _cuda_path_monitor(monkeypatch)
    r, t, m = make_batch(3, 700, seed=3)
    _warm(mon, [(r, t, m)])
    n_checked, n_launched = len(checked), len(launched)
    w = None
    if case == "short mask":
        with pytest.raises(ValueError, match=r"mask \(3, 699\) must have the log-probs' shape \(3, 700\)"):
            mon.update(r, t, m[:, :699].contiguous())
        assert len(checked) == n_checked + 1 and len(launched) == n_launched
        return
    if case == "integer train":
        with pytest.raises(TypeError, match="log-probs must be floating point"):
            mon.update(r, (t * 100).long(), m)
        assert len(checked) == n_checked + 1 and len(launched) == n_launched
        return
    if case == "not contiguous":
        t = t.t().contiguous().t()
    elif case == "subclass":
        r = torch.nn.Parameter(r, requires_grad=False)
    elif case == "train subclass":
        t = torch.nn.Parameter(t, requires_grad=False)
    elif case == "no mask":
        m = None
    elif case == "float mask":
        m = m.float()
    elif case == "misaligned":  # contiguous, 4 bytes past a 16-byte boundary
        r = torch.cat([torch.zeros(1), r.flatten()])[1:].view(3, 700)
    elif case == "weights":
        w = torch.rand(3, 700)
    elif case == "other band":
        mon.ratio_band = (0.8, 1.25)
    n_jitted = len(jitted)
    if case == "one sequence":  # [T] → [1, T]: a shape of its own, compiled
        mon.update(r[0], t[0], m[0])
        assert len(checked) == n_checked + 1 and len(jitted) == n_jitted + 1 and len(launched) == n_launched
        return
    mon.update(r, t, m, is_weights=w)
    assert len(checked) == n_checked + 1
    if len(jitted) == n_jitted:  # a key whose kernel is compiled: launched directly, with the full path's arguments
        assert len(launched) == n_launched + 1
        (grid, got), (want_grid, want) = launched[-1], _monitor_launch(mon, r, t, m, w, True,
                                                                       mon._kernel_scratch["launch_id"])
        # The all-ones mask check_inputs made, and the contiguous copy of train, have addresses of their own.
        own = {"no mask": 2, "not contiguous": 1}.get(case)
        if own is not None:
            assert own == 2 or got[own] != t.data_ptr()  # a copy, not the strided original
            got, want = got[:own] + got[own + 1:], want[:own] + want[own + 1:]
        assert grid == want_grid and got == want
    else:
        assert case in ("misaligned", "weights", "float mask")  # a kernel specialised on another alignment or dtype
    if case == "misaligned":
        assert jitted[-1][6] == (False, True, True, False, True)  # rollout (also the weights' stand-in) unaligned


def test_a_changed_setting_or_a_failed_launch_leaves_the_planned_path(monkeypatch):
    """compile=False stops the kernel at once; a launch from a plan that raises is warned about, and the batch
    is counted by the torch pass instead (never twice, never lost)."""
    import math

    import tim_plugins._mismatch_launch as launch
    from test_metrics import make_batch
    from tim_plugins.metrics import MismatchMonitor

    mon, jitted, launched, checked = _cuda_path_monitor(monkeypatch)
    batch = make_batch(3, 700, seed=4)
    want = MismatchMonitor(compile=False).update(*batch).compute()
    _warm(mon, [batch])
    n_launched = len(launched)
    mon.compile = False
    monkeypatch.setattr(mon, "_use_triton", lambda rollout: mon.compile is not False)
    got = mon.update(*batch).compute()
    assert len(launched) == n_launched and got.keys() == want.keys()
    assert all(got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])) for k in want)

    mon, jitted, launched, checked = _cuda_path_monitor(monkeypatch)
    _warm(mon, [batch])

    def broken_launch(self, compiled, index, grid, args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(launch._FastLauncher, "launch", broken_launch)
    with pytest.warns(UserWarning, match="Triton mismatch kernel failed.*illegal memory access"):
        mon.update(*batch)
    assert mon._triton_failed and mon._planned is None and mon.updates == 1
    monkeypatch.setattr(mon, "_use_triton", lambda rollout: not mon._triton_failed)
    got = mon.compute()
    assert all(got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])) for k in want)
