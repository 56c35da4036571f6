"""``quantize fit``'s decode ceiling against llama.cpp decoding on this machine's CPU.

The calculator bounds decode speed by memory bandwidth: a token reads every active weight and the
sequence's KV cache once, so tokens/s <= bandwidth / bytes. The baseline here is the bandwidth
measured in the same run (a 1 GiB float32 sum with the same thread count), given to the calculator
as ``custom:MEM,BANDWIDTH``; the model is a synthetic 1.06B-parameter Llama (bench/gguf_memory.py's,
large enough that its weights stream from memory, not cache) exported by quantbench to GGUF. A
ceiling holds when llama.cpp's measured decode speed stays at or below it; the ratio shows how much
of the bandwidth llama.cpp turns into tokens on these cores.

    python bench/fit_speed.py [--threads 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

TYPES = ["F16", "Q8_0"]

# Decodes 32 tokens after a 16-token prompt; prints the median seconds per token.
DECODE = r"""
import json, statistics, sys, time
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=512, n_batch=512, n_threads=int(sys.argv[2]), verbose=False)
llm.eval(list(range(10, 26)))
times = []
for i in range(32):
    start = time.perf_counter()
    llm.eval([100 + i])
    times.append(time.perf_counter() - start)
print(json.dumps({"seconds_per_token": statistics.median(times)}))
"""


def read_bandwidth(threads: int) -> float:
    """Bytes per second of a streaming read: the best of ten sums over 1 GiB of float32, after one
    to fault the pages in. The best, since a ceiling must not be set by a slow moment."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(256 * 2**20)
    x.sum()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="keep the synthetic checkpoint and GGUF files here (reused when present)")
    args = parser.parse_args()

    from formats.hf import HFCheckpoint
    from gguf_memory import make_checkpoint
    from recipes.variants import build_variant, gguf_variant
    from runner.fit.gpus import resolve_gpu
    from runner.fit.memfit import ENGINES, FitQuery, fit
    from runner.fit.model_shape import load_model_shape

    work = args.keep or Path(tempfile.mkdtemp(prefix="fit_speed_"))
    checkpoint = work / "checkpoint"
    if not (checkpoint / "config.json").is_file():
        make_checkpoint(checkpoint)
    bandwidth = read_bandwidth(args.threads)
    device = resolve_gpu(f"custom:64,{bandwidth / 1e9:.2f}")
    print(f"measured read bandwidth ({args.threads} threads): {bandwidth / 1e9:.1f} GB/s", flush=True)
    print(f"{'file':<8}{'GiB':>7}{'ceiling tok/s':>15}{'llama.cpp tok/s':>17}{'measured/ceiling':>18}")
    worst = 0.0
    for file_type in TYPES:
        path = work / f"synthetic-{file_type}.gguf"
        if not path.is_file():
            build_variant(HFCheckpoint.open(checkpoint), gguf_variant(file_type), work, gguf_path=path)
        shape = load_model_shape(str(path))
        query = FitQuery(file_type, 128, "fp16", 48, 1, device, 1, ENGINES["llamacpp"])
        result = fit(shape, query, smallest=False)
        run = subprocess.run([sys.executable, "-c", DECODE, str(path), str(args.threads)], capture_output=True, text=True, check=True)
        measured = 1 / json.loads(run.stdout.strip().splitlines()[-1])["seconds_per_token"]
        ratio = measured / result.decode_tokens_per_s_max
        worst = max(worst, ratio)
        print(f"{file_type:<8}{result.weights_bytes / 2**30:>7.2f}{result.decode_tokens_per_s_max:>15.1f}{measured:>17.1f}{ratio:>18.2f}",
              flush=True)
    print(f"highest measured/ceiling {worst:.2f} (a ceiling holds at <= 1.05): {'PASS' if worst <= 1.05 else 'FAIL'}")


if __name__ == "__main__":
    main()
