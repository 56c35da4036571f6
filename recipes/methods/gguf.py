"""Every tensor encoded as llama.cpp's quantizer would for a GGUF file type (quant/ggml.py), in
the file's tensor order when the variant writes a GGUF file; the importance matrix, where asked
for, comes from the pipeline's pass over the calibration text."""

from __future__ import annotations

from formats.gguf import architecture_of, gguf_name, gguf_order
from quant.ggml import encode, tensor_types
from recipes.methods import Plan, WeightMethod, register


@register("gguf")
class GGUF(WeightMethod):
    def plan(self, ckpt, variant, imatrix: bool) -> Plan:
        names = ckpt.names
        if "gguf" in variant.exports:
            architecture_of(ckpt)
            names = sorted((n for n in names if gguf_name(n) is not None), key=lambda n: gguf_order(gguf_name(n)))
        return Plan(names, tensor_types(variant.weights.type, [(n, ckpt.shape(n)) for n in names], ckpt.arch, imatrix))

    def quantize(self, ckpt, variant, plan, name, tensor, imatrix):
        return encode(tensor, plan.ggml_types[name], name, imatrix.get(name) if imatrix else None)

    def describe(self, weights) -> str:
        return f"gguf {weights.type}" + (" imatrix" if weights.imatrix else "")
