"""The CUDA fast path's Triton kernel, run on the CPU by Triton's interpreter, against the torch pass.

The kernel is the same source that runs on a GPU (``tests/test_metrics_cuda.py`` checks it there);
``TRITON_INTERPRET=1`` must be set before triton is imported, so the checks run in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_CHECK = r'''
import json, math, os, torch
from test_metrics import make_batch
from tim_plugins.metrics import MismatchMonitor
import tim_plugins._mismatch_launch as launch

launch.TUNING.update(json.loads(os.environ["TIM_TEST_TUNING"]))

RESET = "reset"

def run_triton(batches):
    mon = MismatchMonitor()
    mon._use_triton = lambda rollout: True  # the CUDA path, here on the CPU under the interpreter
    for batch in batches:
        if batch is RESET:  # compute, then reset: the next update overwrites the buffer ("fresh")
            mon.compute()
            mon.reset()
            continue
        r, t, m, w = batch
        mon.update(r, t, m, is_weights=w)
    if mon._triton_failed:
        raise RuntimeError("the kernel failed and the monitor fell back to torch")
    # With DEVICE_METRICS, compute() must take the kernel's metric vector (not derive them on the host).
    if (mon._device_metrics is not None) != launch.TUNING["DEVICE_METRICS"]:
        raise RuntimeError("the device metric vector was not used as configured")
    return mon

def run_torch(batches):
    mon = MismatchMonitor(compile=False)
    for r, t, m, w in batches[batches.index(RESET) + 1 :] if RESET in batches else batches:
        mon.update(r, t, m, is_weights=w)
    return mon

def bad(B, T, dtype=torch.float32, seed=0):
    r, t, m = make_batch(B, T, dtype=dtype, seed=seed)
    if B > 1 and T > 3:
        m[0] = False  # a fully masked row
        r[1, 0] = float("nan"); t[1, 1] = float("inf"); r[1, 2] = -9999.0; m[1, :3] = True
    return r, t, m

cases = {}
r, t, m = bad(5, 37)
cases["bad tokens, T < block"] = [(r, t, m, None)]
r, t, m = bad(70, 1100, seed=1)
cases["70 rows, 2 blocks per row"] = [(r, t, m, None)]
r, t, m = bad(3, 9000, seed=8)
cases["3 segments per row"] = [(r, t, m, None)]
r, t, m = bad(4, 50, dtype=torch.bfloat16, seed=2)
cases["bf16, int64 mask"] = [(r, t, m.long(), None)]
r, t, m = bad(4, 50, seed=3)
cases["float mask"] = [(r, t, m.float(), None)]
r, t, m = bad(6, 40, seed=4)
w = torch.rand(6, 40) * 3
w[w < 0.5] = 0.0
w[2, 5] = float("nan")
cases["IS weights"] = [(r, t, m, w)]
cases["two updates accumulate"] = [(*bad(3, 20, seed=5), None), (*bad(4, 33, seed=6), None)]
cases["empty rows"] = [(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), None)]
r, t, m = make_batch(3, 30, seed=7)
cases["fully masked batch"] = [(r, t, torch.zeros_like(m), None)]
w = torch.rand(5, 37)
cases["reset, then a fresh update"] = [(*bad(5, 37, seed=9), w), (*bad(2, 20, seed=11), None), RESET,
                                       (*bad(4, 50, seed=10), None), (*bad(3, 9, seed=12), None)]
cases["empty first batch, then one"] = [(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5), None),
                                        (*bad(4, 50, seed=13), None)]

out = {}
for name, batches in cases.items():
    a, b = run_triton(batches), run_torch(batches)
    ga, gb = a.compute(), b.compute()
    # The same state, its metrics derived on the host: the kernel's metric vector must equal them exactly.
    kept, a._device_metrics = a._device_metrics, None
    gh = a.compute()
    a._device_metrics = kept
    host_differs = [k for k in gh if not (ga.get(k) == gh[k] or (ga.get(k) != ga.get(k) and gh[k] != gh[k]))]
    diff = [k for k in gb if not (ga[k] == gb[k] or (ga[k] != ga[k] and gb[k] != gb[k])
            or abs(ga[k] - gb[k]) <= 1e-5 * abs(gb[k]) + 1e-9)]
    hist_equal = all((a.histograms()[h][0] == b.histograms()[h][0]).all() for h in ("abs_diff", "ratio"))
    out[name] = {"keys": sorted(ga) == sorted(gb), "diff": diff, "hist_equal": bool(hist_equal),
                 "host_differs": host_differs,
                 "tokens": ga["tim/tokens"], "invalid": ga["tim/invalid_tokens"]}
print("RESULT " + json.dumps(out))
'''


# The default kernel, and the settings it does not use (the block histogram with few copies, host metrics).
def _alternate_options() -> dict:
    from tim_plugins._mismatch_launch import ALTERNATE_OPTIONS

    return ALTERNATE_OPTIONS


def _device_wait() -> dict:
    return {"WAIT": "device"}


_VARIANTS = {"default": dict, "block histogram, host metrics": _alternate_options, "device wait": _device_wait}


@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_triton_kernel_equals_the_torch_pass(variant):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}",
           "TIM_TEST_TUNING": json.dumps(_VARIANTS[variant]())}
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULT "):])
    assert len(results) == 11
    for name, res in results.items():
        assert res["keys"] and res["diff"] == [] and res["hist_equal"] and res["host_differs"] == [], (name, res)
    assert results["bad tokens, T < block"]["invalid"] == 3
    assert results["fully masked batch"]["tokens"] == 0


@pytest.mark.parametrize("has_weights, variant", [(False, "default"), (True, "default"),
                                                  (True, "block histogram, host metrics"), (False, "device wait")])
def test_kernel_compiles_for_hopper(has_weights, variant, monkeypatch):
    """Compile the kernel ahead of time for sm_90 (Triton's bundled ptxas; no GPU needed), with the argument
    list the monitor passes: catches what the interpreter does not check, such as a loop-carried variable
    that changes type."""
    import math

    import torch
    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernel is an interpreter function in this process")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as err:  # pragma: no cover - another Triton API generation
        pytest.skip(f"this Triton has no ASTSource/GPUTarget: {err}")
    import tim_plugins._mismatch_launch as launch
    import tim_plugins._mismatch_triton as kernels
    from tim_plugins.metrics import MismatchMonitor

    for name, value in _VARIANTS[variant]().items():
        monkeypatch.setitem(launch.TUNING, name, value)
    lay = MismatchMonitor()._layout
    B, T = 3, 5000
    state = torch.zeros(lay.n_sums + 7, dtype=torch.float64)
    weights = torch.ones(B, T) if has_weights else None
    grid, args = launch.kernel_arguments(
        state, lay.n_sums, torch.zeros(B, T, dtype=torch.bfloat16), torch.zeros(B, T),
        torch.zeros(B, T, dtype=torch.int64), weights, math.log(0.5), math.log(2.0), True,
        lay.n_signed_bins, lay.hist_offset, lay.bucket_count_offset, {},
    )
    segment = launch.TUNING["BLOCK"] * launch.TUNING["ITERS"]
    assert grid == (B, -(-T // segment)) and grid[1] > 1  # several segments per row: the row tickets run
    fn = kernels._mismatch_kernel
    pointer = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int64: "*i64", torch.int32: "*i32",
               torch.float64: "*fp64"}
    signature, constexprs = {}, {}
    for i, (param, value) in enumerate(zip(fn.params, args, strict=True)):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = pointer[value.dtype]
        else:
            signature[param.name] = "fp32" if isinstance(value, float) else "i32"
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32))
    ptx = kernel.asm["ptx"]
    assert ".target sm_90" in ptx
    plain = ptx.replace(".s32", "").replace(".u32", "")
    assert "atom.global.gpu.acq_rel.add" in plain  # the ticket
    # The block histogram counts in shared memory (tl.histogram); the default adds each token in global memory.
    assert ("shared.add" in plain) == (launch.TUNING["HISTOGRAM"] == "block")
    assert "ld.global.cg.b64" in ptx  # the fold (and the device metrics) read the float64 totals at L2
    # The launch id the host polls: released at system scope, after the device metric vector (only with WAIT
    # "flag", and only when there is such a vector).
    polled = launch.TUNING["WAIT"] == "flag" and launch.TUNING["DEVICE_METRICS"]
    assert ("atom.global.sys.release.exch.b64" in plain) == polled


_FLAG_CHECK = r'''
import json, math, torch
import tim_plugins._mismatch_launch as launch
from tim_plugins.metrics import MismatchMonitor

lay = MismatchMonitor()._layout
state = torch.zeros(lay.n_sums + 7, dtype=torch.float64)
out = {}
for wait in ("device", "flag"):
    launch.TUNING["WAIT"] = wait
    scratch = {}
    ids, flags = [], []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        r = -torch.rand(2, 300, generator=g)
        vector = launch.triton_update(state, lay.n_sums, r, r + 0.01, torch.ones(2, 300, dtype=torch.bool), None,
                                      math.log(0.5), math.log(2.0), seed == 0, lay.n_signed_bins, lay.hist_offset,
                                      lay.bucket_count_offset, scratch)
        ids.append(scratch["launch_id"])
        (buffers,) = [v for v in scratch.values() if isinstance(v, launch._Scratch)]
        flags.append(int(buffers.flag[0]))
    out[wait] = {"ids": ids, "flags": flags, "tokens": vector[0].item(), "pending": scratch["wait"] is not None}
    if wait == "flag":
        launch.wait_for_metrics(scratch, state.device)  # the flag holds the last id: no device synchronisation
        buffers.flag[0] = 0  # as if the last launch had not finished: then it synchronises the device
        try:
            launch.wait_for_metrics(scratch, state.device)
            out["synchronised"] = "no"
        except (AssertionError, RuntimeError) as err:  # this CPU torch has no CUDA to synchronise
            out["synchronised"] = type(err).__name__
print("RESULT " + json.dumps(out))
'''


def test_the_kernel_writes_the_launch_id_after_the_metrics_only_when_the_host_polls_it():
    """With WAIT "flag" each launch writes its own id into the slot after the metric vector, and
    wait_for_metrics returns on it; a stale id sends it to the device synchronisation. With WAIT "device" the
    slot stays 0 (its initial value) and nothing is polled."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    proc = subprocess.run([sys.executable, "-c", _FLAG_CHECK], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["flag"]["ids"] == res["device"]["ids"] == [1, 2, 3]
    assert res["flag"]["flags"] == [1, 2, 3] and res["flag"]["pending"]
    assert res["device"]["flags"] == [0, 0, 0] and not res["device"]["pending"]
    assert res["flag"]["tokens"] == res["device"]["tokens"] == 3 * 600  # fresh, then two accumulated batches
    assert res["synchronised"] != "no"


def test_fast_launch_steps_aside_for_launch_hooks():
    """A profiler's launch hook must see every launch: then the JIT path runs (Triton >= 3.5 keeps hooks in
    a chain that is never None, so an empty chain must not count as a hook)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernel is an interpreter function in this process")
    import triton

    import tim_plugins._mismatch_launch as kernels

    if not hasattr(triton, "knobs"):
        pytest.skip("this Triton has no knobs: the JIT path always runs")
    def hook(metadata):
        pass

    for name in ("launch_enter_hook", "launch_exit_hook"):
        hooks = getattr(triton.knobs.runtime, name)
        assert not kernels._launch_hooks_set()
        if hasattr(hooks, "add"):
            hooks.add(hook)
            try:
                assert kernels._launch_hooks_set(), name
            finally:
                hooks.remove(hook)
        else:  # pragma: no cover - a Triton whose hook is a plain attribute
            setattr(triton.knobs.runtime, name, hook)
            try:
                assert kernels._launch_hooks_set(), name
            finally:
                setattr(triton.knobs.runtime, name, hooks)
        assert not kernels._launch_hooks_set()
