"""``quantize fit``'s llama.cpp prediction against a real llama.cpp run, on the CPU.

For three configurations of the shared models (GGUF files exported by quantbench, run by
llama-cpp-python with flash attention), a child process records its resident memory just before
the model is loaded, then loads it, evaluates a prompt that fills the context but for a few tokens,
generates those, and reports its peak resident memory. The growth (peak minus before) is what the
run needed: the weights (memory mapped, all read during inference), the KV cache, the compute
buffer and the batch of logits the runtime hands out. The prediction is the calculator's weights +
KV cache + activations (compute buffer and logits) for the same file, context and cache type,
without the GPU runtime overhead it adds on a GPU (CUDA context), which has no CPU counterpart.
Target: within 10%.

    python bench/fit_runtime.py [--models DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (model folder name, GGUF file type, context tokens, KV-cache type)
CONFIGS = [("ref", "Q8_0", 8192, "fp16"), ("ref", "F16", 16384, "int8"), ("tiny", "F16", 8192, "int4")]
_GGML_KV = {"fp16": 1, "int8": 8, "int4": 2}  # ggml type ids for llama.cpp's cache: F16, Q8_0, Q4_0

CHILD = r"""
import json, sys
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from llama_cpp import Llama
path, n_ctx, kv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
before = status("VmRSS:")
llm = Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn=True, type_k=kv, type_v=kv, n_threads=2, verbose=False)
prompt = [10 + i % 4000 for i in range(n_ctx - 16)]  # fill the context: every KV cell and the whole mask in use
llm.eval(prompt)
for _ in range(8):
    llm.eval([llm.sample()])
print(json.dumps({"before": before, "peak": status("VmHWM:")}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=REPO.parent / "shared" / "models")
    args = parser.parse_args()

    from formats.hf import HFCheckpoint
    from recipes.variants import build_variant, gguf_variant
    from runner.memfit import ENGINES, kv_bytes_per_sequence, weights_bytes
    from runner.model_shape import load_model_shape

    folders = {"ref": args.models / "ref", "tiny": REPO / "recipes" / "bundled" / "tiny"}
    tmp = Path(tempfile.mkdtemp(prefix="fit_runtime_"))
    engine = ENGINES["llamacpp"]
    worst = 0.0
    print(f"{'model':<6}{'type':<8}{'context':>8}{'KV':>6}{'weights':>10}{'KV MiB':>9}{'compute':>9}{'predicted':>11}{'measured':>10}{'error':>8}")
    for model, file_type, context, kv in CONFIGS:
        path = tmp / f"{model}-{file_type}.gguf"
        build_variant(HFCheckpoint.open(folders[model]), gguf_variant(file_type), tmp, keep_weights=False, gguf_path=path)
        shape = load_model_shape(str(path))
        weights = weights_bytes(shape, file_type)
        cache = kv_bytes_per_sequence(shape, kv, context)
        compute = engine.activations(shape, 1, context, 1)
        predicted = weights + cache + compute
        run = subprocess.run([sys.executable, "-c", CHILD, str(path), str(context), str(_GGML_KV[kv])],
                             capture_output=True, text=True, check=True)
        m = json.loads(run.stdout.strip().splitlines()[-1])
        measured = m["peak"] - m["before"]
        error = predicted / measured - 1
        worst = max(worst, abs(error))
        mib = 2**20
        print(f"{model:<6}{file_type:<8}{context:>8}{kv:>6}{weights / mib:>10.1f}{cache / mib:>9.1f}{compute / mib:>9.1f}"
              f"{predicted / mib:>11.1f}{measured / mib:>10.1f}{100 * error:>+7.1f}%", flush=True)
    print(f"largest error {100 * worst:.1f}% (target within 10%): {'PASS' if worst <= 0.10 else 'FAIL'}")


if __name__ == "__main__":
    main()
