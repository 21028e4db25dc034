# The README's two commands are `make demo` (the main job) and `make test` (the test suite).
# Every target first makes sure the cached environment exists (scripts/bootstrap.sh).
SHELL := /bin/bash
VENV := $(shell bash scripts/bootstrap.sh)
PY := $(VENV)/bin/python
OUT ?= out

.PHONY: setup demo test lint format protos engine-bench bench

setup:
	@echo "environment: $(VENV)"

# Main job: the local stack (Kafka, queue service, a SmolLM2 worker, gateway, Envoy) and a
# mixed-tier workload sent through Envoy; prints the per-tier table, writes out/demo.{json,png}.
demo:
	$(VENV)/bin/tierflow demo --out $(OUT) $(ARGS)

engine-bench:
	@mkdir -p $(OUT)
	$(VENV)/bin/tierflow engine-bench --json $(OUT)/engine_bench.json --plot $(OUT)/engine_bench.png $(ARGS)

bench:
	@mkdir -p $(OUT)
	$(VENV)/bin/tierflow bench --json $(OUT)/bench.json --plot $(OUT)/bench.png $(ARGS)

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m launch.protogen --check

# Regenerate tierflow/v1/ from protos/ (CI fails when they are stale).
protos:
	$(PY) -m launch.protogen

format:
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)
