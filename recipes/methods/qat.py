"""Quantization-aware training, layer by layer on the calibration text (quant/qat.py): its
weights land on the grid its exports store, and each Linear's output error comes with them.

With ``gguf: Q4_0`` the grid is Q4_0's (blocks of 32, one fp16 scale, levels 0..15 around 8); with
``gguf: Q4_K_M`` or ``Q4_K_S`` it is Q4_K's for the tensors llama.cpp gives that type in such a
file. The variant's tensors are planned as llama.cpp plans the file, and the trained blocks are
written into it as they are; the tensors QAT does not train (Q6_K ones, say) are encoded as
llama.cpp would.
"""

from __future__ import annotations

from core.tensors import GGMLTensor, LayerResult, QuantizedTensor
from quant.ggml.legacy import q4_0_from_levels
from quant.qat import qat_model
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
        plan.quantized = {n for n in plan.names if n in chosen and plan.ggml_types[n] == w.trained_type}
        return plan

    def fits(self, weights) -> bool:
        return True

    def fit(self, ckpt, variant, windows, report=None, checkpoint=None):
        w = variant.weights

        def on_step(phase: str, step: int, steps: int, loss: float) -> None:
            if report is not None and ((step + 1) % 10 == 0 or step + 1 == steps):
                report(f"{phase} step {step + 1}/{steps} loss {loss:.3g}")

        plan = self.plan(ckpt, variant, False)
        modules = [n.removesuffix(".weight") for n in plan.quantized]
        trained = qat_model(ckpt, windows, w.grid, w.settings, modules, on_step, checkpoint)
        if w.gguf is None:
            return trained
        # the trained blocks as they are; the rest (norms the end-to-end phase trained, weights of
        # other types) encoded in the file's own types
        return (LayerResult({n: _gguf(plan, n, t) for n, t in layer.tensors.items()}, layer.statistics, layer.errors)
                for layer in trained)

    def quantize(self, ckpt, variant, plan, name, tensor, imatrix):
        if variant.weights.gguf is None:
            return finite(ckpt, name, tensor)
        return gguf_encode(plan, name, tensor, None)

    def gguf_type(self, weights) -> str | None:
        return weights.gguf

    def describe(self, weights) -> str:
        grid = weights.gguf or weights.spec.label
        e2e = f" + {weights.e2e_steps} end to end" if weights.e2e_steps else ""
        return f"qat {grid} from {weights.init}, {weights.steps} steps{e2e}"


def _gguf(plan, name: str, tensor) -> GGMLTensor:
    if isinstance(tensor, QuantizedTensor):  # on Q4_0's grid
        return GGMLTensor("Q4_0", q4_0_from_levels(tensor.codes.numpy(), tensor.scales.numpy()), tensor.shape)
    if isinstance(tensor, GGMLTensor):  # trained on Q4_K's
        return tensor
    return gguf_encode(plan, name, tensor, None)
