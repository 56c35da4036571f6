# Entry points: `make demo`, `make check` (the fast tier) and `make test` (the whole suite). Each creates .venv when missing and installs into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first and pinned: a bare torch requirement would pull a multi-GB CUDA build on CPU machines.
TORCH := torch==2.13.0

.PHONY: demo check test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# One stamp per set of extras, redone when pyproject.toml changes.
$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(BIN)/pip install -q -e ".[dev,interop]"
	touch $(VENV)/.core $@

demo: $(VENV)/.core
	$(BIN)/quantize recipes/demo.yaml

# The fast tier (docs/testing.md): the tests marked `check`, no anchor venv, no browser, no
# llama.cpp beyond llama-cpp-python; under 8 minutes on 2 cores once the dev venv exists.
check: $(VENV)/.test
	$(BIN)/python -m pytest tests -m "check and not anchor" --durations=10

# GPTQModel, the loader the GPTQ export tests read our files back with, pins numpy; vLLM's CPU
# build, which the interop test serves our exports with, and llm-compressor, whose AWQ checkpoint
# is a source the quantized-source tests convert, pin transformers: each lives in its own venv
# (.anchors/NAME; quick when it is already there). Debian's chromium is the browser the report
# page is checked in (tests/test_report_browser.py; apt-get, only when /usr/bin/chromium is missing).
test: $(VENV)/.test
	bash bench/anchors/setup.sh gptqmodel
	bash bench/anchors/setup.sh vllm
	bash bench/anchors/setup.sh llmcompressor
	bash bench/anchors/setup.sh chromium
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) runs
