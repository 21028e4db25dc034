# The README's two commands are `make demo` (the main job) and `make test` (the test suite).
# Both first check the machine (scripts/doctor.sh: what is missing, and how to install it).
# Every target makes sure the cached environment exists (scripts/bootstrap.sh), once, when a
# recipe first needs it: after the doctor, so that a missing Python is reported, not a stack
# trace.
SHELL := /bin/bash
VENV = $(eval VENV := $$(shell bash scripts/bootstrap.sh))$(VENV)
PY = $(VENV)/bin/python
OUT ?= out

.PHONY: setup doctor-demo doctor-test demo test lint format protos engine-bench bench

setup:
	@echo "environment: $(VENV)"

doctor-demo:
	@bash scripts/doctor.sh demo

doctor-test:
	@bash scripts/doctor.sh test

# Main job: the local stack (Kafka, queue service, a SmolLM2 worker, gateway, Envoy) and a
# mixed-tier workload sent through Envoy; prints the per-tier table, writes out/demo.{json,png}.
demo: doctor-demo
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

test: doctor-test lint
	$(PY) -m pytest $(PYTEST_ARGS)
