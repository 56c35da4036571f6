"""How a tensor is quantized: the number formats and their code tables, and the weight scheme
(``QuantSpec``) that recipes build, quantizers follow and checkpoint writers name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Granularity = Literal["tensor", "channel", "group", "block"]
RangeChoice = Literal["minmax", "mse", "percentile"]
NumberFormat = Literal["int", "fp8_e4m3", "fp8_e5m2", "nf4", "fp4"]

# The float formats' fixed widths. They are scale-only: a code stands for a fixed number and the
# group's scale stretches it; the integer format spreads 2**bits levels around a zero-point.
FORMAT_BITS = {"fp8_e4m3": 8, "fp8_e5m2": 8, "nf4": 4, "fp4": 4}
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# bitsandbytes 0.50.2's 4-bit code tables (bitsandbytes/functional.py, get_4bit_type), as the
# float32 values it uses (its raw table divided by its largest magnitude), indexed by the 4-bit code.
# nf4: quantiles of N(0, 1) with equal probability mass (QLoRA), sorted, exact 0 at code 7.
# fp4: 1 sign, 2 exponent, 1 mantissa bit, in bit-pattern order (codes 0 and 8 are +0 and -0).
FOUR_BIT_CODES = {
    "nf4": torch.tensor([
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ], dtype=torch.float32),
    "fp4": torch.tensor([
        0.0, 0.0052083334885537624, 0.6666666865348816, 1.0,
        0.3333333432674408, 0.5, 0.1666666716337204, 0.25,
        -0.0, -0.0052083334885537624, -0.6666666865348816, -1.0,
        -0.3333333432674408, -0.5, -0.1666666716337204, -0.25,
    ], dtype=torch.float32),
}


# The largest code magnitude of each float format: a group's range maps onto ±FORMAT_MAX.
# 448 (e4m3fn), 57344 (e5m2), and 1 for nf4/fp4, whose tables bitsandbytes normalises.
FORMAT_MAX = {fmt: float(torch.finfo(dtype).max) for fmt, dtype in FP8_DTYPES.items()} | {
    fmt: float(table.abs().max()) for fmt, table in FOUR_BIT_CODES.items()
}


def code_values(codes: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """The number each uint8 code stands for, before its scale (and zero-point) apply: the level
    itself for integers, the fp8 number whose bit pattern it is, the table entry for nf4/fp4.

    This is the one decoder: dequantization here and the quantizers' error terms (quant/rtn.py)
    both use it, so a checkpoint reader and a quantizer can never disagree on what a code means."""
    if fmt == "int":
        return codes.to(torch.float32)
    if fmt in FP8_DTYPES:
        return codes.view(FP8_DTYPES[fmt]).to(torch.float32)
    return FOUR_BIT_CODES[fmt].to(codes.device)[codes.long()]


@dataclass(frozen=True)
class QuantSpec:
    """A weight-quantization scheme.

    Weights are quantized along the input dimension of a Linear weight ``[out, in]``: one scale
    (and zero-point when asymmetric) per tensor, per output channel, per group of ``group_size``
    consecutive input columns of one output channel, or per square ``group_size x group_size``
    block (rows x columns, as DeepSeek-V3's fp8 weights and compressed-tensors' "block" strategy).
    ``range`` picks each group's range: its min and max, the shrunken range with the least squared
    error (clipping a few outliers to resolve the rest more finely), or the ``percentile`` of the
    magnitudes (symmetric) or the (100 - p, p) percentiles (asymmetric).

    ``format`` is what a code means: ``int`` levels with ``bits`` 2-8, or a scale-only float
    format of fixed width (fp8 e4m3/e5m2 as torch casts them; nf4/fp4 with bitsandbytes' tables).
    """

    bits: int
    symmetric: bool = True
    granularity: Granularity = "channel"
    group_size: int | None = None
    range: RangeChoice = "minmax"
    format: NumberFormat = "int"
    percentile: float = 99.9

    def __post_init__(self) -> None:
        if self.format != "int" and self.format not in FORMAT_BITS:
            raise ValueError(f"format must be one of int, {', '.join(FORMAT_BITS)}; got '{self.format}'")
        if self.format == "int" and not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be between 2 and 8, got {self.bits}")
        if self.format != "int":
            if self.bits != FORMAT_BITS[self.format]:
                raise ValueError(f"format '{self.format}' is {FORMAT_BITS[self.format]} bits wide, got bits {self.bits}")
            if not self.symmetric:
                raise ValueError(f"format '{self.format}' is scale-only: it needs symmetric true")
        if self.granularity not in ("tensor", "channel", "group", "block"):
            raise ValueError(f"granularity must be tensor, channel, group or block; got '{self.granularity}'")
        if self.granularity in ("group", "block"):
            if self.group_size is None or self.group_size < 1:
                raise ValueError(f"granularity '{self.granularity}' needs a positive group_size")
        elif self.group_size is not None:
            raise ValueError(f"group_size is only valid with granularity 'group' or 'block', not '{self.granularity}'")
        if self.range not in ("minmax", "mse", "percentile"):
            raise ValueError(f"range must be minmax, mse or percentile; got '{self.range}'")
        if not 50 < self.percentile <= 100:
            raise ValueError(f"percentile must be above 50 and at most 100, got {self.percentile}")

    @property
    def label(self) -> str:
        """Short human name, e.g. ``int4-g128-asym``, ``int8-b128-sym``, ``nf4-g64``, ``fp8_e4m3-channel-p99.9``."""
        grain = {"tensor": "tensor", "channel": "channel", "group": f"g{self.group_size}", "block": f"b{self.group_size}"}
        if self.format == "int":
            name = f"int{self.bits}-{grain[self.granularity]}-{'sym' if self.symmetric else 'asym'}"
        else:
            name = f"{self.format}-{grain[self.granularity]}"
        return name + {"minmax": "", "mse": "-mse", "percentile": f"-p{self.percentile:g}"}[self.range]


@dataclass(frozen=True)
class ActivationSpec:
    """Per-token dynamic symmetric quantization of a Linear's input: ``int8`` (scale = token absmax
    / 127, codes rounded to nearest in [-127, 127]) or ``fp8`` (e4m3, scale = token absmax / 448,
    codes rounded as torch's ``float8_e4m3fn`` cast rounds). Scales stay float32, as kernels keep
    dynamic scales."""

    format: Literal["int8", "fp8"]

    def __post_init__(self) -> None:
        if self.format not in ("int8", "fp8"):
            raise ValueError(f"activation format must be 'int8' or 'fp8', got {self.format!r}")

    @property
    def label(self) -> str:
        """Short human name, e.g. ``a-int8-token``."""
        return {"int8": "a-int8-token", "fp8": "a-fp8e4m3-token"}[self.format]
