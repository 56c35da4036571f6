"""HF checkpoint -> GGUF (default Q4_K_M): quantbench's one step against llama.cpp's path.

Baseline, measured in the same run with the same thread count: llama.cpp's path, that is an F32
GGUF of the checkpoint (written by quantbench's F32 export, standing in for llama.cpp's
convert_hf_to_gguf.py, which ships only in llama.cpp's source tree) followed by llama.cpp's own
quantizer (`llama_model_quantize`, what `llama-quantize` runs). Prints both times and the ratio
(ours / baseline; the target is at most 1.5, the goal below 1) and checks the two files agree.
Each side runs ``--repeat`` times, alternating, and the fastest run of each counts, so that a
busy moment on a shared machine does not decide the ratio.

Several ``--types`` make one row each, i-quants included. The types llama.cpp quantizes only with an
importance matrix (IQ3_XXS, IQ2_*, IQ1_*) get one, and ``--imatrix`` gives it to every type: the
matrix is measured once on the calibration text, before timing, and both sides quantize with it.

``--encoders`` times the block encoders alone instead, one process pinned to one core, on a
512x1024 Gaussian tensor with an importance matrix: µs per weight, ours against llama.cpp's
``ggml_quantize_chunk`` on the same tensor, and their ratio.

    python bench/gguf_speed.py [--model DIR] [--types Q4_K_M IQ4_XS IQ3_S IQ2_XS] [--imatrix]
                               [--threads 2] [--repeat 3] [--encoders]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
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
    parser.add_argument("--types", nargs="+", default=["Q4_K_M"])
    parser.add_argument("--imatrix", action="store_true", help="an importance matrix for every type, not only those that need one")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--encoders", action="store_true", help="the ggml types' block encoders alone, on one core")
    args = parser.parse_args()
    if args.encoders:
        encoder_speed(args.types, args.repeat)
        return

    import torch
    from gguf import GGUFReader

    from helpers.ggml_oracle import llama_quantize_file
    from calib.text import token_windows
    from core.errors import InputError
    from core.file_types import FILE_TYPES
    from formats.gguf import gguf_name
    from formats.hf import HFCheckpoint, load_tokenizer
    from recipes.importance import model_imatrix
    from recipes.variants import build_variant, gguf_variant, plan_variant

    unknown = [t for t in args.types if t not in FILE_TYPES]
    if unknown:
        parser.error(f"--types: unknown GGUF file type {unknown[0]!r}")
    # quantbench uses the cores it may run on: pin both sides to the same --threads cores.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="gguf_speed_"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # its GGUF files are scratch: none left behind
    ckpt = HFCheckpoint.open(args.model)
    params = sum(int(torch.Size(ckpt.shape(n)).numel()) for n in ckpt.names)

    def needs_imatrix(file_type: str) -> bool:
        """Whether llama.cpp refuses this file type of the model without an importance matrix, as our planner does."""
        try:
            plan_variant(ckpt, gguf_variant(file_type))
        except InputError:
            return True
        return False

    weighted = {t for t in args.types if args.imatrix or needs_imatrix(t)}
    imatrix = None
    if weighted:
        windows = token_windows(load_tokenizer(ckpt), REPO / "recipes" / "bundled" / "calib.txt", 512, 8)
        imatrix = model_imatrix(ckpt, windows)
    print(f"model {args.model} ({params / 1e6:.1f}M params), {args.threads} threads, best of {args.repeat}; "
          f"baseline: llama.cpp's path (our F32 GGUF, then llama_model_quantize)")
    print(f"{'type':8} {'imatrix':7} {'ours s':>7} {'F32 s':>6} {'quant s':>7} {'ratio':>6}  identical")

    def timed(run) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    for file_type in args.types:
        matrix = imatrix if file_type in weighted else None
        by_gguf_name = {gguf_name(n, ckpt.arch): v for n, v in matrix.items()} if matrix else None
        runs = []
        for _ in range(args.repeat):
            ours = timed(lambda: build_variant(ckpt, gguf_variant(file_type, matrix is not None), tmp, imatrix=matrix,
                                               gguf_path=tmp / "ours.gguf"))
            convert = timed(lambda: build_variant(ckpt, gguf_variant("F32"), tmp, gguf_path=tmp / "f32.gguf"))
            quantize = timed(lambda: llama_quantize_file(tmp / "f32.gguf", tmp / "llama.gguf", FILE_TYPES[file_type].id,
                                                         imatrix=by_gguf_name, nthread=args.threads))
            runs.append((ours, convert, quantize))
        ours = min(r[0] for r in runs)
        convert, quantize = min((r[1:] for r in runs), key=sum)
        a = {t.name: (t.tensor_type, bytes(t.data)) for t in GGUFReader(tmp / "ours.gguf").tensors}
        b = {t.name: (t.tensor_type, bytes(t.data)) for t in GGUFReader(tmp / "llama.gguf").tensors}
        same = sum(a.get(k) == b[k] for k in b)
        print(f"{file_type:8} {'yes' if matrix else 'no':7} {ours:7.2f} {convert:6.2f} {quantize:7.2f} "
              f"{ours / (convert + quantize):6.2f}  {same}/{len(b)}", flush=True)
    print("ratio: quantbench's time over llama.cpp's path (F32 + quantize); target <= 1.5")


def encoder_speed(types: list[str], repeat: int) -> None:
    """µs per weight of each type's encoder and of llama.cpp's on one core, best of ``repeat``."""
    import numpy as np

    from helpers.ggml_oracle import ggml_quantize
    from quant.ggml.types import type_named

    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])  # one core: no encoder workers either
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((512, 1024)) * 0.02).astype(np.float32)
    qw = rng.random(1024).astype(np.float32) + 0.1
    print(f"512x1024 Gaussian with an importance matrix, one core, best of {repeat}; baseline: llama.cpp's ggml_quantize_chunk")
    for name in types:
        encoder = type_named(name)
        encoder.quantize(x[:1], qw)  # grids and tables built once, outside the timing
        ours, theirs = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            encoder.quantize(x, qw)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            ggml_quantize(x, name, qw)
            theirs.append(time.perf_counter() - start)
        a, b = min(ours) / x.size * 1e6, min(theirs) / x.size * 1e6
        print(f"{name:8} ours {a:.2f} µs/weight, llama.cpp {b:.2f}, ratio {a / b:.2f}", flush=True)


if __name__ == "__main__":
    main()
