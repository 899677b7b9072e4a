"""The CUDA fast path's Triton kernels, run on the CPU by Triton's interpreter, against the torch pass.

The kernels are the same source that runs on a GPU (``tests/test_metrics_cuda.py`` checks them there);
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
import json, math, torch
from test_metrics import make_batch
from tim_plugins.metrics import MismatchMonitor, triton_update

def run_triton(batches):
    mon = MismatchMonitor()
    mon._ensure_state(torch.device("cpu"), torch.float64)
    lay = mon._layout
    for r, t, m, w in batches:
        triton_update(mon._state, lay.n_sums, r, t, m, w, math.log(0.5), math.log(2.0), lay.n_signed_bins,
                      lay.hist_offset, lay.bucket_count_offset, lay.bucket_abs_offset, mon._kernel_scratch)
    return mon

def run_torch(batches):
    mon = MismatchMonitor(compile=False)
    for r, t, m, w in batches:
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

out = {}
for name, batches in cases.items():
    a, b = run_triton(batches), run_torch(batches)
    ga, gb = a.compute(), b.compute()
    diff = [k for k in gb if not (ga[k] == gb[k] or (ga[k] != ga[k] and gb[k] != gb[k])
            or abs(ga[k] - gb[k]) <= 1e-5 * abs(gb[k]) + 1e-9)]
    hist_equal = all((a.histograms()[h][0] == b.histograms()[h][0]).all() for h in ("abs_diff", "ratio"))
    out[name] = {"keys": sorted(ga) == sorted(gb), "diff": diff, "hist_equal": bool(hist_equal),
                 "tokens": ga["tim/tokens"], "invalid": ga["tim/invalid_tokens"]}
print("RESULT " + json.dumps(out))
'''


def test_triton_kernels_equal_the_torch_pass():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULT "):])
    assert len(results) == 9
    for name, res in results.items():
        assert res["keys"] and res["diff"] == [] and res["hist_equal"], (name, res)
    assert results["bad tokens, T < block"]["invalid"] == 3
    assert results["fully masked batch"]["tokens"] == 0


@pytest.mark.parametrize("has_weights", [False, True])
def test_kernels_compile_for_hopper(has_weights):
    """Compile both kernels ahead of time for sm_90 (Triton's bundled ptxas; no GPU needed): catches what
    the interpreter does not check, such as a loop-carried variable that changes type."""
    import inspect
    import math

    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernels are interpreter functions in this process")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as err:  # pragma: no cover - another Triton API generation
        pytest.skip(f"this Triton has no ASTSource/GPUTarget: {err}")
    import tim_plugins._mismatch_triton as kernels
    from tim_plugins.metrics import MismatchMonitor

    lay = MismatchMonitor()._layout
    width = kernels._N_PART_SUMS + kernels._N_PART_MAXES

    def compile_for_sm90(fn, types, constants):
        names = list(inspect.signature(fn.fn).parameters)
        source = ASTSource(
            fn=fn, signature={n: types.get(n, "constexpr") for n in names},
            constexprs={(names.index(k),): v for k, v in constants.items()},
        )
        return triton.compile(source, target=GPUTarget("cuda", 90, 32))

    e1, e2, e3, e4 = kernels._LOG_EDGES
    partials = compile_for_sm90(
        kernels._partials_kernel,
        {"rollout_ptr": "*bf16", "train_ptr": "*fp32", "mask_ptr": "*i64", "w_ptr": "*fp32",
         "partial_ptr": "*fp32", "hist_ptr": "*i32", "T": "i32", "n_seg": "i32"},
        dict(log_lo=math.log(0.5), log_hi=math.log(2.0), e1=e1, e2=e2, e3=e3, e4=e4, invalid_threshold=-1e3,
             log_lo_edge=kernels._LOG_LO_EDGE, bins_per_decade=32.0, N_SB=lay.n_signed_bins,
             CENTRE=(lay.n_signed_bins - 1) // 2, REPLICAS=kernels._REPLICAS, HAS_W=has_weights, WIDTH=width,
             N_SUMS=kernels._N_PART_SUMS, BLOCK=kernels.BLOCK, ITERS=kernels.SEGMENT // kernels.BLOCK),
    )
    finalize = compile_for_sm90(
        kernels._finalize_kernel,
        {"partial_ptr": "*fp32", "hist_ptr": "*i32", "state_ptr": "*fp64", "B": "i32", "n_seg": "i32"},
        dict(MAX_OFFSET=lay.n_sums, HIST_OFFSET=lay.hist_offset, BUCKET_COUNT_OFFSET=lay.bucket_count_offset,
             BUCKET_ABS_OFFSET=lay.bucket_abs_offset, N_SB=lay.n_signed_bins,
             N_SB_POW2=triton.next_power_of_2(lay.n_signed_bins), REPLICAS=kernels._REPLICAS, WIDTH=width,
             N_SUMS=kernels._N_PART_SUMS, COLS=triton.next_power_of_2(width), ROWS=32),
    )
    for kernel in (partials, finalize):
        assert "atom" in kernel.asm["ptx"] or kernel is finalize  # the histogram's integer atomics
        assert ".target sm_90" in kernel.asm["ptx"]
