"""Quantization-aware training, layer by layer on the calibration text (quant/qat.py): its
weights land on the grid its exports store, and each Linear's output error comes with them.

With ``gguf: Q4_0`` the grid is Q4_0's (blocks of 32, one fp16 scale, levels 0..15 around 8), the
variant's tensors are planned as llama.cpp plans a Q4_0 file, and the trained blocks are written
into it as they are; the tensors QAT does not train are encoded as llama.cpp would.
"""

from __future__ import annotations

from quant.ggml.legacy import q4_0_from_levels
from quant.qat import qat_model
from quant.types import GGMLTensor, LayerResult, QuantizedTensor
from recipes.methods import Plan, WeightMethod, chosen_modules, finite, grid_plan, register
from recipes.methods.gguf import gguf_encode, gguf_plan


@register("qat")
class QAT(WeightMethod):
    def plan(self, ckpt, variant, imatrix: bool) -> Plan:
        w = variant.weights
        if w.gguf is None:
            return grid_plan(ckpt, variant)
        plan = gguf_plan(ckpt, variant, w.gguf, False)
        chosen = {f"{m}.weight" for m in chosen_modules(ckpt, w)}
        plan.quantized = {n for n in plan.names if n in chosen and plan.ggml_types[n] == w.gguf}
        return plan

    def fits(self, weights) -> bool:
        return True

    def fit(self, ckpt, variant, windows, report=None):
        w = variant.weights
        layers = ckpt.arch.layers

        def on_step(prefix: str, step: int, loss: float) -> None:
            if report is not None and (step + 1) % 10 == 0:
                layer = int(prefix.rstrip(".").rsplit(".", 1)[-1])
                report(f"layer {layer + 1}/{layers} step {step + 1}/{w.steps} loss {loss:.3g}")

        modules = [n.removesuffix(".weight") for n in self.plan(ckpt, variant, False).quantized]
        trained = qat_model(ckpt, windows, w.spec, w.settings, modules, on_step)
        if w.gguf is None:
            return trained
        # only the trained blocks: every other tensor is encoded in the file's own type
        return (LayerResult({n: _q4_0(t) for n, t in layer.tensors.items() if isinstance(t, QuantizedTensor)},
                            layer.statistics, layer.errors) for layer in trained)

    def quantize(self, ckpt, variant, plan, name, tensor, imatrix):
        if variant.weights.gguf is None:
            return finite(ckpt, name, tensor)
        return gguf_encode(plan, name, tensor, None)

    def gguf_type(self, weights) -> str | None:
        return weights.gguf

    def describe(self, weights) -> str:
        grid = weights.gguf or weights.spec.label
        return f"qat {grid} from {weights.init}, {weights.steps} steps"


def _q4_0(tensor: QuantizedTensor) -> GGMLTensor:
    raw = q4_0_from_levels(tensor.codes.numpy(), tensor.scales.numpy())
    return GGMLTensor("Q4_0", raw, tensor.shape)
