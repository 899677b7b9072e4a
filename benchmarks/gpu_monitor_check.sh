#!/usr/bin/env bash
# The monitor's CUDA path on a GPU machine's own torch and Triton: the CUDA and Triton monitor tests (the kernel
# adding into the monitor's Accumulator buffer), the CUDA safe-vocab tests, and the float64 atomic the kernel's PTX
# uses for the row totals. Results in $OUT (pytest.txt, ptx_atomics.txt). Under 3 minutes.
set -u
OUT=${OUT:-/tmp/gpu-monitor-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
SECONDS=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore::UserWarning tests/test_metrics_cuda.py \
    tests/test_metrics_triton.py tests/test_safe_vocab_cuda.py >"$OUT/pytest.txt" 2>&1
echo "pytest exit $? (${SECONDS} s)"; tail -6 "$OUT/pytest.txt"
timeout 60 python3 - >"$OUT/ptx_atomics.txt" 2>&1 <<'PY'
import math, re, torch
import tim_plugins._mismatch_kernel as kernel
from tim_plugins._mismatch_layout import empty_state
from test_metrics_triton import compile_for_hopper
B, T = 3, 5000
grid, args, options = kernel.launch_arguments(empty_state("cpu"), torch.zeros(B, T, dtype=torch.bfloat16),
    torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool), None, math.log(0.5), math.log(2.0))
ptx = compile_for_hopper(kernel._mismatch_kernel, args, options, options.pop("num_warps")).asm["ptx"]
print(sorted({m.group(0) for m in re.finditer(r"\b(red|atom)\.[a-z0-9.]*\.f64\b", ptx)}))
PY
echo "ptx: $(cat "$OUT/ptx_atomics.txt" | tail -3)"
