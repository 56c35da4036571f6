"""Weight-only RTN with and without LLM.int8-style fp16 outlier columns, under several outlier rules:
columns kept, bits per weight, perplexity, KL divergence and top-1 agreement against the float model.

    python bench/outlier_columns.py [--model DIR] [--calib 128] [--eval 32]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shared = REPO.parent / "shared"
    parser.add_argument("--model", type=Path, default=shared / "models" / "ref")
    parser.add_argument("--calib-text", type=Path, default=shared / "data" / "calib.txt")
    parser.add_argument("--eval-text", type=Path, default=shared / "data" / "eval.txt")
    parser.add_argument("--calib", type=int, default=128, help="calibration windows of 512 tokens (seed 0)")
    parser.add_argument("--eval", type=int, default=32, help="evaluation windows of 512 tokens")
    args = parser.parse_args()

    import torch

    from calib.text import sample_windows, token_windows
    from evalsuite.metrics import causal_lm_logprobs, score
    from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer
    from quant.outliers import OutlierRule, input_abs_max, mixed_precision_rtn
    from core.schemes import QuantSpec

    ckpt = HFCheckpoint.open(args.model)
    model, tokenizer = load_causal_lm(ckpt), load_tokenizer(ckpt)
    calib = sample_windows(tokenizer, args.calib_text, 512, args.calib, seed=0)
    windows = token_windows(tokenizer, args.eval_text, 512, args.eval)
    abs_max = input_abs_max(ckpt, calib)
    original = causal_lm_logprobs(model)
    cached = [original(windows[i : i + 1]) for i in range(len(windows))]
    baseline = score(original, windows)
    print(f"{args.model}: calibration {len(calib)}x512, evaluation {len(windows)}x512, bpw of the decoder Linear weights; float32 ppl {baseline.ppl:.4f}")

    rules = [None, OutlierRule(6.0, 1.0), OutlierRule(), OutlierRule(0.0, 4.0)]
    for spec in (QuantSpec(4, True, "channel"), QuantSpec(4, False, "group", 128)):
        for rule in rules:
            quantized = copy.deepcopy(model)
            modules = dict(quantized.named_modules())
            bits = params = kept = 0
            for name, a in abs_max.items():
                linear = modules[name]
                columns = rule.channels(a) if rule else torch.zeros(0, dtype=torch.int32)
                tensor = mixed_precision_rtn(linear.weight.data, spec, columns, name)
                linear.weight.data = tensor.dequantize()
                bits += tensor.bits_per_weight * linear.weight.numel()
                params += linear.weight.numel()
                kept += columns.numel()
            reference = iter(cached)
            s = score(causal_lm_logprobs(quantized), windows, lambda _: next(reference))
            label = "plain RTN" if rule is None else f"threshold {rule.threshold}, {rule.relative}x median"
            print(f"{spec.label:17s} {label:28s} fp16 columns {kept:5d} bpw {bits / params:.3f} "
                  f"ppl {s.ppl:.4f} ({100 * (s.ppl / baseline.ppl - 1):+.2f}%) kld {s.kld:.5f} top1 {s.top1:.4f}", flush=True)


if __name__ == "__main__":
    main()
