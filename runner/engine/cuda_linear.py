"""The engine's Linear layers for quantized weights on CUDA, where the weights' own codes should
make decoding faster than bf16 (it reads every weight once a step, so bytes are time):

- int4 and int8 codes (groups of 16·n inputs or one scale per output, symmetric or not, GPTQ's
  act-order ``g_idx``, AWQ's folders, which read back as the same codes): ``LowBitLinear``, the
  Triton weight-only kernel of runner/engine/kernels/lowbit_gemm.py up to ``DENSE_ABOVE_ROWS``
  rows, and above them cuBLAS on a copy dequantized once per call into a buffer the layers share;
- fp8 e4m3 by tensor or by output channel (compressed-tensors' FP8 and FP8_DYNAMIC folders) with
  bf16 activations, on GPUs with fp8 tensor cores (compute capability 8.9 on): ``Fp8Linear``,
  ``torch._scaled_mm`` with each row of the activations scaled into fp8 on the fly (dynamic,
  per token), as vLLM runs FP8_DYNAMIC; a weight-only fp8 folder gets that rounding of its
  activations too, which it did not ask for (a layer is not told the checkpoint's activations);
- anything else, or without Triton: what ``make_linear`` builds otherwise (tinygemm for int4 in
  bf16, else a dequantized copy), its ``kind`` saying why these kernels did not take it.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from core.schemes import FORMAT_MAX
from core.tensors import QuantizedTensor
from runner.engine.linear import Linear

try:
    from runner.engine.kernels import lowbit_gemm
except ImportError:  # torch's CPU wheels come without Triton
    lowbit_gemm = None

DENSE_ABOVE_ROWS = 256
"""Rows of ``x`` above which ``LowBitLinear`` dequantizes its weight and calls cuBLAS instead of
the Triton kernel. A guess, not yet measured: the kernel reads a quarter (int4) or half (int8) of
bf16's bytes, which wins while the product is bound by memory, and dequantizing costs a write and
a read of the bf16 copy, which only a product bound by arithmetic (prefill's hundreds of rows)
amortizes. A GPU session sets it from ``bench/lowbit_gemm.py``: the smallest row count at which
"dequant+cublas" beats "triton" on Llama-3-8B's projections."""

FP8_CAPABILITY = (8, 9)  # Ada and Hopper on: fp8 tensor cores


def cuda_linear(weight: QuantizedTensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                fallback: Callable[[], Linear]) -> Linear:
    """The layer for a quantized weight on CUDA: one of this module's kernels where it takes the
    weight, else ``fallback()`` with the reason in its kind."""
    why_not = refusal(weight, dtype, device)
    if why_not is None:
        layer = Fp8Linear if weight.spec.format == "fp8_e4m3" else LowBitLinear
        return layer(weight, bias, dtype, device)
    layer = fallback()
    layer.kind = f"{layer.kind} (not this module's kernels: {why_not})"
    return layer


def refusal(weight: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why neither kernel here runs ``weight`` with ``dtype`` activations on ``device``, or None."""
    spec, (n_out, n_in) = weight.spec, weight.shape
    if spec.format == "fp8_e4m3":
        if spec.granularity not in ("tensor", "channel"):
            return f"fp8 by {spec.granularity} (scaled_mm here takes scales by tensor or channel)"
        if dtype != torch.bfloat16:
            return f"fp8 weights with {dtype} activations (scaled_mm's per-token scaling gives bf16)"
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
            return "fp8 weights on a GPU without fp8 tensor cores (compute capability below 8.9)"
        if n_in % 16 or n_out % 16:
            return f"fp8 weight of {n_out} x {n_in} (scaled_mm takes multiples of 16)"
        return None
    if lowbit_gemm is None:
        return "Triton is not installed"
    if dtype == torch.bfloat16 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "bf16 activations on a GPU before Ampere (no bf16 tensor cores)"
    return lowbit_gemm.refusal(weight, dtype)


class LowBitLinear(Linear):
    """int4 or int8 codes: the Triton kernel up to ``dense_above`` rows, cuBLAS on a dequantized
    copy above."""

    def __init__(self, q: QuantizedTensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                 dense_above: int = DENSE_ABOVE_ROWS):
        self.packed = lowbit_gemm.pack(q, dtype, device)
        self.bias, self.dense_above = bias, dense_above
        self.buffer = shared_buffer(q.codes.numel(), dtype, device)
        self.kind = f"int{q.spec.bits} triton (above {dense_above} rows: dequantized, cuBLAS)"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= self.dense_above:
            y = lowbit_gemm.matmul(flat, self.packed, self.bias)
        else:
            dense = lowbit_gemm.dequantize(self.packed, self.buffer)  # [K, N], act-order's inputs sorted
            if self.packed.order is not None:
                flat = flat[:, self.packed.order]
            y = torch.mm(flat, dense) if self.bias is None else torch.addmm(self.bias, flat, dense)
        return y.reshape(*x.shape[:-1], -1)


_BUFFERS: dict[tuple[str, torch.dtype], weakref.ref] = {}


def shared_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements for dequantized copies, shared by the layers of
    one device and dtype (they run one after another on one stream): about the size of the largest
    weight, not a float copy per layer. A layer keeps the buffer it was given, so the address a
    captured CUDA graph holds stays valid; a larger weight gets a new buffer, which later layers
    share, and a buffer goes with the last layer that holds it."""
    key = (str(device), dtype)
    buffer = _BUFFERS[key]() if key in _BUFFERS else None
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        _BUFFERS[key] = weakref.ref(buffer)
    return buffer


class Fp8Linear(Linear):
    """fp8 e4m3 weights on fp8 tensor cores: each call scales every row of ``x`` by its absolute
    maximum into e4m3 and multiplies with ``torch._scaled_mm``, the row's and the output channel's
    scales applied to the fp32 accumulator."""

    kind = "fp8 scaled_mm"

    def __init__(self, q: QuantizedTensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        self.weight = q.codes.view(torch.float8_e4m3fn).to(device)  # [N, K]; .t() is the column-major operand
        self.scales = q.scales[:, :1].T.to(device=device, dtype=torch.float32).contiguous()  # [1, N]: a tensor's one scale repeated
        self.bias, self.dtype = bias, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        top = FORMAT_MAX["fp8_e4m3"]
        row_scales = flat.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / top
        codes = (flat / row_scales).clamp(-top, top).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(codes, self.weight.t(), scale_a=row_scales, scale_b=self.scales, out_dtype=self.dtype)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], -1)
