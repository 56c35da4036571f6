"""Low-bit weights against bf16 on a GPU, on Llama-3-8B's projections (q+k+v fused 6144x4096, o
4096x4096, gate+up fused 28672x4096, down 4096x14336), a product per shape and row count:

- ``bf16``: ``F.linear`` on the bf16 weight (cuBLAS), the engine's dense layer and the baseline;
- ``tinygemm``: ``torch._weight_int4pack_mm``, int4 g128 asymmetric (the engine's former layer);
- ``triton int4-g128`` and ``triton int8``: runner/engine/kernels/lowbit_gemm.py's kernel by its
  schedule table, int4 by groups of 128, asymmetric, and int8 per output channel, symmetric;
- ``dequant+cublas int4-g128`` and ``int8``: the weight dequantized into the shared buffer, then
  ``torch.mm`` (``LowBitLinear`` above ``DENSE_ABOVE_ROWS``);
- ``fp8 scaled_mm``: e4m3 per channel, activations scaled per row (compute capability 8.9 on).

Each row: microseconds (the median of ``triton.testing.do_bench``, which empties the L2 cache
before each call, so a weight is read from memory as in a model too large for the cache), the
weight bytes the layer holds (codes, scales, zero-points) over that time in GB/s, and that as a
share of the copy bandwidth measured at the start of the same run (``floor``), and ``loop_us``,
the wall time per call of 100 calls back to back: where it is well above ``us``, the layer is
bound by its launch on the CPU (Triton's launcher costs more than cuBLAS's), which CUDA graphs
remove and eager decoding pays at every layer. Rows print as
they are measured, and go to ``--out`` as JSON lines, so a run cut short keeps what it measured;
the summary then gives per row count the four projections' time summed (a layer's), against
bf16's, and the smallest row count at which the dequantized copy beats the kernel (where
``DENSE_ABOVE_ROWS`` goes).

``--sweep`` times, per shape and row count, a grid of schedules of the int4 kernel (tiles for the
row count, splits around the default's, 4 or 8 warps, 3 or 4 stages; a few minutes, most of it
compiling), the five best and where the default stands: what to put in ``lowbit_gemm.SCHEDULES``.

    python bench/lowbit_gemm.py [--rows 1 16 64 256] [--out rows.jsonl] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {"qkv 6144x4096": (6144, 4096), "o 4096x4096": (4096, 4096), "gate_up 28672x4096": (28672, 4096),
          "down 4096x14336": (4096, 14336)}
NEVER = 1 << 30  # a LowBitLinear's dense_above that keeps it on the kernel at every row count


def copy_bandwidth(torch, gib: int = 2) -> float:
    """Bytes per second a device-to-device copy moves, read and write counted: the floor every
    memory-bound kernel is measured against."""
    from triton.testing import do_bench

    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3
    return 2 * src.numel() / seconds


def back_to_back(torch, layer, x, calls: int = 100) -> float:
    """Seconds per call of ``calls`` calls in a row, synchronized once: the CPU's launch cost
    where it exceeds the GPU's time (the weights may stay in L2 here)."""
    layer(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        layer(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def layers(torch, weight, fp8: bool) -> dict:
    """The layers to time for one weight, each with the bytes of weights it holds."""
    import torch.nn.functional as F

    from core.schemes import QuantSpec
    from quant.rtn import quantize_rtn
    from runner.engine.cuda_linear import Fp8Linear, LowBitLinear
    from runner.engine.linear import Int4Linear

    dense = weight.to(torch.bfloat16)
    out = {"bf16": (lambda x: F.linear(x, dense), dense.nbytes)}
    device, bf16 = weight.device, torch.bfloat16
    for label, spec in {"int4-g128": QuantSpec(4, False, "group", 128), "int8": QuantSpec(8, True, "channel")}.items():
        q = quantize_rtn(weight, spec)
        kernel, copy = LowBitLinear(q, None, bf16, device, dense_above=NEVER), LowBitLinear(q, None, bf16, device, dense_above=0)
        held = sum(t.nbytes for t in (kernel.packed.codes, kernel.packed.scales, kernel.packed.zeros) if t is not None)
        if spec.bits == 4:
            tiny = Int4Linear(q, None, bf16, device)
            out["tinygemm int4-g128"] = (tiny, tiny.packed.nbytes + tiny.scales_and_zeros.nbytes)
        out[f"triton {label}"] = (kernel, held)
        out[f"dequant+cublas {label}"] = (copy, held)
    if fp8:
        layer = Fp8Linear(quantize_rtn(weight, QuantSpec(8, True, "channel", format="fp8_e4m3")), None, bf16, device)
        out["fp8 scaled_mm"] = (layer, layer.weight.nbytes + layer.scales.nbytes)
    return out


def sweep(torch, kernel, x, emit) -> None:
    """The int4 kernel under a grid of schedules, for this shape and row count, best first."""
    from triton.testing import do_bench

    from runner.engine.kernels import lowbit_gemm

    w, rows = kernel.packed, x.shape[0]
    default = lowbit_gemm.schedule(rows, w, torch.cuda.get_device_properties(0).multi_processor_count)
    if rows <= 16:
        tiles = itertools.product([16], (32, 64, 128), (128, 256))
    elif rows <= 64:
        tiles = itertools.product([32, 64], (64, 128), (64, 128))
    else:
        tiles = itertools.product([64, 128], (128, 256), (32, 64))
    splits = sorted({1, max(1, default.split_k // 2), default.split_k, 2 * default.split_k})
    timed = []
    for (block_m, block_n, block_k), split, warps, stages in itertools.product(tiles, splits, (4, 8), (3, 4)):
        plan = lowbit_gemm.Schedule(block_m, block_n, lowbit_gemm.fit_block_k(block_k, w), split, warps, stages)
        try:
            timed.append((do_bench(lambda: lowbit_gemm.matmul(x, w, plan=plan), rep=40, return_mode="median"), plan))
        except Exception as e:  # a schedule out of shared memory or registers: noted, the rest go on
            emit({"sweep": str(plan), "error": f"{type(e).__name__}: {str(e)[:120]}"})
    ranked = sorted(timed)
    for rank, (ms, plan) in enumerate(ranked):
        if rank < 5 or plan == default:
            emit({"sweep": str(plan), "rank": rank + 1, "of": len(ranked), "us": round(ms * 1e3, 1), "default": plan == default})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--out", type=Path, help="also write each row here, as a line of JSON")
    parser.add_argument("--sweep", action="store_true", help="time a grid of the int4 kernel's schedules too")
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    from runner.engine.cuda_linear import DENSE_ABOVE_ROWS, FP8_CAPABILITY

    if not torch.cuda.is_available():
        sys.exit("bench/lowbit_gemm.py times CUDA kernels: no CUDA device here (bench/linear_kernels.py runs on a CPU)")
    sink = args.out.open("a") if args.out else None

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    floor = copy_bandwidth(torch)
    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": __import__("triton").__version__,
          "copy_gb_per_s": round(floor / 1e9), "dense_above_rows": DENSE_ABOVE_ROWS})
    fp8 = torch.cuda.get_device_capability() >= FP8_CAPABILITY
    totals: dict[tuple[int, str], float] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for shape, (n_out, n_in) in SHAPES.items():
            timed = layers(torch, torch.randn(n_out, n_in, device="cuda", generator=gen) * 0.02, fp8)
            for rows in args.rows:
                x = torch.randn(rows, n_in, device="cuda", generator=gen).to(torch.bfloat16)
                for name, (layer, held) in timed.items():
                    seconds = do_bench(lambda: layer(x), return_mode="median") / 1e3
                    totals[rows, name] = totals.get((rows, name), 0.0) + seconds
                    emit({"shape": shape, "rows": rows, "layer": name, "us": round(seconds * 1e6, 1),
                          "gb_per_s": round(held / seconds / 1e9), "of_floor": round(held / seconds / floor, 2),
                          "floor_us": round(held / floor * 1e6, 1), "loop_us": round(back_to_back(torch, layer, x) * 1e6, 1)})
                if args.sweep:
                    sweep(torch, timed["triton int4-g128"][0], x, lambda row: emit({"shape": shape, "rows": rows, **row}))
            del timed
    names = sorted({name for _, name in totals})
    for rows in args.rows:
        emit({"layer_of_four_projections": rows, **{name: round(totals[rows, "bf16"] / totals[rows, name], 2) for name in names},
              "note": "speed-up against bf16, the four shapes' times summed"})
    for label in ("int4-g128", "int8"):
        wins = [rows for rows in sorted(args.rows) if totals[rows, f"dequant+cublas {label}"] < totals[rows, f"triton {label}"]]
        emit({"dense_above_rows_from_this_run": label, "dequant_beats_triton_from_rows": wins[0] if wins else None})


if __name__ == "__main__":
    main()
