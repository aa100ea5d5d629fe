# Two entry points, each setting itself up from a fresh clone:
#   make demo   create .venv, install jaxgpt, run the main job
#   make test   create .venv, install jaxgpt + torch (CPU) + test deps, run the fast tier of the test suite:
#               every parity test and the unit tests, in parallel (pytest-xdist), about 6 min on 2 CPU cores; then
#               the float64-reference and serving-engine tests again compiled as users compile (-m users_flags)
#   make test-kernels  the C++ kernels' suites built for avx2 and for the portable baseline (CI runs it)
#   make test-experiments  the heaviest experiment smoke runs (-m experiment: exp_attnres, exp_minigpt, exp_seed004,
#                      exp_shakespeare nanogpt + big;
#                      about 8 min of CPU), kept out of CI for its time (issue 41); make test-all runs them too
#   make test-slow     the slower tiers: experiment/benchmark smoke runs (-m smoke), multi-process and
#                      SIGKILL tests (-m multiprocess), whole command-line runs and the server (-m e2e),
#                      long unit tests (-m slow); CI (.ci/run) runs make test, then this
#   make test-gpu      the parity suite on a GPU with default settings (no precision flag), in GPU_PYTHON's
#                      environment (a CUDA jax, torch, transformers; run from the repo root); tests marked
#                      cpu_only are skipped there. CI stays on the CPU: the README records GPU runs
#   make device-check  issue 56's targets on a lent GPU in one command of <= 10 min (scripts/device_check.py: the train
#                      race, decoding, serving, the GPU tier; results under $$OUT, else results/engine/gpu_check*);
#                      DRY_RUN=1: every step at toy size on the CPU, into a temporary folder (the slow tier runs it)
#   make lint          ruff over the code (pyproject.toml's [tool.ruff]; CI runs it)
#   make parity-margins   regenerate docs/parity-margins.md (float32 errors against a float64 reference)
#   make experiments   the seeds' experiments (results/, about an hour on 2 CPU cores; needs torch too);
#                      EXPERIMENTS_ARGS=--full: the seeds' full budgets (~2 h), the committed results
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
# Extra pytest arguments for every test target (e.g. PYTEST_ARGS='-k bert' or '-x').
PYTEST_ARGS ?=
# pytest-xdist workers: one per CPU core ('auto'); 0 runs in this process.
TEST_WORKERS ?= auto
SLOW_TIERS := slow or smoke or multiprocess or e2e or experiment
# --max-worker-restart=0: a worker that dies fails its test and the run goes on without it; a
# replacement worker under loadscope can wait forever for work (pytest-xdist 3.8, issue #1378).
# --capture=sys: native code's own stderr (an XLA or glibc message before an abort) reaches the log
# instead of the dead worker's capture file.
XDIST := -n $(TEST_WORKERS) --dist loadscope --max-worker-restart=0 --capture=sys
# The tests with a float64 reference (jaxgpt.testing: check_module, assert_as_accurate_as_torch).
MARGIN_TESTS := $(addprefix parity_tests/,test_norms.py test_mlp.py test_attention.py test_block.py \
	test_decoder.py test_bert.py test_encdec.py test_attnres.py)
MARGIN_SEEDS ?= 0
EXPERIMENTS_ARGS ?=

# The GPU tier: the parity files, run on whatever accelerator JAX finds (JAXGPT_EXPECT_BACKEND makes a CPU-only
# JAX fail test_gpu_policy instead of passing on the CPU); each xdist worker takes memory as it needs it.
GPU_PYTHON ?= python3
GPU_WORKERS ?= 4
GPU_BACKEND ?= gpu
GPU_TESTS := parity_tests/unit/test_gpu_policy.py $(addprefix parity_tests/,test_norms.py test_mlp.py test_positions.py test_attention.py \
	test_block.py test_decoder.py test_bert.py test_encdec.py test_attnres.py test_moe.py test_attention_backends.py \
	test_precision.py)

.PHONY: demo test test-kernels test-slow test-experiments test-all test-gpu device-check lint parity-margins experiments clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[plots]'
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.core
	$(BIN)/python -m pip install -q '$(TORCH)'
	$(BIN)/python -m pip install -q -e '.[test,plots]'
	touch $@

demo: $(VENV)/.core
	$(BIN)/python scripts/demo.py

# Two passes: the suite at the tests' fast compile flags (parity_tests/plugins/xla_flags.py), then the tests marked users_flags (the
# float64-reference parity tests, the serving engine and its packed head) compiled as users compile.
test: $(VENV)/.test
	$(BIN)/python -m pytest $(XDIST) -m "not ($(SLOW_TIERS) or users_flags)" --durations 15 $(PYTEST_ARGS)
	JAXGPT_TEST_XLA_OPT=default $(BIN)/python -m pytest $(XDIST) -m "users_flags and not ($(SLOW_TIERS))" \
		--durations 5 $(PYTEST_ARGS)

# The C++ kernels' suites again with the kernels built for AVX2 and for the compiler's portable baseline: their
# tile shapes are chosen at compile time, and the CI machine's native build is AVX-512 (CI runs this).
KERNEL_TESTS := parity_tests/engine/test_panel_head.py $(addprefix parity_tests/,test_decode_kernels.py \
	test_attention_ffi.py test_norm_gelu_ffi.py test_paged_kernel.py test_documents.py)
test-kernels: $(VENV)/.test
	for isa in avx2 portable; do \
		JAXGPT_KERNEL_ISA=$$isa $(BIN)/python -m pytest $(XDIST) -m "not ($(SLOW_TIERS))" --durations 5 \
			$(KERNEL_TESTS) $(PYTEST_ARGS) || exit 1; \
	done

test-slow: $(VENV)/.test
	$(BIN)/python -m pytest $(XDIST) -m "($(SLOW_TIERS)) and not experiment" --durations 15 $(PYTEST_ARGS)

test-experiments: $(VENV)/.test
	$(BIN)/python -m pytest $(XDIST) -m experiment --durations 10 $(PYTEST_ARGS)

test-all: test test-slow test-experiments

# ruff, configured in pyproject.toml ([tool.ruff]); CI runs it after the fast tier
lint: $(VENV)/.test
	$(BIN)/ruff check jaxgpt torch_ref parity_tests scripts examples

test-gpu:
	JAXGPT_EXPECT_BACKEND=$(GPU_BACKEND) JAXGPT_TEST_XLA_OPT=default XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. $(GPU_PYTHON) -m pytest \
		-n $(GPU_WORKERS) --dist loadscope -m "not ($(SLOW_TIERS))" --durations 10 $(GPU_TESTS) $(PYTEST_ARGS)

# The device's python3 (jax, torch, transformers installed; no venv); the dry run uses this clone's venv.
DEVICE_PYTHON ?= $(if $(DRY_RUN),$(BIN)/python,python3)
DEVICE_CHECK_ARGS ?=
device-check:
	PYTHONPATH=. $(DEVICE_PYTHON) -m scripts.device_check $(if $(DRY_RUN),--dry-run) $(DEVICE_CHECK_ARGS)

# MARGIN_SEEDS="$$(seq 0 19)": the worst over 20 draws of the random weights (as committed); 0: the suite's own.
parity-margins: $(VENV)/.test
	mkdir -p .pytest_cache && rm -f .pytest_cache/parity-margins.json
	status=0; for s in $(MARGIN_SEEDS); do JAXGPT_PARITY_SEED_OFFSET=$$s JAXGPT_PARITY_MARGINS=docs/parity-margins.md \
		JAXGPT_PARITY_MARGINS_MERGE=.pytest_cache/parity-margins.json JAXGPT_TEST_XLA_OPT=default $(BIN)/python -m pytest $(XDIST) -q \
		-k torch_ref $(MARGIN_TESTS) $(PYTEST_ARGS) || status=1; done; exit $$status

experiments: $(VENV)/.test
	$(BIN)/python -m scripts.experiments.run_experiments $(EXPERIMENTS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
