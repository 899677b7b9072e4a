#!/usr/bin/env bash
# The TRL adapter on a GPU machine's own stack (its torch / transformers; TRL and datasets carried as wheels in
# .whl/, see the device notes): `tim-plugins doctor` there, a CUDA GRPOTrainer with the safe vocabulary and
# num_iterations=2 (benchmarks/gpu_trl_check.py), and the capability / staleness / CUDA safe-vocab tests. Each step is
# bounded; results land in $OUT (doctor.txt, gpu_trl_check.json, pytest.txt). Under 6 minutes.
set -u
OUT=${OUT:-/tmp/gpu-stack-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1 || tail -5 "$OUT/install.txt"
python3 -c "import torch, transformers, trl, datasets, pyarrow; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)"
SECONDS=0
timeout 120 python3 -m tim_plugins.apps.cli doctor >"$OUT/doctor.txt" 2>&1; echo "doctor exit $? (${SECONDS} s)"
cat "$OUT/doctor.txt"
timeout 240 python3 -m benchmarks.gpu_trl_check "$OUT/gpu_trl_check.json" 2>&1 | tail -14
echo "gpu_trl_check done (${SECONDS} s)"
export PYTHONPATH=/tmp/site:$PWD/tests
timeout 300 python3 -m pytest -q -p no:cacheprovider -W ignore::UserWarning tests/test_trl_capabilities.py \
    tests/test_trl_staleness.py tests/test_safe_vocab_cuda.py tests/test_doctor.py >"$OUT/pytest.txt" 2>&1
echo "pytest exit $? (${SECONDS} s)"; tail -8 "$OUT/pytest.txt"
