"""Seconds of a recipe's stages on a model of Llama-3-8B's shape, measured on this machine's
hardware (a GPU when torch sees one) and extrapolated to 32 decoder layers.

Makes synthetic checkpoints of Llama-3-8B's body (hidden 4096, FFN 14336, 32 query / 8 key-value
heads of 128; random bf16 weights) with the bundled tokenizer's 8192-token vocabulary, cut to 1
and to N decoder layers (default 2), and times on each, in this process, one stage after another:

- RTN int4 g128 with a compressed-tensors export;
- GPTQ W4 g128, fitted on 16 calibration windows of 128 tokens, with a GPTQ export;
- the importance matrix on the same windows, then Q4_K_M with it, with a GGUF export;
- the evaluation of the original on 32 windows of 128 tokens.

A stage's cost per layer is the difference between its two runs over the layers between them;
what remains of the 1-layer run is its fixed cost (embedding, head, tokenizer, set-up), and the
32-layer estimate is the fixed cost plus 32 times the per-layer one, as bench/recipe_memory.py
extrapolates memory. The 8192-token vocabulary keeps the head and embedding small beside the
layers (Llama 3's own 128256 adds a fixed cost on the embedding, head and evaluation logits).
The device is warmed up (CUDA context, cuBLAS and cuSOLVER handles) before the first timing, so
no stage's fixed cost holds it. Each row is written to ``--out`` (JSON lines) as soon as it is
measured, so a run cut short keeps what it measured.

``--shape small`` runs the bundled tiny model's shape (hidden 256, 6 layers), a CPU smoke run of a
few seconds.

    python bench/recipe_gpu.py [--shape 8b|small] [--layers N] [--stages rtn,gptq,gguf,eval] [--out rows.jsonl] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_memory import make_checkpoint  # noqa: E402  (a sibling script)
from recipe_memory import LLAMA3  # noqa: E402

BUNDLED = REPO / "recipes" / "bundled"
SHAPES = {
    "8b": LLAMA3 | {"vocab_size": 8192},
    "small": LLAMA3 | {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192},
}
TARGET_LAYERS = 32  # what the estimate is for, whatever the shape's own depth
EVAL_WINDOWS, CALIBRATION_WINDOWS, WINDOW = 32, 16, 128
VARIANTS = {
    "rtn": {"name": "rtn-int4-g128", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 128},
            "exports": ["compressed-tensors"]},
    "gptq": {"name": "gptq-w4g128", "weights": {"method": "gptq", "bits": 4, "group_size": 128}, "exports": ["gptq"]},
    "q4_k_m": {"name": "q4_k_m-imatrix", "weights": {"method": "gguf", "type": "Q4_K_M", "imatrix": True},
               "exports": ["gguf"]},
}


def warm_up() -> str:
    """Start the device's libraries before anything is timed; the device, in words."""
    import torch

    from core.device import working_device

    device = working_device()
    a = torch.randn(256, 256, device=device)
    torch.linalg.cholesky(a @ a.T + 256 * torch.eye(256, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()
        return f"cuda: {torch.cuda.get_device_name()}"
    return f"cpu: {torch.get_num_threads()} threads"


def checkpoint(work: Path, config: dict, layers: int, keep: Path | None) -> Path:
    """The synthetic checkpoint cut to ``layers`` layers, made unless ``keep`` holds it already."""
    cut = config | {"num_hidden_layers": layers}
    model = (keep or work) / f"synthetic-{cut['hidden_size']}-{layers}"
    if not (model / "config.json").is_file() or json.loads((model / "config.json").read_text()) != cut:
        shutil.rmtree(model, ignore_errors=True)
        make_checkpoint(model, cut)
    return model


STAGE_GROUPS = ("rtn", "gptq", "gguf", "eval")


def stages(model: Path, out: Path) -> dict[str, dict[str, Callable[[], object]]]:
    """Each stage of the recipe on the checkpoint at ``model``, writing under ``out``, in order, by
    the ``--stages`` name that picks it."""
    from calib.text import sample_windows, token_windows
    from evalsuite.streamed import streamed_scores
    from formats.hf import HFCheckpoint, load_tokenizer
    from recipes.importance import model_imatrix
    from recipes.schema import Variant
    from recipes.variants import build_variant

    ckpt = HFCheckpoint.open(model)
    tokenizer = load_tokenizer(ckpt)
    calibration = sample_windows(tokenizer, BUNDLED / "calib.txt", WINDOW, CALIBRATION_WINDOWS)
    windows = token_windows(tokenizer, BUNDLED / "eval.txt", WINDOW, EVAL_WINDOWS)
    variants = {k: Variant.model_validate(v) for k, v in VARIANTS.items()}
    imatrix: dict = {}

    def q4_k_m() -> None:
        build_variant(ckpt, variants["q4_k_m"], out, imatrix=imatrix, calibration=calibration)

    return {
        "rtn": {"rtn int4 g128 + compressed-tensors": lambda: build_variant(ckpt, variants["rtn"], out)},
        "gptq": {"gptq w4 g128 + export": lambda: build_variant(ckpt, variants["gptq"], out, calibration=calibration)},
        "gguf": {"importance matrix": lambda: imatrix.update(model_imatrix(ckpt, calibration)),
                 "q4_k_m imatrix + gguf": q4_k_m},
        "eval": {f"evaluation, {len(windows)} windows": lambda: streamed_scores(ckpt, windows)},
    }


def timed(run: Callable[[], object]) -> dict:
    """The stage's seconds, and on a GPU its peak of allocated GPU memory."""
    import torch

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run()
    if gpu:
        torch.cuda.synchronize()
    took = {"seconds": round(time.perf_counter() - start, 3)}
    return took | ({"gpu_peak_mib": round(torch.cuda.max_memory_allocated() / 2**20)} if gpu else {})


def measure(work: Path, config: dict, cuts: list[int], keep: Path | None, chosen: list[str],
            record: Callable[[dict], None]) -> dict:
    """Seconds by stage and cut for the ``chosen`` stage groups, each recorded as measured."""
    seconds: dict[str, dict[int, float]] = {}
    for layers in cuts:
        model = checkpoint(work, config, layers, keep)
        out = work / f"out-{layers}"
        groups = stages(model, out)
        for stage, run in ((s, r) for g in chosen for s, r in groups[g].items()):
            took = timed(run)
            seconds.setdefault(stage, {})[layers] = took["seconds"]
            record({"stage": stage, "layers": layers} | took)
        shutil.rmtree(out, ignore_errors=True)
    return seconds


def extrapolate(by_cut: dict[int, float], target: int) -> tuple[float, float, float]:
    """(per layer, fixed, at ``target`` layers) from a stage's seconds at two cuts."""
    (few, t_few), (many, t_many) = sorted(by_cut.items())
    per_layer = max((t_many - t_few) / (many - few), 0.0)
    fixed = max(t_few - per_layer * few, 0.0)
    return per_layer, fixed, fixed + per_layer * target


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the larger cut (the smaller has 1)")
    parser.add_argument("--out", type=Path, help="append each row here as a JSON line as it is measured")
    parser.add_argument("--keep", type=Path, help="keep the synthetic checkpoints here (reused when present)")
    parser.add_argument("--stages", default=",".join(STAGE_GROUPS), help=f"which stages, of {','.join(STAGE_GROUPS)}")
    args = parser.parse_args(argv)
    chosen = args.stages.split(",")
    if not chosen or set(chosen) - set(STAGE_GROUPS):
        parser.error(f"--stages: a comma-separated list of {', '.join(STAGE_GROUPS)}")
    if args.layers < 2:
        parser.error("--layers: at least 2 (the per-layer cost is the difference from 1 layer)")
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")

    record({"device": warm_up(), "shape": args.shape})
    work = Path(tempfile.mkdtemp(prefix="recipe_gpu_"))
    try:
        seconds = measure(work, SHAPES[args.shape], [1, args.layers], args.keep, chosen, record)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    whole = 0.0
    print(f"\n{'stage':36s} {'per layer s':>12s} {'fixed s':>9s} {f'at {TARGET_LAYERS} s':>9s}")
    for stage, by_cut in seconds.items():
        per_layer, fixed, estimate = extrapolate(by_cut, TARGET_LAYERS)
        whole += estimate
        record({"stage": stage, "per_layer_s": round(per_layer, 3), "fixed_s": round(fixed, 3),
                f"at_{TARGET_LAYERS}_layers_s": round(estimate, 1)})
        print(f"{stage:36s} {per_layer:12.2f} {fixed:9.2f} {estimate:9.1f}")
    record({"stage": "whole recipe", f"at_{TARGET_LAYERS}_layers_s": round(whole, 1)})
    complete = args.shape == "8b" and len(chosen) == len(STAGE_GROUPS)
    verdict = f"; target < 15 min on an H200: {'PASS' if whole < 15 * 60 else 'FAIL'}" if complete else ""
    print(f"\nwhole recipe extrapolated to {TARGET_LAYERS} layers: {whole:.0f} s ({whole / 60:.1f} min{verdict})")
    return rows


if __name__ == "__main__":
    main()
