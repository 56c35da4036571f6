"""What a quantized tensor holds, in each of the forms a quantizer hands downstream.

Quantizers produce these, writers and evaluators consume them: formats/ and evalsuite/ work on any
quantizer's output without knowing how it was made.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Union

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from core.schemes import QuantSpec, code_values

@dataclass(frozen=True)
class QuantizedTensor:
    """Codes with their scales, in the weight's own ``[out, in]`` layout (unpacked).

    ``codes`` are uint8: integer levels in ``[0, 2**bits - 1]``, fp8 bit patterns, or nf4/fp4
    table indices (see ``code_values``). The real value is ``(code_values(codes) - zeros) *
    scales``, with scales and zeros broadcast over each group. Symmetric integer specs use the
    fixed mid-level zero ``2**(bits-1)`` and float formats the zero 0, so one dequantization
    formula serves all. Scales and zeros are ``[out, n_groups]``, or ``[out/B, in/B]`` for
    ``B x B`` blocks. Groups are runs of consecutive input columns, unless ``group_index`` says
    which group each column belongs to (GPTQ with act-order forms groups in the order it visits
    columns; GPTQ checkpoints store this as ``g_idx``). Writers pack codes into their own layouts;
    nothing here assumes a file format.
    """

    spec: QuantSpec
    codes: torch.Tensor  # uint8 [out, in]
    scales: torch.Tensor  # float32 [out, n_groups] or [out/B, in/B]
    zeros: torch.Tensor  # float32, the shape of scales
    group_index: torch.Tensor | None = None  # int32 [in]: the group of each input column

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def rows(self, rows: slice) -> QuantizedTensor:
        """The quantized rows ``rows`` of this weight: rows are quantized independently (blocks
        excepted), so a fused projection splits into its parts without re-quantizing."""
        if self.spec.granularity == "block":
            raise ValueError("block-quantized weights do not split by rows")
        return replace(self, codes=self.codes[rows], scales=self.scales[rows], zeros=self.zeros[rows])

    def dequantize(self) -> torch.Tensor:
        out, n_in = self.codes.shape
        values = code_values(self.codes, self.spec.format)
        if self.group_index is not None:
            g = self.group_index.long()
            return (values - self.zeros[:, g]) * self.scales[:, g]
        if self.spec.granularity == "block":
            rows, cols = self.scales.shape
            q = values.reshape(rows, out // rows, cols, n_in // cols)
            w = (q - self.zeros[:, None, :, None]) * self.scales[:, None, :, None]
            return w.reshape(out, n_in)
        n_groups = self.scales.shape[1]
        q = values.reshape(out, n_groups, n_in // n_groups)
        w = (q - self.zeros.unsqueeze(-1)) * self.scales.unsqueeze(-1)
        return w.reshape(out, n_in)

    @property
    def bits_per_weight(self) -> float:
        """Code bits plus the amortised cost of the scales (fp16 for integers, as their checkpoints
        store them; fp32 for float formats, as bitsandbytes and fp8 checkpoints store them), of
        zero-points when asymmetric, and of a 32-bit group index per input column where there is one."""
        per_scale = (16 if self.spec.format == "int" else 32) + (0 if self.spec.symmetric else self.spec.bits)
        n_scales = 1 if self.spec.granularity == "tensor" else self.scales.numel()
        index_bits = 0 if self.group_index is None else 32 * self.group_index.numel()
        return self.spec.bits + (per_scale * n_scales + index_bits) / self.codes.numel()


@dataclass(frozen=True)
class GGMLTensor:
    """A tensor already encoded in one ggml type (F32, F16, Q8_0, ...), rows in the weight's layout.

    ``raw`` is what goes into a GGUF file for this tensor: float arrays for F32/F16/BF16, and a
    ``uint8 [rows, row_bytes]`` array of blocks for block-quantized types. Rows are independent,
    so a writer may reorder rows (llama's Q/K permutation) without re-quantizing.
    """

    ggml_type: str
    raw: np.ndarray
    shape: tuple[int, ...]

    def dequantize(self) -> torch.Tensor:
        """float32 values, decoded a few MiB of rows at a time: gguf-py's decoders hold several
        float32 intermediates of their input's size (about 17 bytes a weight for Q4_K), which for
        a 128256-row embedding would be 9 GB at once."""
        kind = GGMLQuantizationType[self.ggml_type]
        raw = self.raw.reshape(-1, self.raw.shape[-1])
        out = np.empty((raw.shape[0], self.shape[-1]), np.float32)
        step = max(1, _DECODE_CHUNK // out.shape[1])
        for start in range(0, raw.shape[0], step):
            out[start : start + step] = dequantize(raw[start : start + step], kind).reshape(-1, out.shape[1])
        return torch.from_numpy(out).reshape(self.shape)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        """float32 values of the rows ``index`` picks (a slice, or row numbers) of the weight as
        ``[rows, last dimension]``, decoding only those: an output head read a slice at a time."""
        raw = self.raw.reshape(-1, self.raw.shape[-1])
        picked = raw[index] if isinstance(index, slice) else raw[index.cpu().numpy()]
        values = dequantize(picked, GGMLQuantizationType[self.ggml_type]).reshape(-1, self.shape[-1])
        return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.raw.nbytes / int(np.prod(self.shape))


_DECODE_CHUNK = 2**20  # weights per decoded slice of a ggml tensor: 4 MiB of float32


@dataclass(frozen=True)
class StoredGGMLTensor(GGMLTensor):
    """A GGUF source's tensor exactly as its file stores it (llama's q/k rows interleaved, Gemma's
    norms plus one), so a GGUF file written from it holds the same bytes; ``values`` is the weight
    as the model computes with it."""

    values: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.values

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        return self.values.reshape(-1, self.shape[-1])[index]


# What a quantizer hands downstream for one tensor: left as it was, integer-quantized (possibly with
# 16-bit outlier columns), or ggml-encoded.
TensorPayload = Union[torch.Tensor, QuantizedTensor, GGMLTensor, "MixedPrecisionTensor"]


def dequantized(payload: TensorPayload) -> torch.Tensor:
    """The float32 weights a payload stands for: what an evaluation or a dense export uses."""
    if isinstance(payload, torch.Tensor):
        return payload.to(torch.float32)
    return payload.dequantize()


def float_rows(payload: TensorPayload, index: slice | torch.Tensor) -> torch.Tensor:
    """The float32 rows ``index`` picks (a slice, or row numbers) of the weights a payload stands
    for, as ``[rows, last dimension]``. A float tensor's rows and ggml blocks' are converted alone,
    so that an 8B model's 128256-row embedding or head need not be in float32 whole (2 GiB); other
    payloads are decoded whole first (a caller taking many slices of one decodes it once)."""
    if isinstance(payload, torch.Tensor):
        return payload.reshape(-1, payload.shape[-1])[index].to(torch.float32)
    if isinstance(payload, GGMLTensor):
        return payload.rows(index)
    whole = payload.dequantize()
    return whole.reshape(-1, whole.shape[-1])[index]


class LayerResult(NamedTuple):
    """One decoder layer's output of a calibrated pass (GPTQ, AWQ, SmoothQuant, outlier columns):
    its tensors by weight name (on the CPU), the per-Linear input statistics
    (``quant.outliers.channel_statistics``) by module name, and the relative output error of each
    Linear it quantized (``quant.error``), by module name, where the pass measured it."""

    tensors: dict[str, TensorPayload]
    statistics: dict[str, dict]
    errors: dict[str, float]


@dataclass(frozen=True)
class MixedPrecisionTensor:
    """A quantized weight whose few outlier input columns are kept in fp16 (LLM.int8-style).

    Input channels that carry very large activations multiply their weight column's rounding error;
    keeping those columns in 16 bits removes the largest share of the output error for a few bits
    per weight. ``base`` covers the whole ``[out, in]`` weight with the outlier columns zeroed (so
    they do not widen any group's range); ``dense`` holds those columns, listed in ``columns``.
    """

    base: QuantizedTensor
    columns: torch.Tensor  # int32 [k]: the input columns kept in 16 bits
    dense: torch.Tensor  # float16 [out, k]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    def dequantize(self) -> torch.Tensor:
        w = self.base.dequantize()
        w[:, self.columns.long()] = self.dense.to(torch.float32)
        return w

    @property
    def bits_per_weight(self) -> float:
        """The base's bits (its codes cover every column) plus 16 bits per kept weight and a 32-bit
        index per kept column."""
        out, n_in = self.base.shape
        return self.base.bits_per_weight + (16 * self.dense.numel() + 32 * self.columns.numel()) / (out * n_in)


def all_finite(x: torch.Tensor) -> bool:
    """Whether no element of ``x`` is NaN or ±Inf, from its least and greatest elements, which a
    NaN anywhere makes NaN: one read of ``x``, where ``torch.isfinite(x).all()`` first makes a
    bool copy of it (on an 8B model's 14336x4096 weight here: 13 ms against 2 s, most of it
    page faults on the copy's fresh memory)."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
