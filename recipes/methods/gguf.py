"""Every tensor encoded as llama.cpp's quantizer would for a GGUF file type (quant/ggml.py), in
the file's tensor order when the variant writes a GGUF file; the importance matrix, where asked
for, comes from the pipeline's pass over the calibration text. From a quantized source, an int4
weight that becomes Q4_K keeps its own grid (quant/ggml/regrid.py) rather than being rounded again;
from a GGUF file, a tensor whose type does not change keeps its bytes."""

from __future__ import annotations

from core.file_types import tensor_types
from core.tensors import GGMLTensor
from formats.gguf import architecture_of, gguf_name, gguf_order
from formats.gguf_source import GGUFCheckpoint
from formats.quantized_checkpoint import QuantizedCheckpoint
from quant.ggml import encode
from quant.ggml.regrid import q4_k_from_int4
from recipes.methods import Plan, WeightMethod, register


def gguf_plan(ckpt, variant, file_type: str, imatrix: bool) -> Plan:
    """Every tensor's ggml type for ``file_type`` (llama.cpp's mixture), in the GGUF file's tensor
    order when the variant writes a GGUF file."""
    names = ckpt.names
    if "gguf" in variant.exports:
        architecture_of(ckpt)
        names = sorted((n for n in names if gguf_name(n, ckpt.arch) is not None), key=lambda n: gguf_order(gguf_name(n, ckpt.arch)))
    return Plan(names, tensor_types(file_type, [(n, ckpt.shape(n)) for n in names], ckpt.arch, imatrix))


def gguf_encode(plan: Plan, name: str, tensor, imatrix) -> object:
    return encode(tensor, plan.ggml_types[name], name, imatrix.get(name) if imatrix else None)


@register("gguf")
class GGUF(WeightMethod):
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
