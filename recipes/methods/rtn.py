"""Round-to-nearest on the chosen decoder Linears, optionally keeping each one's outlier input
columns in fp16 (fitted on the calibration text: quant/outliers.py)."""

from __future__ import annotations

from quant.outliers import mixed_precision_model
from quant.rtn import quantize_rtn
from quant.smoothquant import rtn_layer
from recipes.methods import WeightMethod, chosen_modules, finite, register


@register("rtn")
class RTN(WeightMethod):
    def fits(self, weights) -> bool:
        return weights.outliers is not None

    def fit(self, ckpt, variant, windows, report=None, checkpoint=None):
        w = variant.weights
        return mixed_precision_model(ckpt, windows, w.spec, w.outliers.rule, chosen_modules(ckpt, w))

    def quantize(self, ckpt, variant, plan, name, tensor, imatrix):
        if name in plan.quantized:
            return quantize_rtn(tensor, variant.weights.spec, name)
        return finite(ckpt, name, tensor)

    def layer_quantizer(self, ckpt, weights):
        chosen = chosen_modules(ckpt, weights)
        return lambda step: rtn_layer(step, weights.spec, chosen)

    def describe(self, weights) -> str:
        return f"rtn {weights.spec.label}" + (" fp16-outliers" if weights.outliers else "")

    def pass_label(self, weights) -> str:
        return "outliers"
