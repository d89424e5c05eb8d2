# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo demo-train ablation test lint fmt bench-gateway crds clean

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	test -d $(VENV) || $(PY) -m venv $(VENV)
	# torch first, from the CPU wheel on this disk; otherwise a dependency would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python tools/k8s_binaries.py $(BIN)
	touch $(STAMP)

# The main job until the RL demo meets its goal: one recorded tool-calling conversation.
demo: $(STAMP)
	$(BIN)/python -m inharness.demo

# RL of the tiny model inside the calculator agent (work in progress: see the README).
demo-train: $(STAMP)
	$(BIN)/python examples/calc/demo.py

ablation: $(STAMP)
	$(BIN)/python examples/calc/demo.py --ablation

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench-gateway: $(STAMP)
	$(BIN)/python bench/gateway.py

# The CRDs, from the spec models: crds/ and the chart's copy (a test fails when they are stale).
crds: $(STAMP)
	$(BIN)/inharness operator crds

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
