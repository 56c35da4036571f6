"""``quantize fit``'s memory prediction against real inference runs of the shared models, on the CPU.

llama.cpp (llama-cpp-python, flash attention, GGUF files exported by quantbench): a child process
records its resident memory just before the model is loaded, then loads it, evaluates a prompt that
fills the context but for a few tokens, generates those, and reports its peak resident memory. The
growth (peak minus before) is what the run needed: the weights (memory mapped, all read during
inference), the KV cache, the compute buffer, and the runtime's own host structures (tokenizer,
ggml contexts, threads). The prediction is the calculator's weights + KV cache + compute buffer for
the same file, context and cache type, plus those host structures, measured in the same run as the
growth of a second child that only creates a 256-token context, less its weights and KV cache (on
a GPU they stay in host memory, and the calculator's overhead is the CUDA context instead).

transformers (``generate`` of 8 tokens after a batch of prompts that fill the context): the
measurement is the peak of live tensor bytes, parameters included, which is what
``torch.cuda.max_memory_allocated`` reports on a GPU; a ``TorchDispatchMode`` tracks every tensor
an operator returns until it is freed. (Resident memory on a CPU is higher: its bfloat16 matrix
products convert through float32 buffers that a GPU does not need.) The prediction is weights + KV
cache (in the model's dtype) + the transformers profile's activations, without the 0.5 GiB runtime
overhead.

Target: within 10% for every configuration.

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

# (engine, model folder name, weights: GGUF file type or torch dtype, users, context tokens, KV-cache type)
CONFIGS = [
    ("llamacpp", "ref", "Q8_0", 1, 8192, "fp16"),
    ("llamacpp", "ref", "F16", 1, 16384, "int8"),
    ("llamacpp", "tiny", "F16", 1, 8192, "int4"),
    ("transformers", "ref", "bf16", 4, 2048, "bf16"),
    ("transformers", "ref", "fp32", 2, 2048, "fp32"),
    ("transformers", "tiny", "bf16", 8, 1024, "bf16"),
    ("transformers", "wide", "bf16", 4, 1024, "bf16"),  # random weights, intermediate 5.3x hidden (the others: 3x)
]
# A Qwen2-shaped model (q/k/v biases, tied embeddings) whose MLP is wider than the shared models'.
WIDE = {"model_type": "qwen2", "hidden_size": 384, "intermediate_size": 2048, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 8192, "tie_word_embeddings": True,
        "max_position_embeddings": 4096}
_GGML_KV = {"fp16": 1, "int8": 8, "int4": 2}  # ggml type ids for llama.cpp's cache: F16, Q8_0, Q4_0
HOST_CONTEXT = 256

LLAMACPP = r"""
import json, sys
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from llama_cpp import Llama
path, n_ctx, kv, host = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "host"
before = status("VmRSS:")
llm = Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn=True, type_k=kv, type_v=kv, n_threads=2, verbose=False)
if host:  # the host baseline: weights and cache are in place, nothing computed yet
    print(json.dumps({"bytes": status("VmRSS:") - before}))
    sys.exit()
prompt = [10 + i % 4000 for i in range(n_ctx - 16)]  # fill the context: every KV cell and the whole mask in use
llm.eval(prompt)
for _ in range(8):
    llm.eval([llm.sample()])
print(json.dumps({"bytes": status("VmHWM:") - before}))
"""

TRANSFORMERS = r"""
import json, sys, weakref
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM
torch.set_num_threads(2)
path, dtype, users, context = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(path, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
params = sum(p.untyped_storage().nbytes() for p in {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values())
live = {"now": 0, "peak": 0}
owners, sizes = {}, {}
def release(key):
    owners[key] -= 1
    if not owners[key]:
        live["now"] -= sizes.pop(key)
        del owners[key]
class LiveTensors(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key == 0 or key in held:
                    continue
                if key not in sizes:
                    sizes[key] = t.untyped_storage().nbytes()
                    owners[key] = 0
                    live["now"] += sizes[key]
                owners[key] += 1
                weakref.finalize(t, release, key)
        live["peak"] = max(live["peak"], live["now"])
        return out
ids = (torch.arange(users * (context - 8)).reshape(users, context - 8) * 7 + 10) % 4000
with torch.inference_mode(), LiveTensors():
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False)
print(json.dumps({"bytes": params + live["peak"]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=REPO.parent / "shared" / "models")
    args = parser.parse_args()

    from formats.hf import HFCheckpoint
    from recipes.variants import build_variant, gguf_variant
    from runner.fit.memfit import ENGINES, kv_bytes_per_sequence, weights_bytes
    from runner.fit.model_shape import load_model_shape

    tmp = Path(tempfile.mkdtemp(prefix="fit_runtime_"))
    folders = {"ref": args.models / "ref", "tiny": REPO / "recipes" / "bundled" / "tiny", "wide": _wide_model(tmp / "wide")}
    worst = 0.0
    mib = 2**20
    print(f"{'engine':<13}{'model':<6}{'weights':<8}{'users':>6}{'context':>8}{'KV':>6}{'weights MiB':>12}{'KV MiB':>9}"
          f"{'act MiB':>9}{'host':>6}{'predicted':>11}{'measured':>10}{'error':>8}")
    for engine, model, fmt, users, context, kv in CONFIGS:
        if engine == "llamacpp":
            path = tmp / f"{model}-{fmt}.gguf"
            build_variant(HFCheckpoint.open(folders[model]), gguf_variant(fmt), tmp, gguf_path=path)
            child = [LLAMACPP, str(path), str(context), str(_GGML_KV[kv]), "run"]
            shape = load_model_shape(str(path))
        else:
            child = [TRANSFORMERS, str(folders[model]), fmt, str(users), str(context)]
            shape = load_model_shape(str(folders[model]))
        weights = weights_bytes(shape, fmt)
        cache = users * kv_bytes_per_sequence(shape, kv, context)
        activations = ENGINES[engine].activations(shape, users, context, 1, 4 if fmt == "fp32" else 2)
        host = 0
        if engine == "llamacpp":
            baseline = [LLAMACPP, str(path), str(HOST_CONTEXT), str(_GGML_KV[kv]), "host"]
            host = _run(baseline) - weights - kv_bytes_per_sequence(shape, kv, HOST_CONTEXT)
        predicted = weights + cache + activations + host
        measured = _run(child)
        error = predicted / measured - 1
        worst = max(worst, abs(error))
        print(f"{engine:<13}{model:<6}{fmt:<8}{users:>6}{context:>8}{kv:>6}{weights / mib:>12.1f}{cache / mib:>9.1f}"
              f"{activations / mib:>9.1f}{host / mib:>6.1f}{predicted / mib:>11.1f}{measured / mib:>10.1f}{100 * error:>+7.1f}%", flush=True)
    print(f"largest error {100 * worst:.1f}% (target within 10%): {'PASS' if worst <= 0.10 else 'FAIL'}")


def _run(child: list[str]) -> int:
    run = subprocess.run([sys.executable, "-c", *child], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])["bytes"]


def _wide_model(folder: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = dict(WIDE)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config)).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    main()
