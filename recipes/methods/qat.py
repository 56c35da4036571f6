"""Quantization-aware training, layer by layer on the calibration text (quant/qat.py): its
weights land on the grid its exports store, and each Linear's output error comes with them."""

from __future__ import annotations

from quant.qat import qat_model
from recipes.methods import WeightMethod, chosen_modules, register


@register("qat")
class QAT(WeightMethod):
    def fits(self, weights) -> bool:
        return True

    def fit(self, ckpt, variant, windows, report=None):
        w = variant.weights
        layers = ckpt.arch.layers

        def on_step(prefix: str, step: int, loss: float) -> None:
            if report is not None and (step + 1) % 10 == 0:
                layer = int(prefix.rstrip(".").rsplit(".", 1)[-1])
                report(f"layer {layer + 1}/{layers} step {step + 1}/{w.steps} loss {loss:.3g}")

        return qat_model(ckpt, windows, w.spec, w.settings, chosen_modules(ckpt, w), on_step)

    def describe(self, weights) -> str:
        return f"qat {weights.spec.label} from {weights.init}, {weights.steps} steps"
