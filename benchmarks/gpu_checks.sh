#!/usr/bin/env bash
# The monitor's checks that need a CUDA GPU, in order of importance, each bounded in time (a GPU session is
# short): the CUDA tests (default kernel and every TUNING option), the benchmark against verl with the
# default kernel, with WAIT "device" and with the default again (verl's own time varies between runs: two
# default runs to judge a ratio by), the kernel sweep, then the benchmark with the sweep's best setting and
# with the alternate options (under 10 minutes in all). Results land in benchmarks/results/; with
# COPY_TO=DIR each one is also copied there as soon as it is written, so a step cut short still leaves the
# earlier ones.
#
#   bash benchmarks/gpu_checks.sh            # VERL_SOURCE=DIR: verl's package folder where verl is not installed
#   SWEEP=0 bash benchmarks/gpu_checks.sh    # without the sweep (~2 minutes shorter)
#   PYTHON=.venv/bin/python COPY_TO=$OUT bash benchmarks/gpu_checks.sh
set -u
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
VERL_ARGS=()
if [ -n "${VERL_SOURCE:-}" ]; then VERL_ARGS=(--verl-source "$VERL_SOURCE"); fi
RESULTS=benchmarks/results

keep() {  # keep() FILE...: copy results to COPY_TO when it is set
    if [ -n "${COPY_TO:-}" ]; then cp "$@" "$COPY_TO/" 2>/dev/null; fi
    return 0
}

bench() {  # bench LABEL TUNING
    timeout 70 "$PY" -m benchmarks.bench_metrics --device cuda "${VERL_ARGS[@]}" --tuning "$2" 2>&1 \
        | grep -v -i warn | tail -3
    cp "$RESULTS/metrics_vs_verl_cuda.json" "$RESULTS/metrics_vs_verl_cuda_$1.json"
    keep "$RESULTS/metrics_vs_verl_cuda_$1.json"
}

"$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
SECONDS=0
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_metrics_cuda.py -W ignore::UserWarning 2>&1 | tail -15
echo "tests: ${SECONDS} s"
bench default '{}'
bench device '{"WAIT": "device"}'
bench default_again '{}'
if [ "${SWEEP:-1}" != 0 ]; then  # SWEEP=0: no sweep (and so no "best" setting), when device time is short
    rm -f "$RESULTS/metrics_kernel_sweep_cuda.json"  # a sweep cut short must not leave an older file's choice
    timeout 110 "$PY" -m benchmarks.sweep_metrics_kernel 2>&1 | grep -v -i warn | tail -30
    keep "$RESULTS/metrics_kernel_sweep_cuda.json"
    echo "sweep done: ${SECONDS} s"
    # The sweep's best setting, when it is neither of those.
    best=$("$PY" -c "import json, sys; r = json.load(open(sys.argv[1])); b = r.get('best_tuning')
print(json.dumps(b) if b and b not in (r['default_tuning'], {**r['default_tuning'], 'WAIT': 'device'}) else '')" \
        "$RESULTS/metrics_kernel_sweep_cuda.json" 2>/dev/null)
    if [ -n "$best" ]; then
        echo "best from the sweep: $best"
        bench best "$best"
    fi
fi
bench options alternates
echo "all done: ${SECONDS} s"
