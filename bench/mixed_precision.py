"""``type: auto`` against llama.cpp's file types at their sizes, measured by llama.cpp itself.

For each model (default: the bundled tiny one, and ref where shared/models/ref exists) and each
file type (default Q3_K_M, Q4_K_S, Q4_K_M), both files made with the same importance matrix (ours,
from the bundled calibration text): llama.cpp's file type as our byte-identical export writes it,
and our ``type: auto`` file whose budget is that file's bytes of tensor data. ``llama-perplexity
--kl-divergence`` measures each against the F32 file's logits on the evaluation text: mean KL
divergence, top-1 agreement ("Same top p") and perplexity. Prints a table and the ratio of KL
divergences (the issue's targets: at most 0.8 at Q3_K_M's size, 0.9 at Q4_K_S's and Q4_K_M's), and
writes a size-against-KLD chart (docs/img/mixed_precision.svg). An auto file is made for each
``--sensitivity`` (default both: each tensor's added KL divergence measured, one evaluation pass per
tensor, or estimated from Fisher diagonals, one forward and backward walk), with the seconds its
build took.

Needs the native tools: ``bash bench/anchors/setup.sh llama-tools``.

    python bench/mixed_precision.py [--models tiny,ref] [--types Q3_K_M,Q4_K_S,Q4_K_M] [--ctx 256]
                                    [--sensitivity kld,fisher]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PERPLEXITY = REPO / ".anchors" / "llama-tools" / "bin" / "llama-perplexity"
MODELS = {"tiny": REPO / "recipes" / "bundled" / "tiny", "ref": REPO.parent / "shared" / "models" / "ref"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,ref")
    parser.add_argument("--types", default="Q3_K_M,Q4_K_S,Q4_K_M")
    parser.add_argument("--ctx", type=int, default=256, help="llama-perplexity's context (and chunk) length")
    parser.add_argument("--sensitivity", default="kld,fisher", help="the auto files' sensitivities: kld, fisher, proxy")
    parser.add_argument("--chart", type=Path, default=REPO / "docs" / "img" / "mixed_precision.svg")
    args = parser.parse_args()
    if not PERPLEXITY.is_file():
        sys.exit(f"{PERPLEXITY} not built: bash bench/anchors/setup.sh llama-tools")

    from evalsuite.chart import size_fidelity_svg
    from evalsuite.report import VariantRow

    rows = []
    for model in args.models.split(","):
        if not MODELS[model].is_dir():
            print(f"{model}: {MODELS[model]} not present, skipped")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            for name, size_mb, scores in measured(MODELS[model], args.types.split(","), args.ctx, Path(tmp),
                                                  args.sensitivity.split(",")):
                rows.append(VariantRow(f"{model} {name}", name, 0.0, size_mb, scores))
    args.chart.write_text(size_fidelity_svg(rows))
    print(f"chart: {args.chart}")


def measured(path: Path, file_types: list[str], ctx: int, work: Path, sensitivities: list[str]):
    """(name, MB of tensor data, llama.cpp's Scores) of each file type and of the auto files at its size."""
    import time

    from gguf import GGUFReader

    from calib.text import token_windows
    from formats.hf import HFCheckpoint, load_tokenizer
    from recipes.importance import model_imatrix
    from recipes.schema import Variant
    from recipes.variants import build_variant, gguf_variant

    ckpt = HFCheckpoint.open(path)
    windows = token_windows(load_tokenizer(ckpt), REPO / "recipes" / "bundled" / "calib.txt", 512, 16)
    imatrix = model_imatrix(ckpt, windows)
    f32 = build_variant(ckpt, gguf_variant("F32"), work, gguf_path=work / "f32.gguf").files[0]
    text = REPO / "recipes" / "bundled" / "eval.txt"
    base = work / "f32.kld"
    _perplexity(["-m", str(f32), "-f", str(text), "-c", str(ctx), "--kl-divergence-base", str(base)])
    print(f"{path.name}: file                MB      KLD       top-1   PPL     auto/type KLD  build s")
    for file_type in file_types:
        fixed = build_variant(ckpt, gguf_variant(file_type, True), work, imatrix=imatrix,
                              gguf_path=work / f"{file_type}.gguf").files[0]
        data = sum(t.n_bytes for t in GGUFReader(fixed).tensors)
        files = [(file_type, fixed, None)]
        for sensitivity in sensitivities:
            variant = Variant(name=f"auto-{sensitivity}-{file_type}", exports=["gguf"], weights={
                "method": "gguf", "type": "auto", "imatrix": True, "size": f"{data}B", "sensitivity": sensitivity})
            start = time.perf_counter()
            auto = build_variant(ckpt, variant, work, imatrix=imatrix, calibration=windows).files[0]
            files.append((f"auto {sensitivity}@{file_type}", auto, time.perf_counter() - start))
        for name, file, seconds in files:
            scores = _kld(file, text, ctx, base)
            size = sum(t.n_bytes for t in GGUFReader(file).tensors) / 1e6
            if seconds is None:
                fixed_kld, ratio, took = scores.kld, "", ""
            else:
                ratio, took = f"{scores.kld / fixed_kld:.2f}", f"{seconds:.0f}"
            print(f"  {name:19s} {size:7.3f} {scores.kld:.5f}  {100 * scores.top1:5.1f}%  {scores.ppl:7.3f} {ratio:>13s}  {took:>7s}",
                  flush=True)
            yield name, size, scores


def _kld(file: Path, text: Path, ctx: int, base: Path):
    from evalsuite.metrics import Scores

    number = r"\s*:?\s*([0-9.]+)"
    for _ in range(3):  # its summary comes through llama.cpp's logging thread, which now and then exits before printing it
        out = _perplexity(["-m", str(file), "-f", str(text), "-c", str(ctx), "--kl-divergence-base", str(base), "--kl-divergence"])
        found = [re.search(pattern + number, out) for pattern in (r"Mean\s+KLD:", r"Same top p:", r"Mean PPL\(Q\)")]
        if all(found):
            break
    else:
        raise SystemExit(f"llama-perplexity printed no KL divergence for {file} in 3 runs: {out[-1500:]}")
    kld, top1, ppl = (float(m.group(1)) for m in found)
    top1 /= 100
    return Scores(ppl=ppl, kld=kld, top1=top1)


def _perplexity(arguments: list[str]) -> str:
    """llama-perplexity without repacked weights (``--no-repack``): on the 2-core Xeon VM with AMX, the
    native build's AMX kernels for K-quant weights died of SIGILL at their first tile instruction
    (2026-12-06); llama-bench's Q4_0 and Q8_0 decoding uses AMX there without fault."""
    done = subprocess.run([str(PERPLEXITY), "-t", "2", "--no-repack", *arguments], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama-perplexity failed: {done.stderr[-2000:]}")
    return done.stdout + done.stderr


if __name__ == "__main__":
    main()
