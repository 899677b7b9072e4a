#!/usr/bin/env bash
# The monitor's checks that need a CUDA GPU, in order of importance, each bounded in time (a GPU session is
# short): the CUDA tests, the benchmark against verl (goal: the default path >= 10x faster), run twice (verl's
# own time varies between runs), then the launch-setting sweep, the host-cost benchmark, and what the statistics
# by key cost next to the monitor's update. Results land in benchmarks/results/ (one file per benchmark: the
# second run replaces the first); with COPY_TO=DIR each one is also copied there as soon as it is written (both
# runs: metrics_vs_verl_cuda_1.json, _2.json), so a step cut short still leaves the earlier ones. Under 10
# minutes in all.
#
#   bash benchmarks/gpu_checks.sh            # VERL_SOURCE=DIR: verl's package folder where verl is not installed
#   SWEEP=0 bash benchmarks/gpu_checks.sh    # without the sweep
#   PYTHON=.venv/bin/python COPY_TO=$OUT bash benchmarks/gpu_checks.sh
#   METRICS_ARGS=--quick                    # bench_metrics' extra arguments
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

bench() {  # bench N: the N-th run, kept as metrics_vs_verl_cuda_N.json in COPY_TO only
    # shellcheck disable=SC2086  # METRICS_ARGS is a list of words
    timeout 120 "$PY" -m benchmarks.bench_metrics --device cuda "${VERL_ARGS[@]}" ${METRICS_ARGS:-} 2>&1 \
        | grep -v -i warn | tail -3
    if [ -n "${COPY_TO:-}" ]; then cp "$RESULTS/metrics_vs_verl_cuda.json" "$COPY_TO/metrics_vs_verl_cuda_$1.json"; fi
}

"$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
SECONDS=0
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_metrics_cuda.py -W ignore::UserWarning 2>&1 | tail -15
echo "tests: ${SECONDS} s"
bench 1
bench 2
if [ "${SWEEP:-1}" != 0 ]; then
    rm -f "$RESULTS/metrics_kernel_sweep_cuda.json"  # a sweep cut short must not leave an older file's choice
    timeout 150 "$PY" -m benchmarks.sweep_metrics_kernel 2>&1 | grep -v -i warn | tail -12
    keep "$RESULTS/metrics_kernel_sweep_cuda.json"
    echo "sweep done: ${SECONDS} s"
fi
timeout 60 "$PY" -m benchmarks.bench_monitor_host --quick 2>&1 | grep -v -i warn | tail -2
keep "$RESULTS/monitor_host.json"
timeout 60 "$PY" -m benchmarks.bench_by_key --device cuda --quick 2>&1 | grep -v -i warn | tail -2
keep "$RESULTS/by_key_cuda.json"
echo "all done: ${SECONDS} s"
