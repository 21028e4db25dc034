# The README's two commands are `make demo` (the main job) and `make test` (the test suite).
# Every target first makes sure the cached environment exists (scripts/bootstrap.sh).
SHELL := /bin/bash
VENV := $(shell bash scripts/bootstrap.sh)
PY := $(VENV)/bin/python
OUT ?= out

.PHONY: setup demo test lint format engine-bench

setup:
	@echo "environment: $(VENV)"

# Main job: for now the engine benchmark on the benchmark-sized model (table, JSON and PNG).
demo: engine-bench

engine-bench:
	@mkdir -p $(OUT)
	$(VENV)/bin/tierflow engine-bench --json $(OUT)/engine_bench.json --plot $(OUT)/engine_bench.png $(ARGS)

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)
