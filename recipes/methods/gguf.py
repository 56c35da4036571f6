"""Every tensor encoded as llama.cpp's quantizer would for a GGUF file type (quant/ggml.py), in
the file's tensor order when the variant writes a GGUF file; the importance matrix, where asked
for, comes from the pipeline's pass over the calibration text. From a quantized source, an int4
weight that becomes Q4_K keeps its own grid (quant/ggml/regrid.py) rather than being rounded again;
from a GGUF file, a tensor whose type does not change keeps its bytes. ``type: auto`` picks each
tensor's type within a byte budget instead (recipes/type_search.py)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from core.file_types import AUTO, FILE_TYPES, NEEDS_IMATRIX
from core.tensors import GGMLTensor
from formats.gguf_source import GGUFCheckpoint
from formats.quantized_checkpoint import QuantizedCheckpoint
from quant.ggml.regrid import q4_k_from_int4
from recipes.fields import Strict
from recipes.methods import Plan, WeightMethod, gguf_encode, gguf_plan, register
from recipes.type_search import AUTO_CANDIDATES, HEAD_ONLY, auto_plan, searched_plan

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$")
_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class GGUFWeights(Strict):
    """Every tensor encoded as llama.cpp's quantizer would for a GGUF file type, or (``type:
    auto``) in the types that lose least within a budget of ``bpw`` or ``size``."""

    method: Literal["gguf"]
    type: Literal[(*FILE_TYPES, AUTO)]  # type: ignore[valid-type]
    imatrix: bool = False  # weight rounding errors by an importance matrix from the calibration text
    bpw: float | None = Field(default=None, gt=0, le=32)  # type auto: bits per weight of the tensor data
    size: str | None = Field(default=None, validate_default=True)  # type auto: bytes of tensor data, "4.2GB"
    candidates: list[str] | None = Field(default=None, min_length=1)  # type auto: the ggml types to choose from
    # type auto: rank tensors by the proxy alone, or scale each tensor's proxy by the KL divergence
    # that one type of it adds alone on the calibration text, measured (kld) or estimated from Fisher
    # diagonals (fisher; recipes/kld_gains.py); by default fisher where there is calibration text
    # (imatrix: true), the proxy alone where there is none
    sensitivity: Literal["proxy", "kld", "fisher"] | None = None

    @field_validator("size")
    @classmethod
    def _one_budget_for_auto(cls, size: str | None, info: ValidationInfo) -> str | None:
        auto, given = info.data.get("type") == AUTO, (info.data.get("bpw") is not None) + (size is not None)
        if auto and given != 1:
            raise ValueError("type auto needs exactly one budget: bpw (bits per weight) or size (e.g. 4.2GB)")
        if not auto and given:
            raise ValueError("bpw and size are budgets for type auto")
        if size is not None and not _SIZE.match(size):
            raise ValueError(f"'{size}' is not a size such as 4.2GB, 800MB or 3.5GiB")
        return size

    @field_validator("candidates")
    @classmethod
    def _known_candidates(cls, candidates: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if candidates is None:
            return None
        if info.data.get("type") != AUTO:
            raise ValueError("candidates are for type auto")
        for name in candidates:
            if name not in (*AUTO_CANDIDATES, *HEAD_ONLY):
                raise ValueError(f"'{name}' is not a candidate type; choose among {', '.join(AUTO_CANDIDATES + HEAD_ONLY)}")
            if name in NEEDS_IMATRIX and not info.data.get("imatrix"):
                raise ValueError(f"llama.cpp makes {name} only with an importance matrix: add imatrix: true")
        return candidates

    @field_validator("sensitivity")
    @classmethod
    def _kld_on_calibration_text(cls, sensitivity: str | None, info: ValidationInfo) -> str | None:
        if sensitivity is not None and info.data.get("type") != AUTO:
            raise ValueError("sensitivity is for type auto")
        if sensitivity in ("kld", "fisher") and not info.data.get("imatrix"):
            raise ValueError(f"sensitivity {sensitivity} is measured on the calibration text: add imatrix: true")
        return sensitivity

    @property
    def calibrated(self) -> bool:
        return self.imatrix

    @property
    def sensitivity_used(self) -> str:
        """How type auto puts tensors on one scale (``sensitivity``, or its default)."""
        return self.sensitivity or ("fisher" if self.imatrix else "proxy")

    def budget_bytes(self, weights: int) -> float:
        """The budget in bytes of tensor data, for a model of ``weights`` values."""
        if self.bpw is not None:
            return self.bpw * weights / 8
        number, unit = _SIZE.match(self.size).groups()
        return float(number) * _UNITS[unit]


@register("gguf")
class GGUF(WeightMethod):
    weights = GGUFWeights
    on_grid = False

    def plan(self, ckpt, variant, imatrix: bool) -> Plan:
        if variant.weights.type == AUTO:
            return auto_plan(ckpt, variant, imatrix)
        return gguf_plan(ckpt, variant, variant.weights.type, imatrix)

    def settle(self, ckpt, variant, plan, imatrix, windows, progress) -> Plan:
        if variant.weights.type != AUTO:
            return plan
        return searched_plan(ckpt, variant, plan, imatrix, windows, progress)

    def quantize(self, ckpt, variant, plan, name, tensor, imatrix):
        if isinstance(ckpt, GGUFCheckpoint) and ckpt.ggml_type(name) == plan.ggml_types[name]:
            return ckpt.stored(name)
        if plan.ggml_types[name] == "Q4_K" and isinstance(ckpt, QuantizedCheckpoint) and name in ckpt.quantized:
            raw = q4_k_from_int4(ckpt.payload(name))
            if raw is not None:
                return GGMLTensor("Q4_K", raw, tuple(ckpt.shape(name)))
        return gguf_encode(plan, name, tensor, imatrix)

    def gguf_type(self, weights) -> str:
        return weights.type

    def describe(self, weights) -> str:
        budget = "" if weights.type != AUTO else f" {weights.bpw:g} bpw" if weights.bpw is not None else f" {weights.size}"
        kld = f" {weights.sensitivity_used}" if weights.type == AUTO and weights.sensitivity_used != "proxy" else ""
        return f"gguf {weights.type}{budget}{kld}" + (" imatrix" if weights.imatrix else "")
