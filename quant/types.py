"""The small types every stage shares: how a tensor is quantized, and what a quantized tensor holds.

Recipes build specs, quantizers produce quantized tensors, writers and evaluators consume them.
Keeping them here (and nowhere else) lets formats/ and evalsuite/ work on any quantizer's output
without knowing how it was made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

Granularity = Literal["tensor", "channel", "group"]
RangeChoice = Literal["minmax", "mse"]


@dataclass(frozen=True)
class QuantSpec:
    """An integer weight-quantization scheme.

    Weights are quantized along the input dimension of a Linear weight ``[out, in]``: one scale
    (and zero-point when asymmetric) per tensor, per output channel, or per group of
    ``group_size`` consecutive input columns of one output channel. ``range`` picks each group's
    range: its min and max, or the shrunken range with the least squared error (clipping a few
    outliers to resolve the rest more finely).
    """

    bits: int
    symmetric: bool = True
    granularity: Granularity = "channel"
    group_size: int | None = None
    range: RangeChoice = "minmax"

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be between 2 and 8, got {self.bits}")
        if self.granularity == "group":
            if self.group_size is None or self.group_size < 1:
                raise ValueError("granularity 'group' needs a positive group_size")
        elif self.group_size is not None:
            raise ValueError(f"group_size is only valid with granularity 'group', not '{self.granularity}'")

    @property
    def label(self) -> str:
        """Short human name, e.g. ``int4-g128-asym``."""
        grain = {"tensor": "tensor", "channel": "channel", "group": f"g{self.group_size}"}[self.granularity]
        return f"int{self.bits}-{grain}-{'sym' if self.symmetric else 'asym'}" + ("-mse" if self.range == "mse" else "")


@dataclass(frozen=True)
class QuantizedTensor:
    """Integer codes with their scales, in the weight's own ``[out, in]`` layout (unpacked).

    ``codes`` are unsigned levels in ``[0, 2**bits - 1]``; the real value is
    ``(codes - zeros) * scales``, with scales and zeros broadcast over each group. Symmetric specs
    use the fixed mid-level zero ``2**(bits-1)``, so one dequantization formula serves both.
    Groups are runs of consecutive input columns, unless ``group_index`` says which group each
    column belongs to (GPTQ with act-order forms groups in the order it visits columns; GPTQ
    checkpoints store this as ``g_idx``). Writers pack codes into their own layouts; nothing here
    assumes a file format.
    """

    spec: QuantSpec
    codes: torch.Tensor  # uint8 [out, in]
    scales: torch.Tensor  # float32 [out, n_groups]
    zeros: torch.Tensor  # float32 [out, n_groups]
    group_index: torch.Tensor | None = None  # int32 [in]: the group of each input column

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        out, n_in = self.codes.shape
        if self.group_index is not None:
            g = self.group_index.long()
            return (self.codes.to(torch.float32) - self.zeros[:, g]) * self.scales[:, g]
        n_groups = self.scales.shape[1]
        q = self.codes.to(torch.float32).reshape(out, n_groups, n_in // n_groups)
        w = (q - self.zeros.unsqueeze(-1)) * self.scales.unsqueeze(-1)
        return w.reshape(out, n_in)

    @property
    def bits_per_weight(self) -> float:
        """Code bits plus the amortised cost of fp16 scales (and zero-points when asymmetric) and
        of a 32-bit group index per input column where there is one."""
        per_scale = 16 + (0 if self.spec.symmetric else self.spec.bits)
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
        values = dequantize(self.raw, GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.raw.nbytes / int(np.prod(self.shape))


# What a quantizer hands downstream for one tensor: left as it was, integer-quantized (possibly with
# 16-bit outlier columns), or ggml-encoded.
TensorPayload = Union[torch.Tensor, QuantizedTensor, GGMLTensor, "MixedPrecisionTensor"]


def dequantized(payload: TensorPayload) -> torch.Tensor:
    """The float32 weights a payload stands for: what an evaluation or a dense export uses."""
    if isinstance(payload, torch.Tensor):
        return payload.to(torch.float32)
    return payload.dequantize()


class InputError(Exception):
    """A mistake in what the user gave us (a file, a recipe field, a flag).

    The message is one line that names the offending file, field or tensor; the command line prints
    it without a traceback and exits with status 2.
    """


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
