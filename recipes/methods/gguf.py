"""Every tensor encoded as llama.cpp's quantizer would for a GGUF file type (quant/ggml.py), in
the file's tensor order when the variant writes a GGUF file; the importance matrix, where asked
for, comes from the pipeline's pass over the calibration text. From a quantized source, an int4
weight that becomes Q4_K keeps its own grid (quant/ggml/regrid.py) rather than being rounded again;
from a GGUF file, a tensor whose type does not change keeps its bytes."""

from __future__ import annotations

from typing import Literal

from core.file_types import FILE_TYPES
from core.tensors import GGMLTensor
from formats.gguf_source import GGUFCheckpoint
from formats.quantized_checkpoint import QuantizedCheckpoint
from quant.ggml.regrid import q4_k_from_int4
from recipes.fields import Strict
from recipes.methods import Plan, WeightMethod, gguf_encode, gguf_plan, register


class GGUFWeights(Strict):
    """Every tensor encoded as llama.cpp's quantizer would for a GGUF file type."""

    method: Literal["gguf"]
    type: Literal[tuple(FILE_TYPES)]  # type: ignore[valid-type]
    imatrix: bool = False  # weight rounding errors by an importance matrix from the calibration text

    @property
    def calibrated(self) -> bool:
        return self.imatrix


@register("gguf")
class GGUF(WeightMethod):
    weights = GGUFWeights
    on_grid = False

    def plan(self, ckpt, variant, imatrix: bool) -> Plan:
        return gguf_plan(ckpt, variant, variant.weights.type, imatrix)

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
        return f"gguf {weights.type}" + (" imatrix" if weights.imatrix else "")
