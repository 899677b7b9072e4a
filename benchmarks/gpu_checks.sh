#!/usr/bin/env bash
# The monitor's checks that need a CUDA GPU, in order of importance, each bounded in time (a GPU session is
# short): the CUDA tests (default kernel and every TUNING option), the kernel sweep, then the benchmark against
# verl with the default kernel and with the options (under 9 minutes in all). Results land in benchmarks/results/.
#
#   bash benchmarks/gpu_checks.sh            # VERL_SOURCE=DIR: verl's package folder where verl is not installed
#   PYTHON=.venv/bin/python bash benchmarks/gpu_checks.sh
set -u
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
VERL_ARGS=()
if [ -n "${VERL_SOURCE:-}" ]; then VERL_ARGS=(--verl-source "$VERL_SOURCE"); fi
RESULTS=benchmarks/results

"$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_metrics_cuda.py -W ignore::UserWarning 2>&1 | tail -15
timeout 160 "$PY" -m benchmarks.sweep_metrics_kernel 2>&1 | grep -v -i warn | tail -30
for label in default options; do
    tuning='{}'
    if [ "$label" = options ]; then tuning=candidates; fi
    timeout 90 "$PY" -m benchmarks.bench_metrics --device cuda "${VERL_ARGS[@]}" --tuning "$tuning" 2>&1 \
        | grep -v -i warn | tail -3
    cp "$RESULTS/metrics_vs_verl_cuda.json" "$RESULTS/metrics_vs_verl_cuda_$label.json"
done
