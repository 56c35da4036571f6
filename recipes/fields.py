"""The field bases that the recipe (recipes/schema.py) and each weight method's weights class
(recipes/methods/) share: a module of its own, so that the methods need not import the schema,
which imports them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from core.schemes import FORMAT_BITS, NumberFormat, QuantSpec


class Strict(BaseModel):
    """Every recipe section: an unknown field is an error, and a parsed recipe does not change."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Targeted(Strict):
    """Which decoder Linear modules a method quantizes: name patterns (shell-style, e.g.
    ``*.mlp.*``) to include and to leave in full precision. The output head is never quantized."""

    targets: list[str] = Field(default=["*"], min_length=1)
    ignore: list[str] = []


class GridWeights(Targeted):
    """The number format and range fields that RTN and GPTQ share. Each is checked against the
    format in its own validator, so an error names the field (``weights.bits``), not the variant.
    Float formats have a fixed width: ``bits`` may be left out, and must match when given."""

    format: NumberFormat = "int"
    bits: int | None = Field(default=None, ge=2, le=8, validate_default=True)
    symmetric: bool = True
    range: Literal["minmax", "mse", "percentile"] = "minmax"
    percentile: float | None = Field(default=None, gt=50, le=100)  # with range 'percentile'; default 99.9

    @field_validator("bits")
    @classmethod
    def _bits_match_the_format(cls, bits: int | None, info: ValidationInfo) -> int | None:
        fmt = info.data.get("format")  # absent when invalid: that error is reported first
        if fmt == "int" and bits is None:
            raise PydanticCustomError("missing", "Field required")
        if fmt not in FORMAT_BITS:
            return bits
        if bits is not None and bits != FORMAT_BITS[fmt]:
            raise ValueError(f"format '{fmt}' is {FORMAT_BITS[fmt]} bits wide, not {bits} (bits may be left out)")
        return FORMAT_BITS[fmt]

    @field_validator("symmetric")
    @classmethod
    def _float_formats_are_symmetric(cls, symmetric: bool, info: ValidationInfo) -> bool:
        fmt = info.data.get("format", "int")
        if fmt != "int" and not symmetric:
            raise ValueError(f"format '{fmt}' is scale-only (no zero-point): symmetric must be true")
        return symmetric

    @field_validator("percentile")
    @classmethod
    def _percentile_needs_its_range(cls, percentile: float | None, info: ValidationInfo) -> float | None:
        if percentile is not None and info.data.get("range") != "percentile":
            raise ValueError("percentile is only valid with range 'percentile'")
        return percentile

    def _spec(self, granularity: str, group_size: int | None) -> QuantSpec:
        percentile = 99.9 if self.percentile is None else self.percentile
        return QuantSpec(self.bits, self.symmetric, granularity, group_size, self.range, self.format, percentile)
