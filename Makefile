# Set-up and everyday commands. `make venv` creates .venv and installs everything
# from the package registries; `make test` runs the test suite; `make serve` serves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch is what the tests need; pin it so pip does not pull CUDA wheels.
TORCH_CPU ?= torch==2.13.0
# The CPU wheel of torch brings no triton; the tests run the Triton kernels under its interpreter
# (TRITON_INTERPRET=1, on the CPU). 3.7.1 is the version torch 2.13's CUDA wheel pins.
TRITON_CPU ?= triton==3.7.1

.PHONY: venv test lint format serve demo clean

venv: $(BIN)/llmserve

$(BIN)/llmserve: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_CPU)" || $(BIN)/pip install -q --index-url https://download.pytorch.org/whl/cpu torch
	$(BIN)/pip install -q "$(TRITON_CPU)"
	$(BIN)/pip install -q -e ".[serve,test]"
	touch $@

# Test files run on TEST_WORKERS processes (pytest-xdist, a file per process: a file's module-scoped
# stack stays in one). Each test's leak checks see only its own stacks' processes, ports and regions.
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

lint: venv
	$(BIN)/ruff check server tests scripts download_model.py
	$(BIN)/ruff format --check server tests scripts download_model.py

format: venv
	$(BIN)/ruff format server tests scripts
	$(BIN)/ruff check --fix server tests scripts

serve: venv
	./start_server.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# The engine alone, offline, on the demo model.
.PHONY: generate
generate: venv
	$(BIN)/llmserve generate --prompt "Hello, llm" --max-tokens 32 --temperature 0
