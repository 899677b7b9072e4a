#!/usr/bin/env bash
# Issue 25 on one CUDA GPU: the safe-vocab head against TRL's fused chunked log-prob, and the TRL GRPO step with
# and without TIMCallback. Each benchmark is bounded in time and rewrites its results file after every case /
# round, so a step cut short still leaves what it measured:
#   0. tests/test_safe_vocab_cuda.py                          the Triton folds vs float64 and the torch folds
#   1. python -m benchmarks.bench_safe_vocab --device cuda   bf16, V 151,936, H 896 / 2048 / 4096 ×
#      N 4096 / 16384 / 65536, ours (Triton folds) vs TRL vs the torch folds vs full logits, 5 interleaved
#      rounds + 1 warm-up, sanity check -> benchmarks/results/safe_vocab_cuda.json
#   2. python -m benchmarks.bench_trl_step --device cuda     Qwen2-0.5B-shaped random bf16 model, HF bf16
#      generation, 8 prompts × 8 completions × 256 tokens, plain vs TIMConfig() vs TIMConfig(safe_vocab=True),
#      5 interleaved rounds of 1 + 3 steps, TRL's phase timers per step -> benchmarks/results/trl_step_cuda.json
# With COPY_TO=DIR the results (and each benchmark's log) are copied there.
#
# Measured on an H200 (2026-11-26): (0) 19 s, (1) 80 s, (2) 470 s, plus ~30 s of wheel install: together more
# than one 10-minute device call allows, so run it as two: ONLY=safe_vocab, then ONLY=trl_step.
#   QUICK=1            smaller grid (3 safe-vocab cases × 3 rounds; 2 rounds of 1 + 2 steps × 128 tokens)
#   ONLY=safe_vocab    or ONLY=trl_step: one of the two (e.g. one per call when calls are short)
#   TESTS=0            skip tests/test_safe_vocab_cuda.py, which otherwise runs before the safe-vocab benchmark
#   SV_LIMIT=270 TRL_LIMIT=560   the time limits of the two benchmarks, in seconds
#   SV_ARGS=... TRL_ARGS=...      extra arguments of each (e.g. TRL_ARGS="--steps 2 --arms plain safe")
#   PYTHON=python3     the interpreter (the H200 image's python3 has torch, triton, accelerate, pandas, pyarrow)
#   WHEELS=.whl        wheels installed into /tmp/tim_site first (no index, no network)
#   STAGE=/tmp/tim_stage  where the package tree is staged and the benchmarks run
#
# Nothing is downloaded at run time. The GPU machine lacks trl and datasets, and its transformers (5.17) is
# not the version this project is tested with (5.10.4, which needs tokenizers <= 0.23.0). Fetch the wheels
# here, where pip reaches an index, for the GPU machine's Python 3.12 / x86-64 (about 16 MB):
#   bash benchmarks/gpu_perf.sh --fetch-wheels      # trl, transformers, tokenizers, datasets, dill, multiprocess
#   echo /.whl/ >> .git/info/exclude                 # once: keep them out of commits
# then carry .whl, e.g. with the device tool: run(command="ONLY=safe_vocab COPY_TO=$OUT bash
# benchmarks/gpu_perf.sh", carry=[".whl"], timeout_s=480), then the same with ONLY=trl_step and timeout_s=600.
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
WHEELS=${WHEELS:-.whl}

if [ "${1:-}" = "--fetch-wheels" ]; then
    HERE=${PYTHON:-.venv/bin/python}
    # the versions of this checkout's environment, so the GPU run uses what the tests ran with
    specs=$("$HERE" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{d}=={version(d)}" for d in ("trl", "transformers", "tokenizers", "datasets", "dill", "multiprocess")))
EOF
    ) || exit 1
    echo "fetching $specs into $WHEELS/"
    # shellcheck disable=SC2086  # specs is a list of words
    exec "$HERE" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" $specs
fi

PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tim_site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/tim_site${PYTHONPATH:+:$PYTHONPATH}
fi
# tim_plugins.integrations.* lives in integrations/ (pyproject's package-dir): stage the package tree as an
# install would lay it out, and run from there (python -m puts the working directory first on sys.path)
STAGE=${STAGE:-/tmp/tim_stage}
rm -rf "$STAGE" && mkdir -p "$STAGE" || exit 1
cp -r "$REPO/tim_plugins" "$REPO/benchmarks" "$REPO/tests" "$STAGE/" && cp -r "$REPO/integrations" "$STAGE/tim_plugins/" \
    || exit 1
cd "$STAGE" || exit 1

FIX="run 'bash benchmarks/gpu_perf.sh --fetch-wheels' where pip reaches an index, and carry .whl"
"$PY" - <<'EOF' || { echo "preflight failed: $FIX"; exit 1; }
import importlib.util
missing = [m for m in ("torch", "triton", "transformers", "tokenizers", "trl", "datasets", "accelerate")
           if importlib.util.find_spec(m) is None]
if missing:
    raise SystemExit(f"missing Python packages: {missing}")
import torch, transformers, trl, triton
from trl.kernels.chunked_logprob import _use_triton
from tim_plugins.integrations.trl import TIMCallback  # noqa: F401
if not torch.cuda.is_available():
    raise SystemExit("torch sees no CUDA device")
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
      f"trl {trl.__version__}, {torch.cuda.get_device_name()}, "
      f"TRL folds in Triton: {_use_triton(torch.device('cuda'))}")
EOF

RESULTS=$STAGE/benchmarks/results
SUFFIX=""
if [ "${QUICK:-0}" = 1 ]; then SUFFIX=_quick; fi
case "${ONLY:-}" in ""|safe_vocab|trl_step) ;; *) echo "ONLY=$ONLY: expected safe_vocab or trl_step"; exit 2 ;; esac
want() { [ -z "${ONLY:-}" ] || [ "$ONLY" = "$1" ]; }
keep() {  # keep NAME: copy a results file back into the checkout, and to COPY_TO when it is set
    if [ -f "$RESULTS/$1" ]; then
        cp "$RESULTS/$1" "$REPO/benchmarks/results/"
        if [ -n "${COPY_TO:-}" ]; then cp "$RESULTS/$1" "$COPY_TO/"; fi
    fi
    return 0
}
log() {  # log NAME: the benchmark's output, also kept under COPY_TO
    if [ -n "${COPY_TO:-}" ]; then tee "$COPY_TO/$1"; else cat; fi
}
bench() {  # bench NAME LIMIT_S ARGS...: benchmarks.bench_NAME on CUDA, bounded, logged, results kept
    local name=$1 limit=$2
    shift 2
    timeout -k 10 "$limit" "$PY" -m "benchmarks.bench_$name" --device cuda \
        --output "$RESULTS/${name}_cuda$SUFFIX.json" "$@" 2>&1 | log "${name}_cuda$SUFFIX.log"
    local rc=${PIPESTATUS[0]}
    echo "$name benchmark: rc=$rc, ${SECONDS} s"
    [ "$rc" = 0 ] || status=$rc
    keep "${name}_cuda$SUFFIX.json"
}
SECONDS=0
status=0
if want safe_vocab && [ "${TESTS:-1}" = 1 ]; then
    # the Triton folds against the float64 reference and the torch folds, before they are timed
    PYTHONPATH=$STAGE:$STAGE/tests${PYTHONPATH:+:$PYTHONPATH} timeout -k 10 150 "$PY" -m pytest -q -p no:cacheprovider \
        tests/test_safe_vocab_cuda.py 2>&1 | tail -15 | log safe_vocab_cuda_tests.log
    rc=${PIPESTATUS[0]}
    echo "safe-vocab CUDA tests: rc=$rc, ${SECONDS} s"
    [ "$rc" = 0 ] || status=$rc
fi
if want safe_vocab; then
    if [ "${QUICK:-0}" = 1 ]; then
        bench safe_vocab "${SV_LIMIT:-270}" --case bf16:896:4096 --case bf16:896:16384 --case bf16:4096:16384 \
            --repeats 3 ${SV_ARGS:-}
    else
        bench safe_vocab "${SV_LIMIT:-270}" ${SV_ARGS:-}
    fi
fi
if want trl_step; then
    if [ "${QUICK:-0}" = 1 ]; then bench trl_step "${TRL_LIMIT:-560}" --quick ${TRL_ARGS:-}
    else bench trl_step "${TRL_LIMIT:-560}" ${TRL_ARGS:-}; fi
fi
# the headline figures, last in the output
"$PY" - "$RESULTS" "$SUFFIX" <<'EOF'
import json, sys
from pathlib import Path
res, suffix = Path(sys.argv[1]), sys.argv[2]
for name in (f"safe_vocab_cuda{suffix}.json", f"trl_step_cuda{suffix}.json"):
    path = res / name
    if path.exists():
        data = json.loads(path.read_text())
        print(f"{name} (complete: {data.get('complete')}):")
        print(json.dumps({k: data.get(k) for k in ("ratios", "meets", "check")}, indent=1, default=float)[:6000])
EOF
echo "all done: ${SECONDS} s"
exit $status
