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

.PHONY: setup demo test test-fast clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/.installed

demo: setup
	mkdir -p $(PREFECT_HOME)
	$(BIN)/reflow demo $(ARGS)

test: setup
	$(BIN)/python -m pytest -q --timeout=1200 tests $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests $(ARGS)

clean:
	rm -rf .reflow .cache
