"""HF checkpoint -> GGUF (default Q4_K_M): quantbench's one step against llama.cpp's path.

Baseline, measured in the same run with the same thread count: llama.cpp's path, that is an F32
GGUF of the checkpoint (written by quantbench's F32 export, standing in for llama.cpp's
convert_hf_to_gguf.py, which ships only in llama.cpp's source tree) followed by llama.cpp's own
quantizer (`llama_model_quantize`, what `llama-quantize` runs). Prints both times and the ratio
(ours / baseline; the target is at most 1.5, the goal below 1) and checks the two files agree.
Each side runs ``--repeat`` times, alternating, and the fastest run of each counts, so that a
busy moment on a shared machine does not decide the ratio.

    python bench/gguf_speed.py [--model DIR] [--type Q4_K_M] [--threads 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # tests/helpers: llama.cpp's own quantizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_model = REPO.parent / "shared" / "models" / "ref"
    parser.add_argument("--model", type=Path, default=default_model if default_model.is_dir() else REPO / "recipes/bundled/tiny")
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import torch
    from gguf import GGUFReader

    from helpers.ggml_oracle import llama_quantize_file
    from formats.hf import HFCheckpoint
    from core.file_types import FILE_TYPES
    from recipes.variants import build_variant, gguf_variant

    # quantbench uses the cores it may run on: pin both sides to the same --threads cores.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="gguf_speed_"))
    ckpt = HFCheckpoint.open(args.model)

    def timed(run) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    runs = []
    for _ in range(args.repeat):
        ours = timed(lambda: build_variant(ckpt, gguf_variant(args.type), tmp, gguf_path=tmp / "ours.gguf"))
        convert = timed(lambda: build_variant(ckpt, gguf_variant("F32"), tmp, gguf_path=tmp / "f32.gguf"))
        quantize = timed(lambda: llama_quantize_file(tmp / "f32.gguf", tmp / "llama.gguf", FILE_TYPES[args.type].id, nthread=args.threads))
        runs.append((ours, convert, quantize))
    ours = min(r[0] for r in runs)
    convert, quantize = min((r[1:] for r in runs), key=sum)
    baseline = convert + quantize

    a = {t.name: (t.tensor_type, bytes(t.data)) for t in GGUFReader(tmp / "ours.gguf").tensors}
    b = {t.name: (t.tensor_type, bytes(t.data)) for t in GGUFReader(tmp / "llama.gguf").tensors}
    same = sum(a[k] == b[k] for k in b)
    params = sum(int(torch.Size(ckpt.shape(n)).numel()) for n in ckpt.names)
    print(f"model {args.model} ({params / 1e6:.1f}M params), {args.type}, {args.threads} threads, best of {args.repeat}")
    print(f"quantbench HF -> {args.type}:                {ours:8.2f} s")
    print(f"llama.cpp path (baseline): F32 GGUF {convert:.2f} s + quantize {quantize:.2f} s = {baseline:8.2f} s")
    print(f"ratio quantbench / llama.cpp path: {ours / baseline:.2f} (target <= 1.5)")
    print(f"tensors identical to llama.cpp's: {same}/{len(b)}")


if __name__ == "__main__":
    main()
