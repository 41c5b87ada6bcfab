# Two entry points: `make demo` runs a local federation with real jobs, `make test` runs
# every check. Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint protos

$(BIN)/.installed: pyproject.toml examples/placement-plugin/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[coordinator,dev,sim,tracing,ray]'  # sim: the plot tests; tracing: the span tests; ray: the Ray core's tests
	$(BIN)/python -m pip install --quiet -e examples/placement-plugin  # loaded by name in the plugin tests
	touch $@

demo: $(BIN)/.installed
	$(BIN)/fedctl demo

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -n 2 --dist loadgroup -q -m "not solo and not fuzz and not chaos"
	$(BIN)/pytest -q -m solo
	$(BIN)/pytest -q -m fuzz
	FEDERATION_CHAOS_RUNS=10 $(BIN)/pytest -n 2 -q -m chaos  # no job runs twice, 10 runs in a row (20 and more: set FEDERATION_CHAOS_RUNS)

protos: $(BIN)/.installed
	$(BIN)/python proto/generate.py
