"""The engine's Linear layers: dense, or on low-bit weights with torch's weight-only kernels.

A quantized variant runs on its own codes, so its speed is its own and not a dequantized copy's:

- int8 by output channel (GPTQ's grid, symmetric or not) on a CPU: integer dot products on the
  codes less 128 (``Int8Linear``; an asymmetric zero-point adds ``(128 - zero) · scale`` times the
  sum of the inputs). torch's weight-only ``_weight_int8pack_mm`` widens every weight to float32
  and is bound by that compute (about 30 GB/s of weights on 2 AVX-512 cores, where bf16 reads 47);
  oneDNN's u8 x s8 kernels (VNNI, and AMX where the CPU has it) read at the memory's rate, but
  take 8-bit inputs. So each input row is written as an integer of 14 bits (28 in fp32) times a
  scale, and that integer as 2 (4) digits of 7 bits, each digit row an exact u8 input (scale 1,
  zero-point 0) to ``onednn::qlinear_pointwise``: one call multiplies every digit row by the
  weight, and the digits' products, weighted by 128^j, are the row's product, more precise than a
  bf16 input. fbgemm's kernel did this before (1.5x to 2x int8pack's speed at 1 to 64 rows); on
  the 2-core Xeon with AMX oneDNN's is 1.0-1.2x faster at one row and 1.5-3.2x at 4 to 256 rows
  (8192 x 2048 and 2048 x 8192, 2026-12-06), and reads the codes from memory at 94% of the rate a
  sum reads (26 of 27.6 GB/s, at 1, 2 and 4 rows). The digit rows are made, and their products
  summed back, in one C pass each (kernels/cpu_digits.c), not eleven and five to eight torch
  operations. torch's CUDA int8pack is a reference loop (one thread per output, walking its
  weight row byte by byte in float32, no tensor cores): on an H200 bench/linear_kernels.py over
  Llama-3-8B's projections did not finish in 50 s with it. On CUDA int8 runs on Triton instead
  (cuda_linear.py);
- int4 by groups of 32 to 256 inputs: ``torch._weight_int4pack_mm_for_cpu`` on a CPU, and on CUDA
  (compute capability 8.0 on, bf16 activations) ``torch._weight_int4pack_mm``, tinygemm's kernel,
  on codes packed two to a byte, even columns in the high nibble. Both dequantize
  ``(code - 8) · scale + bias``, so our ``(code - zero) · scale`` becomes bias
  ``(8 - zero) · scale``; act-order groups (GPTQ's ``g_idx``) first put the input columns in
  group order, and each input is gathered the same way.

On CUDA, quantized weights go first to runner/engine/cuda_linear.py (a Triton kernel for int4
and int8, ``torch._scaled_mm`` for fp8); what it does not take comes back here. Everything else
(other widths, float codes, a device without the kernels) runs dequantized, and says so in
``kind``. Scales take the activations' dtype, as the kernels require.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

from core.tensors import QuantizedTensor, TensorPayload
from runner.engine.kernels import cpu_digits

INT4_GROUPS = (32, 64, 128, 256)
# oneDNN's integer kernels (Int8Linear's digit rows): on x86 CPU builds of torch
DIGIT_KERNEL = torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")


class Linear:
    kind = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """bf16 or fp32 weights reordered once into oneDNN's blocked layout: at the few rows a decode
    step multiplies, 1.5-2.3x faster on a CPU than ``F.linear`` in bf16 (which reorders the weight
    every call), and 1.7-4.4x in fp32 (measured at 1 to 32 rows of a 3072 x 512 weight). oneDNN's
    bf16 path needs AVX-512 (or AVX-NE-CONVERT); on a CPU without, bf16 weights stay unpacked."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class Int8Linear(Linear):
    """int8 codes by output channel on a CPU, multiplied by oneDNN's integer kernel through exact
    7-bit digit rows of the input (the module's docstring says why); torch's int8pack kernel where
    this torch has no oneDNN (not an x86 build)."""

    kind = "int8"

    def __init__(self, q: QuantizedTensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        scales = q.scales[:, 0].float()
        codes = (q.codes.to(torch.int16) - 128).to(torch.int8)
        offset = (128 - q.zeros[:, 0]) * scales  # zero at the mid-level for symmetric weights: no offset
        self.dtype = dtype
        self.digits = 4 if dtype == torch.float32 else 2  # 28 or 14 bits: finer than the input's own mantissa
        self.top = 2.0 ** (7 * self.digits - 1)  # the digits' offset: u = x / s + top is never negative
        # the digits' sums are taken in float64 for 28 bits (exact), float32 for 14; int8pack's in the activations' dtype
        self.wide = (torch.float64 if self.digits > 2 else torch.float32) if DIGIT_KERNEL else dtype
        self.offset = None if not offset.any() else offset.to(dtype=self.wide, device=device)
        self.bias = None if bias is None else bias.to(self.wide).contiguous()
        if DIGIT_KERNEL:
            self.packed, self._buffers = torch.ops.onednn.qlinear_prepack(codes, None), {}
            self.weight_scales, self.zero_points = scales, torch.zeros(len(scales), dtype=torch.int32)
            # what the digits' offset adds to each output: top · scale · sum of the row's codes
            self.digit_offset = (self.top * scales.double() * codes.sum(1, dtype=torch.int64).double()).to(self.wide)
        else:
            self.codes, self.scales = codes.to(device), scales.to(dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if DIGIT_KERNEL:
            return self._digits(x)
        y = torch._weight_int8pack_mm(x, self.codes, self.scales)
        if self.offset is not None:
            y = y + x.sum(-1, keepdim=True) * self.offset
        return y if self.bias is None else y + self.bias

    def _digits(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ (codes · scale)ᵀ`` (with the zero-point's offset and the bias) from one oneDNN call
        on the digit rows of ``x``: row ``r`` is ``s_r · (u - 2^(b-1))``, ``u`` an integer of
        ``b = 7 · digits`` bits, ``u = Σ_j 128^j d_j``; one rounding to the activations' dtype, at the end."""
        rows, n_in = x.shape
        digits, scale = self._digit_rows(rows, n_in)
        c_kernel = cpu_digits.available()  # one pass in C each way (cpu_digits.c says why), else torch operations
        x = x.contiguous()
        if c_kernel:
            cpu_digits.input_digits(x, digits, scale)
        else:
            self._torch_digits(x, digits, scale)
        out = torch.ops.onednn.qlinear_pointwise(digits.view(-1, n_in), 1.0, 0, self.packed, self.weight_scales,
                                                 self.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        out = out.view(self.digits, rows, -1)
        if not c_kernel:
            return self._torch_sums(out, x, scale)
        y = torch.empty(rows, out.shape[-1], dtype=self.dtype)
        cpu_digits.digit_sums(out, self.digit_offset, scale, x, self.offset, self.bias, y)
        return y

    def _torch_sums(self, out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``cpu_digits.digit_sums`` by torch: the output from the digits' products ``out``."""
        y = out[-1].to(self.wide)
        for j in range(self.digits - 2, -1, -1):  # Horner: Σ_j 128^j out_j
            y = torch.add(out[j], y, alpha=128)
        y = y.sub_(self.digit_offset).mul_(scale)
        if self.offset is not None:
            y = y.addcmul_(x.to(self.wide).sum(-1, keepdim=True), self.offset)
        return (y if self.bias is None else y.add_(self.bias)).to(self.dtype)

    def _torch_digits(self, x: torch.Tensor, digits: torch.Tensor, scale: torch.Tensor) -> None:
        """``cpu_digits.input_digits`` by torch: the row scales and digit rows of ``x``."""
        top, xf = self.top, x.to(self.wide)
        scale.copy_(torch.linalg.vector_norm(xf, float("inf"), 1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny).div_(top - 1))
        u = torch.div(xf, scale).round_().add_(top)  # 1 .. 2^b - 1
        for j in range(self.digits - 1):  # the lower digits; what is left is the top one
            high = torch.div(u, 128, rounding_mode="floor")
            digits[j] = u.sub_(high, alpha=128)
            u = high
        digits[-1] = u

    def _digit_rows(self, rows: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers of ``rows`` inputs' digit rows (uint8) and row scales, kept per row count."""
        buffers = self._buffers
        if rows not in buffers:
            if len(buffers) > 8:  # a few batch sizes recur; prefill chunks' come and go
                buffers.clear()
            buffers[rows] = (torch.empty(self.digits, rows, n_in, dtype=torch.uint8), torch.empty(rows, 1, dtype=self.wide))
        return buffers[rows]


class Int4Linear(Linear):
    kind = "int4"

    def __init__(self, q: QuantizedTensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        codes, scales, zeros = q.codes, q.scales, q.zeros
        self.order = None
        if q.group_index is not None:  # act-order: columns into group order, groups then consecutive
            self.order = torch.argsort(q.group_index.long(), stable=True)
            codes = codes[:, self.order]
            self.order = self.order.to(device)
        n_in = codes.shape[1]
        self.group = n_in // scales.shape[1]
        if device.type == "cuda":
            codes = codes.to(device=device, dtype=torch.uint8)
            pairs = codes[:, ::2] << 4 | codes[:, 1::2]
            self.packed = torch._convert_weight_to_int4pack(pairs, _inner_k_tiles(n_in))
            self.mm = torch._weight_int4pack_mm
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            self.mm = torch._weight_int4pack_mm_for_cpu
        self.scales_and_zeros = torch.stack([scales.T, ((8 - zeros) * scales).T], -1).to(dtype=dtype, device=device).contiguous()
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.order is not None:
            x = x[:, self.order]
        y = self.mm(x.contiguous(), self.packed, self.group, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


def _equal_groups(weight: QuantizedTensor) -> bool:
    """Whether the inputs fall into groups of one size, as the int4 kernels read them: in order, or
    (act-order ``g_idx``) once sorted by group."""
    n_in, groups = weight.shape[1], weight.scales.shape[1]
    if n_in % groups:
        return False
    if weight.group_index is None:
        return True
    return bool((torch.bincount(weight.group_index.long(), minlength=groups) == n_in // groups).all())


def _inner_k_tiles(n_in: int) -> int:
    """tinygemm's tiling of the inputs: the widest of 8, 4 or 2 tiles of 16 that divides them."""
    return next(tiles for tiles in (8, 4, 2) if n_in % (16 * tiles) == 0)


def _int4_runs(n_out: int, n_in: int, group: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an int4 kernel takes this weight here: groups of 32 to 256 inputs; on CUDA,
    tinygemm's bf16 kernel (Ampere on), whose tiles want 8 output rows and 32 inputs at a time."""
    if group not in INT4_GROUPS:
        return False
    if device.type == "cpu":
        return True
    return (device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
            and n_out % 8 == 0 and n_in % 32 == 0)


def fused(weights: list[TensorPayload], biases: list[torch.Tensor | None]) -> tuple[TensorPayload, torch.Tensor | None] | None:
    """Linears that read the same input (q, k and v; gate and up) as one, their output rows one
    after the other: one product instead of several. None where they do not stack (some quantized
    and some not, or with different schemes or act-order groups)."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        weight = torch.cat(weights, 0)
    elif all(isinstance(w, QuantizedTensor) for w in weights):
        first = weights[0]
        same_groups = all((w.group_index is None) == (first.group_index is None) and
                          (w.group_index is None or torch.equal(w.group_index, first.group_index)) for w in weights)
        if not same_groups or any(w.spec != first.spec for w in weights) or first.spec.granularity == "block":
            return None
        weight = QuantizedTensor(first.spec, torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]),
                                 torch.cat([w.zeros for w in weights]), first.group_index)
    else:
        return None
    if all(b is None for b in biases):
        return weight, None
    rows = [w.shape[0] for w in weights]
    return weight, torch.cat([b if b is not None else torch.zeros(n) for b, n in zip(biases, rows)])


def make_linear(weight: TensorPayload, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                cuda_kernels: bool = True) -> Linear:
    """The fastest layer this machine has for ``weight`` (a float tensor or a quantized one);
    ``cuda_kernels`` False: without runner/engine/cuda_linear.py's (its fallback)."""
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if cuda_kernels and device.type == "cuda" and isinstance(weight, QuantizedTensor):
        from runner.engine.cuda_linear import cuda_linear

        return cuda_linear(weight, bias, dtype, device, lambda: make_linear(weight, bias, dtype, device, cuda_kernels=False))
    if isinstance(weight, QuantizedTensor) and device.type in ("cpu", "cuda") and weight.spec.format == "int":
        spec, (n_out, n_in) = weight.spec, weight.shape
        groups = weight.scales.shape[1]
        if spec.bits == 8 and groups == 1 and weight.group_index is None and device.type == "cpu":
            return Int8Linear(weight, bias, dtype, device)
        if spec.bits == 4 and _equal_groups(weight) and _int4_runs(n_out, n_in, n_in // groups, dtype, device):
            return Int4Linear(weight, bias, dtype, device)
    dense = (weight.dequantize() if isinstance(weight, QuantizedTensor) else weight).to(device=device, dtype=dtype)
    packs = device.type == "cpu" and torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    layer = PackedLinear(dense, bias) if packs else Linear(dense, bias)
    if isinstance(weight, QuantizedTensor):
        layer.kind = f"dequantized {weight.spec.label}"
    return layer
