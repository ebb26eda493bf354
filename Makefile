# reflow: `make demo` and `make test` each set up the venv first (once), then run.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# torch is installed first and pinned: a bare `torch` requirement pulls a multi-GB CUDA build on
# a machine with no torch. Elsewhere, point pip at PyTorch's CPU wheels with e.g.
#   make demo TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=

export PREFECT_HOME ?= $(CURDIR)/.reflow/prefect
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: setup demo lint test test-random test-fast bench clean

# Installs go through uv where it can be had (`pip install uv`, a 17 MB wheel), with pip's configuration
# (tools/install.sh); anything uv cannot do falls back to pip. Python compiles what is imported, once, on first
# import; for that it must be allowed to write .pyc files, which an inherited PYTHONDONTWRITEBYTECODE=1 forbids
# (then every Ray worker recompiles torch).
unexport PYTHONDONTWRITEBYTECODE
PIP := $(BIN)/pip install -q --no-compile
INSTALL = sh tools/install.sh $(BIN)

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	test -x $(BIN)/uv || $(PIP) uv || echo "uv unavailable: installing with pip"
	$(INSTALL) $(TORCH_PIP_ARGS) "$(TORCH)"
	$(INSTALL) -e '.[lora]'
	touch $@

# Test extras, plus SGLang's own request/response/bucket code for the contract tests: the
# sglang wheel only (39 MB, no CUDA stack), which `pip install -e .[test]` cannot say (--no-deps); SGLang 0.5.17's
# (the GPU machine's: the newest for its torch 2.11) into a folder of its own (tests/sglang_0517.py);
# and sglang-router's binary (31 MB wheel, ~1 s; + setproctitle, its one import not installed already).
$(BIN)/.installed-test: $(BIN)/.installed
	$(INSTALL) -e '.[test]'
	$(INSTALL) --no-deps sglang==0.5.23 sglang-router==0.3.2 setproctitle==1.3.8
	$(INSTALL) --no-deps --target .cache/sglang-0.5.17 sglang==0.5.17
	touch $@

setup: $(BIN)/.installed

demo: setup
	mkdir -p $(PREFECT_HOME)
	$(BIN)/reflow demo $(ARGS)

# Lint and type checks (seconds); `make test` runs them first. (No `ruff format --check`: the
# formatter splits argument lists into runs of 6+ same-shape lines, which `duplicates` flags.)
lint: $(BIN)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/mypy -p reflow.rl -m reflow.infra.config.schema -m reflow.infra.config.settings -m reflow.engines.train.settings \
		-m reflow.engines.weights.settings

# The whole suite (CI runs this). Per-test timeout and summary: pyproject.toml [tool.pytest.ini_options].
# tests/suite.sh runs tests/test_deployments.py and tests/test_resume.py (their own stack, their own Ray
# clusters) in a second pytest process beside the rest; with ARGS (`make test ARGS="-k push"`) everything
# runs in one process.
test: lint
	mkdir -p $(PREFECT_HOME)  # Prefect makes its home's last folder only; without .reflow it warns and goes on
	tests/suite.sh $(BIN)/python $(ARGS)

# The same suite with modules and tests shuffled, in the same two processes as `make test` (each shuffles its own
# share). The seed is printed first (pytest -q hides the plugin's header line); repeat an order with
# `make test-random SEED=N`.
test-random: $(BIN)/.installed-test
	@mkdir -p $(PREFECT_HOME)
	@seed=$${SEED:-$$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')}; \
	echo "random order seed $$seed (repeat it: make test-random SEED=$$seed)"; \
	RANDOM_ORDER_SEED=$$seed tests/suite.sh $(BIN)/python $(ARGS)

# The quick tier: no Ray, DeepSpeed or Prefect start-up (tests/conftest.py fails a test that does), in three
# pytest-xdist workers that steal each other's queued tests at the end: a third of it is waiting (timeouts, retries'
# backoff, servers starting), which the other workers fill (2 cores: 139 s in one process; 62-63 s in three, 64 in
# four, 74 in two).
test-fast: $(BIN)/.installed-test
	mkdir -p $(PREFECT_HOME)
	$(BIN)/python -m pytest -q -n 3 --dist worksteal -m "not slow" tests $(ARGS)

# Each script prints a table and a one-line summary, and takes under 10 minutes on 2 cores
# (bench/RESULTS.md holds the figures; bench/gpu.py runs on a GPU machine).
bench: setup
	$(BIN)/python bench/iteration_overhead.py
	$(BIN)/python bench/engine_throughput.py
	$(BIN)/python bench/weight_push.py

clean:
	rm -rf .reflow .cache
