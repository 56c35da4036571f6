"""The field bases that the recipe (recipes/schema.py) and each weight method's weights class
(recipes/methods/) share: a module of its own, so that the methods need not import the schema,
which imports them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from core.schemes import FORMAT_BITS, NumberFormat, QuantSpec

AUTO = "auto"  # ``bits: auto``: each Linear's grid chosen within a budget (recipes/bit_search.py)
# the grids ``bits: auto`` may choose among, by the name a recipe's ``candidates`` gives them: (bits, group size;
# None: one scale per output channel); the integer widths vLLM's GPTQ and compressed-tensors kernels take
GRIDS = {f"int{b}-{'channel' if g is None else f'g{g}'}": (b, g) for b in (4, 8) for g in (32, 64, 128, None)}
# the default candidates: those vLLM's CPU build serves (its only weight-only kernel, CPUWNA16, takes 4-bit codes
# alone, by any even group size; bench/vllm_interop.py), all of them mixed in one checkpoint
VLLM_CPU_GRIDS = ("int4-g32", "int4-g64", "int4-g128", "int4-channel")
# a candidate beside the grids: the Linear left unquantized, 16 bits a weight as the exports store it (every
# loader takes it, vLLM's CPU build included: a checkpoint of 4- and 16-bit Linears)
UNQUANTIZED = "16-bit"


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
    bits: int | str | None = Field(default=None, validate_default=True)  # 2-8, or "auto" (checked below)
    bpw: float | None = Field(default=None, gt=0, le=16)  # bits auto: bits per weight of the targeted Linears, scales included (16 where one stays unquantized)
    candidates: list[Literal[(*GRIDS, UNQUANTIZED)]] | None = Field(default=None, min_length=1)  # type: ignore[valid-type]
    # bits auto: rank grids by the proxy alone, or scale each Linear's proxies by the KL divergence it adds
    # alone on the calibration text, measured (kld) or estimated from Fisher diagonals (fisher, the
    # default; recipes/kld_gains.py)
    sensitivity: Literal["proxy", "kld", "fisher"] | None = None
    symmetric: bool = True
    range: Literal["minmax", "mse", "percentile"] = "minmax"
    percentile: float | None = Field(default=None, gt=50, le=100)  # with range 'percentile'; default 99.9

    @field_validator("bits")
    @classmethod
    def _bits_match_the_format(cls, bits: int | str | None, info: ValidationInfo) -> int | str | None:
        fmt = info.data.get("format")  # absent when invalid: that error is reported first
        if fmt == "int" and bits is None:
            raise PydanticCustomError("missing", "Field required")
        if isinstance(bits, str) and bits != AUTO or isinstance(bits, int) and not 2 <= bits <= 8:
            raise ValueError(f"{bits!r} is not a width from 2 to 8 bits, nor auto")
        if fmt not in FORMAT_BITS:
            return bits
        if bits is not None and bits != FORMAT_BITS[fmt]:
            raise ValueError(f"format '{fmt}' is {FORMAT_BITS[fmt]} bits wide, not {bits} (bits may be left out)")
        return FORMAT_BITS[fmt]

    @model_validator(mode="after")
    def _auto_bits_have_a_budget(self) -> "GridWeights":
        if self.bits == AUTO:
            if self.format != "int":
                raise ValueError("bits auto chooses among integer grids: format must be int")
            if self.bpw is None:
                raise ValueError("bits auto needs a budget: bpw (bits per weight of the targeted Linears, scales included)")
            chosen = {"group_size", "granularity"} & self.model_fields_set
            if chosen:
                raise ValueError(f"bits auto chooses each Linear's grid among candidates: leave out {', '.join(sorted(chosen))}")
            if self.candidates and set(self.candidates) == {UNQUANTIZED}:
                raise ValueError(f"bits auto needs an integer grid among its candidates, not only {UNQUANTIZED}")
        elif self.bpw is not None or self.candidates is not None or self.sensitivity is not None:
            raise ValueError("bpw, candidates and sensitivity are for bits auto")
        return self

    @property
    def searches_bits(self) -> bool:
        """Whether each Linear's grid is chosen within the ``bpw`` budget (``bits: auto``)."""
        return self.bits == AUTO

    @property
    def sensitivity_used(self) -> str:
        """How bits auto puts Linears on one scale (``sensitivity``, or its default)."""
        return (self.sensitivity or "fisher") if self.searches_bits else "proxy"

    @property
    def grids(self) -> list[QuantSpec]:
        """The candidate grids of ``bits: auto``, smallest first by bits per weight, or the one grid."""
        if not self.searches_bits:
            return [self.spec]
        named = [GRIDS[name] for name in self.candidates or VLLM_CPU_GRIDS if name != UNQUANTIZED]
        specs = {self._grid(b, "channel" if g is None else "group", g) for b, g in named}
        return sorted(specs, key=lambda s: (s.bits, -(s.group_size or 1 << 30)))

    @property
    def keeps_16_bit(self) -> bool:
        """Whether ``bits: auto`` may leave a Linear unquantized (the candidate ``16-bit``)."""
        return UNQUANTIZED in (self.candidates or ())

    @property
    def imatrix(self) -> bool:
        """Whether the job measures an importance matrix for this variant: ``bits: auto`` weighs
        each candidate's rounding error by it (recipes/bit_search.py)."""
        return self.searches_bits

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
        """The weights' grid; with ``bits: auto`` the narrowest candidate, which each Linear has until the
        search (recipes/bit_search.py) gives it its own."""
        return self.grids[0] if self.searches_bits else self._grid(self.bits, granularity, group_size)

    def _grid(self, bits: int, granularity: str, group_size: int | None) -> QuantSpec:
        percentile = 99.9 if self.percentile is None else self.percentile
        return QuantSpec(bits, self.symmetric, granularity, group_size, self.range, self.format, percentile)
