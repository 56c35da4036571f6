"""W8A8 (int8 per-channel weights, per-token int8 or fp8 activations, simulated) with and without
SmoothQuant, against the float model: perplexity, its change, KL divergence and top-1 agreement.

Issue 4's acceptance: W8A8 with SmoothQuant at most 1% above the float model's perplexity on the
ref model (128 calibration windows of 512 tokens, seed 0; evaluation in 512-token windows).
``--ablate`` also quantizes the activations of one kind of Linear at a time (q/k/v, o, gate/up,
down) to show where the error comes from.

    python bench/w8a8_smoothquant.py [--model DIR] [--calib 128] [--eval 64] [--alphas none,0.5] [--formats int8,fp8] [--ablate]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KINDS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shared = REPO.parent / "shared"
    parser.add_argument("--model", type=Path, default=shared / "models" / "ref")
    parser.add_argument("--calib-text", type=Path, default=shared / "data" / "calib.txt")
    parser.add_argument("--eval-text", type=Path, default=shared / "data" / "eval.txt")
    parser.add_argument("--calib", type=int, default=128, help="calibration windows of 512 tokens (seed 0)")
    parser.add_argument("--eval", type=int, default=64, help="evaluation windows of 512 tokens")
    parser.add_argument("--alphas", default="none,0.5", help="SmoothQuant alphas; 'none' is W8A8 without smoothing")
    parser.add_argument("--formats", default="int8,fp8", help="activation formats")
    parser.add_argument("--ablate", action="store_true", help="also int8 activations at one kind of Linear at a time")
    args = parser.parse_args()

    import torch

    from calib.text import sample_windows, token_windows
    from evalsuite.metrics import causal_lm_logprobs, score
    from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer, model_from_state
    from core.schemes import ActivationSpec
    from quant.activations import simulated_activations
    from quant.smoothquant import rtn_layer, smoothquant_model
    from core.schemes import QuantSpec
    from core.tensors import dequantized

    int8 = QuantSpec(8, True, "channel")

    ckpt = HFCheckpoint.open(args.model)
    model, tokenizer = load_causal_lm(ckpt), load_tokenizer(ckpt)
    calib = sample_windows(tokenizer, args.calib_text, 512, args.calib, seed=0)
    windows = token_windows(tokenizer, args.eval_text, 512, args.eval)
    original = causal_lm_logprobs(model)
    cached = [original(windows[i : i + 1]) for i in range(len(windows))]  # the reference, computed once
    baseline = score(original, windows)
    print(f"{args.model}: calibration {len(calib)}x512, evaluation {len(windows)}x512, torch {torch.__version__}")
    print(f"{'float32 (original)':44s} ppl {baseline.ppl:.4f}", flush=True)

    def row(label: str, variant: torch.nn.Module) -> None:
        reference = iter(cached)
        s = score(causal_lm_logprobs(variant), windows, lambda _: next(reference))
        print(f"{label:44s} ppl {s.ppl:.4f} ({100 * (s.ppl / baseline.ppl - 1):+.2f}%) kld {s.kld:.5f} top1 {s.top1:.4f}", flush=True)

    for alpha in args.alphas.split(","):
        smoothing = None if alpha == "none" else float(alpha)
        tag = "no smoothing" if smoothing is None else f"SmoothQuant alpha {alpha}"
        start = time.perf_counter()
        state = {n: p.detach() for n, p in model.named_parameters()}
        modules = []
        for layer in smoothquant_model(ckpt, calib, smoothing, lambda step: rtn_layer(step, int8)):
            state.update({n: dequantized(t) for n, t in layer.tensors.items()})
            modules += list(layer.statistics)
        quantized = model_from_state(model.config, state)
        print(f"  [{tag}: calibration and quantization {time.perf_counter() - start:.0f} s]", flush=True)
        row(f"W8 (weights only), {tag}", quantized)
        if args.ablate:
            for kind in KINDS:
                kind_modules = [n for n in modules if n.endswith(kind)]
                with simulated_activations(quantized, ActivationSpec("int8"), kind_modules):
                    row(f"W8 + A8-int8 at {'/'.join(kind)} only, {tag}", quantized)
        for fmt in args.formats.split(","):
            with simulated_activations(quantized, ActivationSpec(fmt), modules):
                row(f"W8A8-{fmt}, {tag}", quantized)


if __name__ == "__main__":
    main()
