"""Host side of the monitor's CUDA kernel (``_mismatch_triton``): launch shape, scratch buffers, and a launch
that skips Triton's JIT after the first call.

An ``update()`` is a few microseconds of GPU work, so what this module spends per call is the cost that
counts: it keeps everything that does not change between micro-batches (constants, scratch pointers, the
specialisation of each batch shape) and passes pointers to the compiled launcher as integers (a tensor
argument costs the launcher a method call and a driver query each). Once a batch key (shape, dtypes,
devices, alignment, settings) has been launched directly, its launch plan holds the compiled kernel and every
argument but the five input addresses and the launch id, so a repeated key costs one dictionary lookup
(``launch_planned``). ``MismatchMonitor.update`` tries that before anything else, on the inputs as the user
passed them, since a key match proves every input check too. On a 2-core CPU with the launch itself stubbed
out (``benchmarks/bench_monitor_host.py``, nine runs), ``reset()`` + ``update()`` + ``compute()`` take
1.47-1.54× less time with the plan tried first than with the checks first (9.1-15.7 vs 13.9-23.8 µs), and
1.34-1.40× less right after other code has run (19-31 vs 27-43 µs; cold caches, as between a training step's
kernels).
"""

from __future__ import annotations

import math
import re

import torch
import triton

from tim_plugins._mismatch_pass import HISTOGRAM_BINS_PER_DECADE, HISTOGRAM_RANGE, INVALID_LOGPROB_THRESHOLD
from tim_plugins._mismatch_triton import (
    _INTERPRET,
    DEVICE_METRIC_SLOTS,
    LOG_PROB_EDGES,
    N_PART_SUMS,
    SUM_COLS,
    _mismatch_kernel,
)

__all__ = [
    "TUNING", "HISTOGRAM_METHODS", "WAIT_METHODS", "WAIT_SPINS", "ALTERNATE_OPTIONS", "FAST_LAUNCH_TRITON",
    "fast_launch_supported", "kernel_arguments", "launch_planned", "triton_update", "wait_for_metrics",
]

# Launch shape and kernel variant, from a sweep on an H200 (``benchmarks/sweep_metrics_kernel.py``; 256×4096,
# 8×32768, 1024×1024). REPLICAS: histogram copies. HISTOGRAM: "global" (one atomic per token) or "block"
# (tl.histogram per block, one atomic per non-zero bin and program: 2× slower on the H200, 84 vs 36 µs).
# DEVICE_METRICS: the last program also writes the final metric vector, into pinned host memory, and
# compute() only waits for the device and reads it (the host derivation costs 92 vs 59 µs per call there).
# WAIT: how compute() waits for that vector: "flag" polls the launch id the kernel writes after the vector
# (falling back to a device synchronisation after WAIT_SPINS reads), which skips the synchronisation (6-8 µs on
# the H200's host; per update() + compute() there, "flag" vs "device": 108 vs 114, 95 vs 96, 88-90 vs 103 µs in
# three pairs of benchmark runs; warm, in the sweep, 59 vs 72 µs); "device" synchronises the device.
TUNING = {"BLOCK": 256, "ITERS": 8, "num_warps": 4, "REPLICAS": 64, "HISTOGRAM": "global", "DEVICE_METRICS": True,
          "WAIT": "flag"}
HISTOGRAM_METHODS = ("global", "block")
WAIT_METHODS = ("device", "flag")
WAIT_SPINS = 4096  # host reads of the flag (~0.13 µs each on a 2-core CPU, ~0.5 ms in all) before a device sync
# The settings the default does not use, all at once: the tests and benchmarks/gpu_checks.sh keep them working.
ALTERNATE_OPTIONS = {"HISTOGRAM": "block", "REPLICAS": 4, "DEVICE_METRICS": False}
_LOG_LO_EDGE = math.log10(HISTOGRAM_RANGE[0])
_MAX_SHAPES = 4096  # distinct (B, T) kept with their specialisation, before the cache starts over
_MAX_LAUNCH_ID = 2**30  # launch ids cycle in 1 .. 2^30: always a Triton i32 argument
# Triton versions whose launcher convention the direct launch follows, [from, to): ``CompiledKernel.run(gridX,
# gridY, gridZ, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`` with every
# argument (constexprs included, then skipped) and pointers accepted as integers. Read in the 3.6, 3.7, 3.8 and
# 3.9 sources (``runtime/jit.py``, ``backends/nvidia/driver.py`` and ``driver.c``); another version uses the JIT.
FAST_LAUNCH_TRITON = ((3, 6), (3, 10))


def fast_launch_supported(version: str) -> bool:
    """Whether the direct launch may run under Triton ``version`` (e.g. "3.6.0", "3.9.0+git1a2b"): inside
    ``FAST_LAUNCH_TRITON``. An unparsable version is not."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return False
    lo, hi = FAST_LAUNCH_TRITON
    return lo <= (int(match[1]), int(match[2])) < hi


class _FastLauncher:
    """Launch a compiled kernel straight through its launcher, skipping ``JITFunction.run``'s per-call
    argument binding and specialisation (the larger part of a ~25 µs Triton launch).

    The first call for a key goes through the JIT (which compiles if needed) and keeps the compiled kernel.
    The caller's key must cover everything Triton specialises on: argument dtypes, 16-byte pointer alignment,
    and for each non-constexpr integer whether it is 1 or a multiple of 16. Launch hooks (profilers) and the
    interpreter always take the JIT path, and so does every launch under a Triton outside
    ``FAST_LAUNCH_TRITON``.
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict = {}
        self.enabled = fast_launch_supported(triton.__version__)
        from triton.runtime.driver import driver

        self._driver = driver
        self._current_stream = None  # the driver's function: CUDA stream handle of a device's current stream

    def ready(self, key):
        """The kept compiled kernel for ``key``, or None when the JIT path must run."""
        if not self.enabled or _INTERPRET or _launch_hooks_set():
            return None
        return self.compiled.get(key)

    def jit(self, key, grid, args, num_warps: int) -> None:
        compiled = self.kernel[grid](*args, num_warps=num_warps)
        if compiled is not None and self.enabled and not _INTERPRET:
            self.compiled[key] = compiled

    def launch(self, compiled, device_index: int, grid, args) -> None:
        """``args``: the kernel's arguments with every pointer as an integer address."""
        current_stream = self._current_stream
        if current_stream is None:  # looked up at the first launch: the driver initialises lazily
            current_stream = self._current_stream = self._driver.active.get_current_stream
        stream = current_stream(device_index)
        compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args)


# Triton's runtime settings (one object for the process; hooks are added to it or assigned on it): None in a
# Triton without knobs, which then always launches through the JIT.
_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


def _launch_hooks_set() -> bool:
    """Whether a launch hook is set (every planned launch asks: one call frame, no helpers)."""
    runtime = _RUNTIME_KNOBS
    if runtime is None:
        return True
    # Triton >= 3.5 keeps each hook in a HookChain (never None): set when it holds a call.
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return ((enter is not None and bool(getattr(enter, "calls", True)))
            or (leave is not None and bool(getattr(leave, "calls", True))))


def _int_spec(x: int) -> tuple[bool, bool, bool]:
    return x == 1, x % 16 == 0, x >= 2**31


class _Scratch:
    """Buffers owned by one monitor (two monitors on two streams must not share them), each left as the next
    launch needs it: batch sums and maxima, per-row Σd, valid count and ticket (grown as needed; left zeroed,
    maxima −inf), two sets of int32 histogram copies (a launch counts into one and clears the other), the
    launch's ticket counter and the parity that picks the set; then the |d| bin edges (for the device
    quantiles) and the device metric vector, followed by the slot of the launch id (``TUNING["WAIT"]``).
    ``pointers`` holds their addresses, in kernel order.

    The metric vector lives in pinned host memory, which the kernel writes directly (CUDA maps page-locked
    memory into the device's address space): compute() then needs no copy, only a wait for the device. Where
    pinning fails it lives on the device, and compute() copies it. ``flag`` is the host's view of the launch
    id slot: a one-element int64 numpy view of host memory (None for a device vector)."""

    __slots__ = ("tensors", "pointers", "rows", "metrics", "flag")

    def __init__(self, device: torch.device, rows: int, n_sb: int, replicas: int) -> None:
        from tim_plugins.metrics import abs_diff_bin_edges

        self.rows = max(rows, 1024)
        f64 = dict(dtype=torch.float64, device=device)
        self.tensors = (
            torch.zeros(SUM_COLS, **f64), torch.full((8,), -math.inf, **f64), *self._rows(self.rows, device),
            torch.zeros(2 * replicas * n_sb, dtype=torch.int32, device=device),
            torch.zeros(2, dtype=torch.int32, device=device), abs_diff_bin_edges(device), _metric_vector(device),
        )
        self.pointers = tuple(t.data_ptr() for t in self.tensors)
        vector = self.tensors[-1]
        self.metrics = vector[:DEVICE_METRIC_SLOTS]
        self.flag = None if vector.is_cuda else vector[DEVICE_METRIC_SLOTS:].view(torch.int64).numpy()

    @staticmethod
    def _rows(n: int, device: torch.device) -> tuple:
        return (torch.zeros(n, dtype=torch.float64, device=device), torch.zeros(n, dtype=torch.int32, device=device),
                torch.zeros(n, dtype=torch.int32, device=device))

    def grow(self, rows: int) -> None:
        self.rows = max(rows, 2 * self.rows)
        t = self.tensors
        self.tensors = (t[0], t[1], *self._rows(self.rows, t[0].device), *t[5:])
        self.pointers = tuple(x.data_ptr() for x in self.tensors)


def _metric_vector(device: torch.device) -> torch.Tensor:
    """The metric slots (float64), then the launch id slot (int64 bits; 0: none yet)."""
    vector = None
    if device.type == "cuda" and not _INTERPRET:
        try:
            vector = torch.full((DEVICE_METRIC_SLOTS + 1,), math.nan, dtype=torch.float64, pin_memory=True)
        except RuntimeError:  # no page-locked memory to be had: a device vector, copied by compute()
            pass
    if vector is None:
        vector = torch.full((DEVICE_METRIC_SLOTS + 1,), math.nan, dtype=torch.float64, device=device)
    vector[DEVICE_METRIC_SLOTS] = 0.0
    return vector


def _scratch(store: dict, device: torch.device, rows: int, n_sb: int, replicas: int) -> _Scratch:
    key = (device, n_sb, replicas)
    entry = store.get(key)
    if entry is None:
        entry = store[key] = _Scratch(device, rows, n_sb, replicas)
    elif entry.rows < rows:
        entry.grow(rows)
        store.pop("plans", None)  # they hold the replaced buffers' addresses
    return entry


def _constants(
    store: dict, tuning: tuple, max_offset: int, n_signed_bins: int, hist_offset: int, bucket_count_offset: int,
    has_weights: bool,
) -> tuple:
    """The kernel's constexpr arguments, in signature order (built once per monitor and setting: this runs
    at every micro-batch)."""
    key = ("constants", tuning, max_offset, n_signed_bins, hist_offset, bucket_count_offset, has_weights)
    constants = store.get(key)
    if constants is None:
        t = TUNING
        if t["HISTOGRAM"] not in HISTOGRAM_METHODS:
            raise ValueError(
                f"TUNING['HISTOGRAM']={t['HISTOGRAM']!r} is not a histogram method: use one of {HISTOGRAM_METHODS}."
            )
        if not isinstance(t["REPLICAS"], int) or t["REPLICAS"] < 1:
            raise ValueError(
                f"TUNING['REPLICAS']={t['REPLICAS']!r} must be a positive int (histogram copies), e.g. 64."
            )
        if t["WAIT"] not in WAIT_METHODS:
            raise ValueError(f"TUNING['WAIT']={t['WAIT']!r} is not a way to wait: use one of {WAIT_METHODS}.")
        n_edges = (n_signed_bins + 1) // 2 - 1
        constants = (
            *LOG_PROB_EDGES, INVALID_LOGPROB_THRESHOLD, _LOG_LO_EDGE, float(HISTOGRAM_BINS_PER_DECADE),
            n_signed_bins, triton.next_power_of_2(n_signed_bins), (n_signed_bins - 1) // 2, max_offset,
            hist_offset, bucket_count_offset, has_weights, N_PART_SUMS, SUM_COLS, n_edges, t["REPLICAS"],
            t["BLOCK"], t["ITERS"], t["HISTOGRAM"] == "block", bool(t["DEVICE_METRICS"]), DEVICE_METRIC_SLOTS,
            t["WAIT"] == "flag",
        )
        store[key] = constants
    return constants


def _shape(store: dict, B: int, T: int, segment: int) -> tuple[int, tuple]:
    """(segments per row, what Triton specialises on in B, T and n_seg), cached per batch shape."""
    shapes = store.get("shapes")
    if shapes is None or len(shapes) > _MAX_SHAPES:
        shapes = store["shapes"] = {}
    entry = shapes.get((B, T, segment))
    if entry is None:
        n_seg = max(1, -(-T // segment))
        entry = shapes[(B, T, segment)] = (n_seg, (_int_spec(B), _int_spec(T), _int_spec(n_seg)))
    return entry


def _prepare(scratch: dict, device: torch.device, B: int, T: int, n_signed_bins: int, max_offset: int,
             hist_offset: int, bucket_count_offset: int, has_weights: bool) -> tuple:
    """What a launch needs besides its inputs, from the caches: (tuning key, segments per row, shape
    specialisation, scratch buffers, constexpr arguments)."""
    tuning = TUNING
    tuning_key = tuple(tuning.values())
    n_seg, shape_spec = _shape(scratch, B, T, tuning["BLOCK"] * tuning["ITERS"])
    buffers = _scratch(scratch, device, B, n_signed_bins, tuning["REPLICAS"])
    constants = _constants(
        scratch, tuning_key, max_offset, n_signed_bins, hist_offset, bucket_count_offset, has_weights
    )
    return tuning_key, n_seg, shape_spec, buffers, constants


def kernel_arguments(
    state: torch.Tensor, max_offset: int, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor,
    is_weights: torch.Tensor | None, log_lo: float, log_hi: float, fresh: bool, n_signed_bins: int,
    hist_offset: int, bucket_count_offset: int, scratch: dict, launch_id: int = 1,
) -> tuple[tuple, list]:
    """The grid and the kernel's full argument list as tensors (constexprs included, in signature order)."""
    B, T = rollout.shape
    _, n_seg, _, buffers, constants = _prepare(
        scratch, rollout.device, B, T, n_signed_bins, max_offset, hist_offset, bucket_count_offset,
        is_weights is not None,
    )
    args = [
        rollout, train, mask, rollout if is_weights is None else is_weights, *buffers.tensors, state,
        log_lo, log_hi, B, T, n_seg, int(fresh), launch_id, *constants,
    ]
    return (B, n_seg), args


def _signature(
    shape: torch.Size, state: torch.Tensor, rollout, train, mask, is_weights, fresh: bool, band: tuple,
) -> tuple | None:
    """(plan key, the five input addresses, the device index) of inputs that a launch plan can take as they
    are, else None: each an exact ``torch.Tensor`` (a subclass may hold its data elsewhere; the callers check
    rollout's type), all of rollout's ``shape`` ([B, T]), contiguous. Plans are kept per shape; the key holds
    everything else a launch depends on: dtypes and devices (each input's: the caller has not checked them),
    the 16-byte alignment of each address (Triton specialises pointers on it), the settings and the ratio
    band's logs. One scratch dict serves one monitor layout, so its constants are not in the key."""
    tensor = torch.Tensor
    if type(train) is not tensor or type(mask) is not tensor:
        return None
    if train.shape != shape or mask.shape != shape:
        return None
    if not (rollout.is_contiguous() and train.is_contiguous() and mask.is_contiguous()):
        return None
    p_r, p_t, p_m, p_s = rollout.data_ptr(), train.data_ptr(), mask.data_ptr(), state.data_ptr()
    if is_weights is None:
        p_w, weights = p_r, None
    else:
        if type(is_weights) is not tensor or is_weights.shape != shape or not is_weights.is_contiguous():
            return None
        p_w = is_weights.data_ptr()
        weights = (is_weights.dtype, is_weights.get_device(), p_w % 16 == 0)
    device_index = rollout.get_device()
    key = (rollout.dtype, train.dtype, mask.dtype, weights, device_index, train.get_device(),
           mask.get_device(), state.get_device(), state.dtype, p_r % 16 == 0, p_t % 16 == 0, p_m % 16 == 0,
           p_s % 16 == 0, fresh, tuple(TUNING.values()), band)
    return key, (p_r, p_t, p_m, p_w, p_s), device_index


def launch_planned(
    scratch: dict, state: torch.Tensor, fresh: bool, rollout, train, mask, is_weights, band: tuple,
) -> torch.Tensor | None | bool:
    """``triton_update`` for inputs whose launch plan exists (an earlier call with the same key launched
    directly), taken as they are: the monitor calls it before checking or converting anything, since a key
    match also proves every check that call passed. Returns what ``triton_update`` does, or False (nothing
    launched) when no plan fits: the caller then takes the full path. ``band``: (log lo, log hi)."""
    plans = scratch.get("plans")
    if plans is None or type(rollout) is not torch.Tensor:
        return False
    shape = rollout.shape
    shape_plans = plans.get(shape)
    if shape_plans is None:  # a new batch shape (common where T follows the longest response): a quick miss
        return False
    signature = _signature(shape, state, rollout, train, mask, is_weights, fresh, band)
    plan = None if signature is None else shape_plans.get(signature[0])
    if plan is None or _launch_hooks_set():  # a profiler's hook must see the launch: the JIT path
        return False
    launcher, compiled, grid, buffer_pointers, head, constants, metrics, flag = plan
    # _next_launch_id and _on_device, written out: on this path every call frame counts (~1.4 µs per
    # update() with them, measured on a 2-core CPU right after other code had run).
    launch_id = scratch["launch_id"] = scratch["launch_id"] % _MAX_LAUNCH_ID + 1
    scratch["wait"] = None if flag is None else (flag, launch_id)
    _, (p_r, p_t, p_m, p_w, p_s), device_index = signature
    args = (p_r, p_t, p_m, p_w, *buffer_pointers, p_s, *head, launch_id, *constants)
    if device_index == _current_device():
        launcher.launch(compiled, device_index, grid, args)
    else:
        with torch.cuda.device(device_index):
            launcher.launch(compiled, device_index, grid, args)
    return metrics


def triton_update(
    state: torch.Tensor, max_offset: int, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor,
    is_weights: torch.Tensor | None, log_lo: float, log_hi: float, fresh: bool, n_signed_bins: int,
    hist_offset: int, bucket_count_offset: int, scratch: dict,
) -> torch.Tensor | None:
    """Add one [B, T] batch to the monitor's float64 ``state`` (sums, then maxima from ``max_offset``, in
    the layout of ``metrics``), or overwrite it with the batch's statistics when ``fresh``. ``scratch`` is a
    dict the caller keeps between calls, for one layout. Returns the device metric vector the launch wrote
    (see ``TUNING["DEVICE_METRICS"]``), else None."""
    B, T = rollout.shape
    if B == 0:
        if fresh:
            raise ValueError("an empty first batch has no statistics to write: initialise the state instead")
        return None
    rollout, train, mask = rollout.contiguous(), train.contiguous(), mask.contiguous()
    is_weights = None if is_weights is None else is_weights.contiguous()
    band = (log_lo, log_hi)
    metrics = launch_planned(scratch, state, fresh, rollout, train, mask, is_weights, band)
    if metrics is not False:
        return metrics
    return _first_launch(state, max_offset, rollout, train, mask, is_weights, band, fresh, n_signed_bins,
                         hist_offset, bucket_count_offset, scratch)


def _first_launch(
    state: torch.Tensor, max_offset: int, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor,
    is_weights: torch.Tensor | None, band: tuple, fresh: bool, n_signed_bins: int, hist_offset: int,
    bucket_count_offset: int, scratch: dict,
) -> torch.Tensor | None:
    """``triton_update`` for contiguous inputs without a launch plan: through the caches and, where needed,
    Triton's JIT; then, where the direct launch may run, the plan that later calls with this key launch from."""
    B, T = rollout.shape
    log_lo, log_hi = band
    has_weights = is_weights is not None
    w = is_weights if has_weights else rollout
    signature = None if type(rollout) is not torch.Tensor else _signature(
        rollout.shape, state, rollout, train, mask, is_weights, fresh, band,
    )
    if signature is None:  # a tensor subclass: launched like the others, never from a plan
        key, pointers = None, (rollout.data_ptr(), train.data_ptr(), mask.data_ptr(), w.data_ptr(), state.data_ptr())
    else:
        key, pointers, _ = signature
    launch_mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask  # Triton has no bool pointers
    device_index = rollout.get_device()  # -1 on the CPU (the interpreter)
    tuning_key, n_seg, shape_spec, buffers, constants = _prepare(
        scratch, rollout.device, B, T, n_signed_bins, max_offset, hist_offset, bucket_count_offset, has_weights,
    )
    launcher = scratch.get("launcher")
    if launcher is None:
        launcher = scratch["launcher"] = _FastLauncher(_mismatch_kernel)
    # What Triton specialises on (scratch buffers are whole allocations, always aligned).
    aligned = tuple(p % 16 == 0 for p in pointers)
    jit_key = (device_index, rollout.dtype, train.dtype, launch_mask.dtype, w.dtype, not has_weights, aligned,
               shape_spec, fresh, tuning_key)
    grid = (B, n_seg)
    compiled = launcher.ready(jit_key)
    device_metrics = TUNING["DEVICE_METRICS"]
    metrics = buffers.metrics if device_metrics else None
    flag = buffers.flag if device_metrics and TUNING["WAIT"] == "flag" else None
    launch_id = _next_launch_id(scratch, flag)
    if compiled is None:  # the first call for this key, a launch hook or the interpreter: Triton's JIT
        _, tensors = kernel_arguments(
            state, max_offset, rollout, train, launch_mask, is_weights, log_lo, log_hi, fresh, n_signed_bins,
            hist_offset, bucket_count_offset, scratch, launch_id,
        )
        _on_device(device_index, launcher.jit, jit_key, grid, tensors, TUNING["num_warps"])
        return metrics
    head = (log_lo, log_hi, B, T, n_seg, int(fresh))
    if key is not None:
        plans = scratch.get("plans")
        if plans is None or len(plans) >= _MAX_SHAPES:
            plans = scratch["plans"] = {}
        plans.setdefault(rollout.shape, {})[key] = (launcher, compiled, grid, buffers.pointers, head, constants,
                                                    metrics, flag)
    p_r, p_t, p_m, p_w, p_s = pointers
    args = (p_r, p_t, p_m, p_w, *buffers.pointers, p_s, *head, launch_id, *constants)
    _on_device(device_index, launcher.launch, compiled, device_index, grid, args)
    return metrics


def _next_launch_id(scratch: dict, flag) -> int:
    """A new id for the launch about to run (ids cycle in 1 .. _MAX_LAUNCH_ID); with ``flag`` (the launch id
    slot the host polls), it is what ``wait_for_metrics`` waits for."""
    launch_id = scratch["launch_id"] = scratch.get("launch_id", 0) % _MAX_LAUNCH_ID + 1
    scratch["wait"] = None if flag is None else (flag, launch_id)
    return launch_id


# The current CUDA device's index. torch.cuda.current_device() (0.52 µs on the H200's host) first checks in
# Python that CUDA is initialised; a launch has CUDA tensors, so it is. A torch without CUDA has no
# such C function (the CPU tests launch with stubs).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _on_device(device_index: int, launch, *args) -> None:
    """``launch(*args)`` in the tensors' device context: a kernel runs in the current device's."""
    if _INTERPRET or device_index == _current_device():
        launch(*args)
    else:
        with torch.cuda.device(device_index):
            launch(*args)


def wait_for_metrics(scratch: dict, device: torch.device) -> None:
    """Return once the last launch's metric vector, in pinned host memory, is complete: when the launch id
    slot holds that launch's id (``TUNING["WAIT"] == "flag"``), else after a device synchronisation (every
    stream: the launch's need not be the current one)."""
    pending = scratch.get("wait")
    if pending is not None:
        flag, launch_id = pending
        for _ in range(WAIT_SPINS):
            if flag[0] == launch_id:
                return
    torch.cuda.synchronize(device)
