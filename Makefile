# Two entry points, each setting itself up from a fresh clone:
#   make demo   create .venv, install jaxgpt, run the main job
#   make test   create .venv, install jaxgpt + torch (CPU) + test deps, run the test suite
#   make experiments   the seeds' experiments (results/, about an hour on 2 CPU cores; needs torch too);
#                      EXPERIMENTS_ARGS=--full: the seeds' full budgets (~2 h), the committed results
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?= -m "not slow"
EXPERIMENTS_ARGS ?=

.PHONY: demo test experiments clean

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

test: $(VENV)/.test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

experiments: $(VENV)/.test
	$(BIN)/python scripts/run_experiments.py $(EXPERIMENTS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
