"""The engine's Linear layers on Llama-3-8B's projection shapes, on whatever device the engine picks
(CUDA where present): the dense bf16 layer (the baseline, as the engine runs it), int8 per
channel and int4 by groups of 128, each as ``runner.engine.linear.make_linear`` builds it for
this machine. Decode multiplies a few rows by the whole weight, so there the low-bit layers
should be faster by the bytes they do not read; prefill's hundreds of rows are bound by compute.

Per shape and row count: microseconds per product, each layer's kind (a kernel, or "dequantized"
where the device has none), its weight bytes read per microsecond (GB/s), and its speed against
bf16 measured in the same run.

    python bench/linear_kernels.py [--rows 1 8 32 256] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from printout import print_result  # noqa: E402

SHAPES = {"q/o 4096x4096": (4096, 4096), "gate+up 28672x4096": (28672, 4096), "down 4096x14336": (4096, 14336)}


def _seconds(layer, x, device, budget_s: float = 0.3) -> float:
    """Seconds per product: the best of three loops of about ``budget_s`` each (other work on the
    machine only ever slows a loop down), so a slow kernel costs the bench a second, not minutes."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    layer(x)
    sync()
    best = float("inf")
    for _ in range(3):
        start, count = time.perf_counter(), 0
        while count == 0 or time.perf_counter() - start < budget_s:
            for _ in range(8 if device.type == "cuda" else 1):
                layer(x)
                count += 1
            sync()
        best = min(best, (time.perf_counter() - start) / count)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    from quant.rtn import quantize_rtn
    from core.schemes import QuantSpec
    from runner.engine.linear import make_linear

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    specs = {"int8": QuantSpec(8, True, "channel"), "int4-g128": QuantSpec(4, False, "group", 128)}
    rows_out: dict[str, dict] = {}
    ratios: dict[str, float] = {}
    gen = torch.Generator().manual_seed(0)
    for shape_name, (n_out, n_in) in SHAPES.items():
        weight = (torch.randn(n_out, n_in, generator=gen) * 0.02).to(device)  # quantized where it runs
        layers = {"bf16": (make_linear(weight.to(torch.bfloat16), None, torch.bfloat16, device), 2 * weight.numel())}
        for name, spec in specs.items():
            q = quantize_rtn(weight, spec, shape_name)
            layers[name] = (make_linear(q, None, torch.bfloat16, device), weight.numel() * spec.bits // 8)
        for rows in args.rows:
            x = torch.randn(rows, n_in, generator=gen).to(device, torch.bfloat16)
            timed = {name: _seconds(layer, x, device) for name, (layer, _) in layers.items()}
            for name, (layer, nbytes) in layers.items():
                rows_out[f"{shape_name}, {rows} rows, {name}"] = {
                    "kind": layer.kind, "us": round(timed[name] * 1e6, 1), "weight_gb_per_s": round(nbytes / timed[name] / 1e9, 1)}
                if name != "bf16":
                    ratios[f"{shape_name}, {rows} rows: {name} vs bf16 (speed-up)"] = timed["bf16"] / timed[name]
            print(f"{shape_name}, {rows} rows: " + ", ".join(f"{n} {t * 1e6:.0f} us" for n, t in timed.items()), file=sys.stderr)
    rows_out["device"] = {"name": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu, {args.threads} threads",
                          "torch": torch.__version__}
    print_result(rows_out, ratios, as_json=args.json)


if __name__ == "__main__":
    main()
