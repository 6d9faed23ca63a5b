# The README's two commands: `make run` and `make test`. Both set everything up on a fresh machine.
# A machine that already has torch (e.g. a GPU box) keeps its own build: the venv sees system packages.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= ROMEO:
MAX_TOKENS ?= 64
PYTEST_ARGS ?= -n 2      # two pytest-xdist workers (CI has two cores: ~5 instead of ~9 minutes); -n 0 runs serially

.PHONY: run test setup setup-test clean

$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned to the CPU wheel when the machine has none (avoids a multi-GB CUDA download).
$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0 || $(BIN)/python -m pip install -q torch
	$(BIN)/python -m pip install -q -e ".[serve]"
	touch $@

$(VENV)/.test: $(VENV)/.core
	$(BIN)/python -m pip install -q -e ".[serve,test]"
	touch $@

setup: $(VENV)/.core
setup-test: $(VENV)/.test

run: setup
	$(BIN)/moekv generate --prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS)

test: setup-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info
