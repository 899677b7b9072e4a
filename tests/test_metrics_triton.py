"""The monitor's Triton kernel without a GPU: run on the CPU by Triton's interpreter against the float64
reference and the torch pass, and compiled ahead of time for sm_90.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the interpreted tests run in a pytest
subprocess (``test_kernel_under_the_interpreter``); in the main run they are skipped. The same kernel runs on
a GPU in ``tests/test_metrics_cuda.py``.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from bounded import run_bounded
from test_metrics import (
    assert_k3_and_chi2_of_cancelling_batches,
    assert_k3_and_chi2_per_token,
    assert_matches,
    assert_prob_abs_diff_per_token,
    assert_ratio_extremes_of_tail_tokens,
    make_batch,
    reference,
    small_d_tokens,
)

from tim_plugins._mismatch_layout import FIELDS, N_SUMS, OFFSETS
from tim_plugins.metrics import MismatchMonitor

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernel_under_the_interpreter's subprocess")


def _kernel_monitor(**options) -> MismatchMonitor:
    mon = MismatchMonitor(**options)
    mon._path = lambda device: "kernel"  # the CUDA path, here on CPU tensors under the interpreter
    return mon


def _with_bad_tokens(B, T, dtype=torch.float32, seed=0):
    """A fully masked row, NaN, +inf and a -9999 placeholder in masked-in tokens (3 invalid)."""
    r, t, m = make_batch(B, T, dtype=dtype, seed=seed)
    m[0] = False
    r[1, 0], t[1, 1], r[1, 2] = float("nan"), float("inf"), -9999.0
    m[1, :3] = True
    return r, t, m


def _weights(B, T, seed=0):
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) * 3
    w[w < 0.5] = 0.0  # tokens the correction masked
    w[-1, 0], w[-1, 1] = float("nan"), float("inf")
    return w


def assert_same_state(kernel: torch.Tensor, torch_pass: torch.Tensor, rtol: float = 1e-5) -> None:
    """Field by field: counts exact, maxima to float32 rounding (exp and expm1 may differ in the last bit), sums
    within ``rtol``, and the histogram with the same total and at most 2 tokens moved to a neighbouring bin (each
    move counts twice; log10 rounding at a bin edge)."""
    for name, size in FIELDS:
        at = OFFSETS[name]
        got, want = kernel[at : at + size].double(), torch_pass[at : at + size].double()
        if name == "hist":
            assert got.sum() == want.sum() and (got - want).abs().sum() <= 4, name
        elif name in ("tokens", "invalid", "outside", "seqs", "is_tokens", "is_masked", "bucket_count"):
            assert torch.equal(got, want), (name, got, want)
        else:
            tol = 2e-7 if at >= N_SUMS else rtol
            assert torch.allclose(got, want, rtol=tol, atol=1e-9, equal_nan=True), (name, got, want)


_CASES = {  # name: (rollout, train, mask, is_weights), invalid tokens; T against the kernel's BLOCK of 256 tokens
    "bad tokens, T < block": (lambda: (*_with_bad_tokens(5, 37), None), 3),
    "several blocks, T not a multiple": (lambda: (*_with_bad_tokens(4, 1100, seed=1), None), 3),
    "one long row": (lambda: (*make_batch(1, 3001, seed=2), None), 0),
    "one token": (lambda: (*make_batch(1, 1, seed=3), None), 0),
    "bf16, int64 mask": (lambda: _mask_as(torch.int64, *_with_bad_tokens(4, 50, torch.bfloat16, 4)), 3),
    "fp16, float mask": (lambda: _mask_as(torch.float32, *_with_bad_tokens(3, 77, torch.float16, 5)), 3),
    "IS weights": (lambda: (*_with_bad_tokens(6, 300, seed=6), _weights(6, 300)), 3),
    "large mismatch": (lambda: (*make_batch(4, 129, seed=7, noise=2.0), _weights(4, 129, seed=1)), 0),
    "fully masked batch": (lambda: _mask_as(torch.bool, *make_batch(3, 30, seed=8), zero=True), 0),
}


def _mask_as(dtype, r, t, m, zero=False):
    return r, t, (torch.zeros_like(m) if zero else m).to(dtype), None


@interpreted
@pytest.mark.parametrize("case", list(_CASES))
def test_interpreted_kernel_matches_the_reference_and_the_torch_pass(case):
    make, invalid = _CASES[case]
    r, t, m, w = make()
    mon = _kernel_monitor().update(r, t, m, is_weights=w)
    assert not mon._kernel_failed
    got = mon.compute()
    assert_matches(got, reference(r, t, m, w), rtol=1e-5)
    assert got["tim/invalid_tokens"] == invalid
    eager = MismatchMonitor(compile=False).update(r, t, m, is_weights=w)
    assert_same_state(mon._state, eager._state)
    want = eager.compute()
    assert got.keys() == want.keys()
    for key in want:  # quantiles and bucket means included: the same state gives the same metrics
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9, nan_ok=True), key


@interpreted
def test_interpreted_kernel_accumulates_resets_and_skips_empty_batches():
    batches = [(*_with_bad_tokens(3, 20, seed=9), None), (torch.zeros(2, 0), torch.zeros(2, 0), None, None),
               (*make_batch(4, 300, seed=10), _weights(4, 300, seed=2)), (torch.zeros(0, 5), torch.zeros(0, 5), None, None)]
    kernel, eager = _kernel_monitor(), MismatchMonitor(compile=False)
    kernel.update(*batches[1][:2])  # an empty first batch: no state yet
    assert kernel._state is None and kernel.compute()["tim/tokens"] == 0
    for r, t, m, w in batches:
        kernel.update(r, t, m, is_weights=w)
        eager.update(r, t, m, is_weights=w)
    assert not kernel._kernel_failed and kernel.updates == len(batches) + 1
    assert_same_state(kernel._state, eager._state)
    kernel.reset()
    r, t, m = make_batch(2, 40, seed=11)
    got = kernel.update(r, t, m).compute()
    assert_matches(got, reference(r, t, m))


@interpreted
@pytest.mark.parametrize("band", [(0.9, 1.1), (0.5, 2.0)])
def test_interpreted_kernel_ratio_band_and_histograms(band):
    r, t, m = make_batch(8, 257, seed=12, noise=0.5)
    mon = _kernel_monitor(ratio_band=band).update(r, t, m)
    ref = reference(r, t, m, band=band)
    got = mon.compute()
    assert got["tim/token/ratio_outside_frac"] == pytest.approx(ref["tim/token/ratio_outside_frac"], abs=1e-12)
    assert got["tim/token/ratio_outside_frac"] > 0
    eager = MismatchMonitor(compile=False).update(r, t, m)
    for name, (counts, edges) in eager.histograms().items():
        k_counts, k_edges = mon.histograms()[name]
        assert (k_edges == edges).all() and k_counts.sum() == counts.sum() == got["tim/tokens"]
        assert abs(k_counts - counts).sum() <= 4, name


@interpreted
def test_interpreted_kernel_extremes_equal_the_torch_pass():
    """|d| in the overflow bin (>= 1e3), ρ that overflows float32, an exact zero, |d| below the first edge
    (1e-8) and just above it, huge weights."""
    r, t, m = make_batch(3, 40, seed=13)
    m[:] = True
    r[0, :5] = torch.tensor([2.0, -1.0, -3.0, -1e-3, -0.2])
    t[0, :5] = torch.tensor([-999.0, 99.0, -3.0, -1e-3 + 1.2e-10, -0.2 - 3e-8])
    w = torch.full((3, 40), 1e30)
    kernel = _kernel_monitor().update(r, t, m, is_weights=w)
    eager = MismatchMonitor(compile=False).update(r, t, m, is_weights=w)
    assert not kernel._kernel_failed
    assert_same_state(kernel._state, eager._state)
    got = kernel.compute()
    assert got["tim/token/ratio_max"] == math.inf and got["tim/token/abs_diff_max"] == pytest.approx(1001.0)
    assert kernel.histograms()["abs_diff"][0][[0, -1]].tolist() == [2, 1]  # the zero and 1e-10; 1001 (last bin)


@interpreted
def test_interpreted_kernel_ratio_extremes_of_tail_tokens():
    assert_ratio_extremes_of_tail_tokens(_kernel_monitor)


@interpreted
def test_interpreted_kernel_prob_abs_diff_of_extreme_valid_tokens():
    """|p_train − p_rollout| where e^r underflows while ρ − 1 overflows: |e^t − e^r|, not 0 · inf."""
    assert_prob_abs_diff_per_token(_kernel_monitor)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_interpreted_kernel_k3_and_chi2_per_token_to_float32_rounding(dtype):
    """|d| from 1e-7 to 3, both signs: the kernel's k3 (series below |d| = 1) and chi2 per token vs float64."""
    assert_k3_and_chi2_per_token(_kernel_monitor, *small_d_tokens(dtype))


@interpreted
def test_interpreted_kernel_k3_and_chi2_when_the_ratios_cancel_across_tokens():
    assert_k3_and_chi2_of_cancelling_batches(_kernel_monitor)


def interpreter_skip_reason() -> str | None:
    """Why Triton's interpreter cannot run a kernel with a loop bound taken from an int argument here, or None.

    Triton 3.6's interpreter (seen on the H200 image) converts such an argument, a NumPy array of shape [1], with
    ``int(array)``, which NumPy >= 2.5 refuses; Triton 3.9's squeezes the array first.
    """
    import inspect
    import warnings

    import numpy as np
    import triton
    from triton.runtime import interpreter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # NumPy 1.25-2.4 only warn
        try:
            int(np.zeros(1))
            return None
        except TypeError:
            pass
    if "squeeze" in inspect.getsource(interpreter._patch_lang_tensor):
        return None
    return (f"Triton {triton.__version__}'s interpreter with NumPy {np.__version__}: int() of a shape-[1] array "
            "(Triton 3.9, or NumPy < 2.5, runs it)")


def run_interpreted(test_file: str, passed: int) -> None:
    """Run ``test_file``'s ``test_interpreted_*`` tests in a pytest subprocess with ``TRITON_INTERPRET=1`` (it must
    be set before triton is imported) and require ``passed`` of them to pass and none to skip."""
    if INTERPRETED:
        pytest.skip("this is the interpreter's run")
    reason = interpreter_skip_reason()
    if reason:
        pytest.skip(reason)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning", test_file,
           "-k", "test_interpreted_"]
    proc, timed_out = run_bounded(cmd, 600, cwd=root, env=env)
    out = proc.stdout
    if timed_out:
        pytest.fail(f"the interpreted tests of {Path(test_file).name} took over 600 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-6000:]
    found = re.search(r"(\d+) passed", out)
    assert found and int(found[1]) == passed and "skipped" not in out, out[-2000:]


def compile_for_hopper(kernel, args: tuple, constexprs: dict, num_warps: int):
    """Compile a Triton kernel ahead of time for sm_90 (Triton's bundled ptxas; no GPU needed) with the
    positional arguments and constexprs a launch passes; ints are typed as a launch specialises them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8",
             torch.float64: "*fp64", torch.int64: "*i64", torch.int32: "*i32"}
    consts, values = dict(constexprs), iter(args)
    signature, by_index = {}, {}
    for i, param in enumerate(kernel.params):
        if param.is_constexpr:
            signature[param.name], by_index[(i,)] = "constexpr", consts.pop(param.name)
        else:
            value = next(values)
            signature[param.name] = types[value.dtype] if isinstance(value, torch.Tensor) else (
                "fp32" if isinstance(value, float) else "i32" if -2**31 <= value < 2**31 else "i64")
    assert not consts and next(values, None) is None
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=by_index),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def test_kernel_under_the_interpreter():
    run_interpreted(__file__, len(_CASES) + 10)


def test_kernel_arguments_follow_the_layout():
    """The kernel reads every state field's offset as a module-level constexpr of the field's upper-case name
    (its only constexpr arguments are HAS_W and BLOCK), and the torch pass produces every field: both derive
    their positions from FIELDS."""
    import triton.language as tl

    import tim_plugins._mismatch_kernel as kernel
    from tim_plugins._mismatch_pass import token_pass

    assert {p.name for p in kernel._mismatch_kernel.params if p.is_constexpr} == {"HAS_W", "BLOCK"}
    for name, _ in FIELDS:
        value = getattr(kernel, name.upper())
        assert isinstance(value, tl.constexpr) and value.value == OFFSETS[name], name
        assert name.upper() in kernel._mismatch_kernel.src, name  # each field is written by the kernel
    r, t, m = make_batch(2, 5)
    values, _ = token_pass(r, t, m, None, math.log(0.5), math.log(2.0))
    assert set(values) | {"tokens", "invalid", "hist", "bucket_count"} == {name for name, _ in FIELDS}


@pytest.mark.parametrize("has_weights", [False, True])
def test_kernel_compiles_for_hopper(has_weights):
    """Compile the kernel ahead of time for sm_90 with the arguments a launch passes (Triton's bundled ptxas; no
    GPU needed): catches what the interpreter does not check, such as a loop-carried value changing type."""
    if INTERPRETED:
        pytest.skip("the kernel is an interpreter function in this process")
    pytest.importorskip("triton.backends.compiler")
    import tim_plugins._mismatch_kernel as kernel
    from tim_plugins._mismatch_layout import empty_state

    B, T = 3, 5000
    grid, args, options = kernel.launch_arguments(
        empty_state("cpu"), torch.zeros(B, T, dtype=torch.bfloat16), torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool),
        torch.ones(B, T) if has_weights else None, math.log(0.5), math.log(2.0),
    )
    assert grid == (B,)
    num_warps = options.pop("num_warps")
    compiled = compile_for_hopper(kernel._mismatch_kernel, args, options, num_warps)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx
    # the row's totals go straight into the float64 state: one float64 atomic add to global memory (Triton 3.9
    # writes red.global.gpu.relaxed.add.f64, Triton 3.6 atom.global.gpu.relaxed.add.f64:
    # benchmarks/results/gpu_monitor_check.json)
    assert re.search(r"\b(red|atom)\.global(\.gpu)?(\.(relaxed|acq_rel|release))?\.add\.f64\b", ptx)
    assert "shared.add" in ptx  # tl.histogram counts in shared memory


def test_a_failing_kernel_leaves_the_batch_to_torch():
    """Without a GPU (and without the interpreter) the launch fails: the monitor warns once, keeps no partial
    state, and adds this batch with the compiled torch pass (as on CUDA) and later ones as if there were no
    kernel."""
    if INTERPRETED:
        pytest.skip("the interpreter runs the kernel on the CPU")
    r, t, m = _with_bad_tokens(4, 30)
    mon = _kernel_monitor()
    with pytest.warns(UserWarning, match="Triton mismatch kernel failed"):
        mon.update(r, t, m)
    assert mon._kernel_failed
    del mon._path  # the monitor's own choice again: no kernel once it has failed
    assert mon._path(torch.device("cuda")) != "kernel"
    mon.update(r, t, m)
    want = MismatchMonitor(compile=False).update(r, t, m).update(r, t, m).compute()
    got = mon.compute()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9, nan_ok=True), key
