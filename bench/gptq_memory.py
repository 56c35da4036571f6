"""Peak memory of GPTQ W4 g128 (or QAT's layer phase) on a 1B-parameter checkpoint streamed one
decoder layer at a time.

Makes a synthetic checkpoint of TinyLlama-1.1B's shape (random bf16 weights, 2.2 GB on disk, 1.10B
parameters: hidden 2048, FFN 5632, 22 layers, 32 query / 4 key-value heads, vocab 32000), then runs
the streaming GPTQ (``quant.gptq_model``) on 32 windows of 512 random token ids in a child process
and prints its peak RSS (its own ru_maxrss plus the largest of any worker process's), its seconds,
and PASS/FAIL against 4 GiB: one layer in float32, its Hessians and activations, plus a fixed
overhead. Each layer's results are dropped once handed out, as a recipe writes them to disk until
its export (formats/variant_weights.py); their size is printed beside.

GPTQ of a 1B layer takes minutes on 2 cores, so ``--layers N`` (default 3) stops the walk after N
layers; every layer has the same shapes, so the peak is reached by then (the peak after each layer
is printed to show it). ``--layers 22`` runs the whole model.

``--method qat`` runs QAT's layer-by-layer phase (``quant.qat``, W4 g128 asymmetric) instead, for
``--qat-steps`` optimizer steps per layer (default 5): its memory is the float layer, the
calibration inputs and the float layer's outputs on them, the trainable weights with AdamW's two
moments, and one batch's activations for the backward pass, all there from the first step.

    python bench/gptq_memory.py [--method gptq|qat] [--layers N] [--qat-steps N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gguf_memory import make_checkpoint  # noqa: E402  (a sibling script)

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 64,
    "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
}
WINDOWS, WINDOW = 32, 512
LIMIT_MIB = 4096

# Runs the streaming GPTQ (or QAT) over the first N layers, printing progress on stderr, then one JSON line:
# [own peak RSS KiB, largest worker peak RSS KiB, seconds, layers done, bytes of the payloads handed out].
_WALK_AND_REPORT_PEAKS = """
import itertools, json, resource, sys, time
import torch
from core.schemes import QuantSpec
from formats.hf import HFCheckpoint
from quant.gptq_model import gptq_model

from quant.qat import QATSettings, qat_model

model, layers, windows, window, method, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
ckpt = HFCheckpoint.open(model)
ids = torch.randint(0, ckpt.config["vocab_size"], (windows, window), generator=torch.Generator().manual_seed(0))
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start, done, payload = time.perf_counter(), 0, 0
if method == "gptq":
    walk = ({n: r.tensor for n, r in results.items()} for results in gptq_model(ckpt, ids, QuantSpec(4, True, "group", 128)))
else:
    walk = (layer.tensors for layer in qat_model(ckpt, ids, QuantSpec(4, False, "group", 128), QATSettings(steps=steps)))
for results in itertools.islice(walk, layers):
    payload += sum(t.nbytes for r in results.values() if hasattr(r, "codes") for t in (r.codes, r.scales, r.zeros))
    done += 1
    print(f"layer {done - 1}: {time.perf_counter() - start:.0f} s, peak RSS so far {peak() / 1024:.0f} MiB", file=sys.stderr, flush=True)
seconds = time.perf_counter() - start
print(json.dumps([peak(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, seconds, done, payload]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3, help="decoder layers to quantize before the walk stops (default 3 of 22)")
    parser.add_argument("--keep", type=Path, help="keep the synthetic checkpoint here (reused when present)")
    parser.add_argument("--method", choices=["gptq", "qat"], default="gptq")
    parser.add_argument("--qat-steps", type=int, default=5, help="QAT's optimizer steps per layer")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gptq_memory_"))
    model = args.keep or work / "synthetic-1b"
    if not (model / "config.json").is_file():
        start = time.perf_counter()
        params = make_checkpoint(model, CONFIG)
        print(f"synthetic checkpoint: {params / 1e9:.2f}B params in {time.perf_counter() - start:.0f} s")
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    cmd = [sys.executable, "-c", _WALK_AND_REPORT_PEAKS, str(model), str(args.layers), str(WINDOWS), str(WINDOW),
           args.method, str(args.qat_steps)]
    done = subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.PIPE, text=True)
    own_kb, workers_kb, seconds, layers, payload = json.loads(done.stdout.strip().splitlines()[-1])
    peak_mb = (own_kb + workers_kb) / 1024
    total = CONFIG["num_hidden_layers"]
    print(f"checkpoint on disk: {size / 2**20:.0f} MiB bf16; the whole model in float32 (as loading it for "
          f"calibration used to take): {2 * size / 2**20:.0f} MiB")
    what = "GPTQ W4 g128 sym" if args.method == "gptq" else f"QAT's layer phase W4 g128 asym, {args.qat_steps} steps per layer"
    print(f"{what}, {WINDOWS} windows of {WINDOW} tokens: quantized {layers} of {total} decoder layers "
          f"(the walk stops there), {seconds:.0f} s ({seconds / max(layers, 1):.0f} s per layer)")
    print(f"payloads handed out: {payload / 2**20:.0f} MiB for {layers} layers, dropped here; a recipe writes them "
          f"to disk until its export, about {payload / max(layers, 1) * total / 2**20:.0f} MiB for all {total}")
    print(f"peak RSS: process {own_kb / 1024:.0f} MiB + workers {workers_kb / 1024:.0f} MiB = {peak_mb:.0f} MiB; "
          f"target < {LIMIT_MIB} MiB: {'PASS' if peak_mb < LIMIT_MIB else 'FAIL'}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
