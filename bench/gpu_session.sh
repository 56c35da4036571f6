#!/usr/bin/env bash
# Issue 35's GPU checks as one prepared script for a device session (one H200 for 15 minutes in
# all, at most 10 minutes a command): run it in two parts, each under the command limit, every
# step's output kept under $OUT as it goes, so a part cut short still leaves what it measured.
#
#   bash bench/gpu_session.sh setup-and-tests   # ~4 min: wheels, the CUDA tests, the kernels' benches
#   bash bench/gpu_session.sh roofline          # ~6 min: bench/engine_roofline.py --sections gpu, then the recipe stages
#
# The GPU machine has torch, transformers and Triton but not gguf, pydantic, fastapi, uvicorn or
# openai, and cannot download: their cp312 wheels travel in .gpu-wheels/ (gitignored; made here by
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .gpu-wheels gguf pydantic fastapi uvicorn openai httpx     # then delete numpy's wheel
# and named in the run's `carry`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
step() {  # step NAME SECONDS COMMAND...: one step, its output in $OUT/NAME.log, its status in $OUT/steps.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
}
case "${1:-}" in
    setup-and-tests)
        nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
        python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$OUT/gpu.txt" 2>&1
        step wheels 60 python -m pip install --no-index --find-links .gpu-wheels gguf pydantic fastapi uvicorn openai httpx
        # the kernels compiled, in bf16 and fp8 too; graphs against eager; the device's KV blocks; RTN/GPTQ on CUDA
        step kernel-tests 150 python -m pytest -q -x tests/test_lowbit_kernels.py tests/test_paged_attention.py \
            tests/test_kv_cache.py tests/test_engine_cuda.py tests/test_device_build.py
        step lowbit-gemm 60 python bench/lowbit_gemm.py --out "$OUT/lowbit_gemm.jsonl"
        step decode-graphs 90 python bench/decode_graphs.py --shape 1b
        ;;
    roofline)
        step roofline 420 python bench/engine_roofline.py --sections gpu --work /tmp/roofline --out "$OUT/roofline.jsonl"
        step recipe-gpu 150 python bench/recipe_gpu.py --stages gptq,rtn --out "$OUT/recipe_gpu.jsonl" --keep /tmp/rg
        ;;
    *)
        echo "usage: $0 setup-and-tests | roofline" >&2
        exit 2
        ;;
esac
cat "$OUT/steps.txt"
