"""torchao anchor: quantization-aware training with torchao's own QAT, the baseline QAT row of
bench/qat_table.py.

Runs INSIDE the anchor venv made by ``bench/anchors/setup.sh torchao``::

    .anchors/torchao/bin/python bench/anchors/torchao_qat.py --model DIR \
        --windows WINDOWS.safetensors --bits 3 --group-size 128 --steps 400 --lr 1e-4 \
        --batch 2 --out OUT_DIR

torchao's QAT flow as its documentation gives it for Llama models: ``quantize_(model,
QATConfig(weight_config=IntxFakeQuantizeConfig(int<bits>, group_size=G, is_symmetric=False),
step="prepare"))`` swaps every decoder Linear for a FakeQuantizedLinear (per-group asymmetric
min/max scales recomputed from the weights at every step, straight-through rounding), and the
whole model is then fine-tuned end to end. The loss is ours for a like-for-like comparison: the KL
divergence of the model's next-token distribution to the float model's on the calibration
windows (``WINDOWS.safetensors``, the same ones every method of the table gets), AdamW with a
cosine schedule, under bf16 autocast where the CPU multiplies bf16 natively (as quantbench's QAT).
The embedding, the output head and the norms train too, as in torchao's recipe; they stay float.

Writes:
  OUT_DIR/dense/       plain HF folder, float32: each decoder Linear's weight is its fake-quantized
                       weight after training (what torchao's convert step quantizes: the same
                       min/max grid), every other tensor as trained
  OUT_DIR/anchor.json  settings, timings, peak RSS, the loss at the start and end

Only safetensors/json are read (no pickle). Exit status 2 with a one-line message for a missing or
invalid model folder or windows file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import common

TOOL = "torchao_qat"


def fast_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 autocast is faster than float32 on this CPU (calib/streaming.py)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--windows", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--bits", type=int, required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common.check_model_dir(TOOL, args.model)
    ids = common.load_windows(TOOL, args.windows, args.model)

    import torch
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
    from torchao.quantization.qat.linear import FakeQuantizedLinear
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    teacher = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    dtype = getattr(torch, f"int{args.bits}")
    config = QATConfig(weight_config=IntxFakeQuantizeConfig(dtype, group_size=args.group_size, is_symmetric=False),
                       step="prepare")
    quantize_(student, config, filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and ".layers." in f".{name}")
    fake = {n: m for n, m in student.named_modules() if isinstance(m, FakeQuantizedLinear)}
    if not fake:
        common.die(TOOL, "torchao prepared no Linear of the decoder layers")
    student.train()
    optimizer = torch.optim.AdamW([q for q in student.parameters() if q.requires_grad], lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.empty(0, dtype=torch.long)
    bf16 = fast_bf16()
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        if len(order) < args.batch:
            order = torch.cat([order, torch.randperm(len(ids), generator=generator)])
        batch, order = ids[order[: args.batch]], order[args.batch:]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            target = torch.log_softmax(teacher(input_ids=batch).logits.float(), -1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = student(input_ids=batch).logits
        logq = torch.log_softmax(logits.float(), -1)
        loss = (target.exp() * (target - logq)).sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start

    from safetensors.torch import save_file

    state = {n: t.detach().clone().contiguous() for n, t in student.state_dict().items()}
    with torch.no_grad():
        for name, module in fake.items():
            state[f"{name}.weight"] = module.weight_fake_quantizer(module.weight).float().contiguous()
    state = {n: t for n, t in state.items() if "fake_quantizer" not in n}
    if student.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    dense = args.out / "dense"
    dense.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dense / "model.safetensors"), metadata={"format": "pt"})
    student.config.save_pretrained(dense)
    common.copy_tokenizer_files(args.model, dense)
    (args.out / "anchor.json").write_text(json.dumps({
        "tool": "torchao QAT", "torchao": __import__("torchao").__version__, "bits": args.bits,
        "group_size": args.group_size, "steps": args.steps, "lr": args.lr, "batch": args.batch, "bf16": bf16,
        "seconds": seconds, "peak_rss_mb": common.peak_rss_mb(),
        "loss_first10": sum(losses[:10]) / len(losses[:10]), "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
    }, indent=1))
    print(f"{TOOL}: {len(fake)} Linears, {args.steps} steps in {seconds:.0f} s, KL {losses[0]:.4f} -> {losses[-1]:.4f}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    # an offline run, as a script only: importing this module leaves the process as it was
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    raise SystemExit(main())
