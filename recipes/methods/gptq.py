"""GPTQ, fitted layer by layer on the calibration text (quant/gptq_model.py); each Linear's output
error on its calibration inputs comes with it."""

from __future__ import annotations

from core.tensors import LayerResult
from quant.gptq_model import gptq_layer, gptq_model
from recipes.methods import WeightMethod, chosen_modules, register


@register("gptq")
class GPTQ(WeightMethod):
    def fits(self, weights) -> bool:
        return True

    def fit(self, ckpt, variant, windows, report=None, checkpoint=None):
        w = variant.weights
        for results in gptq_model(ckpt, windows, w.spec, w.settings, w.targets, w.ignore):
            yield LayerResult({n: r.tensor for n, r in results.items()}, {},
                              {n.removesuffix(".weight"): r.output_error for n, r in results.items()})
            del results  # not held while the next layer is fitted (an 8B layer's codes: 220 MB)

    def layer_quantizer(self, ckpt, weights):
        chosen = set(chosen_modules(ckpt, weights))
        return lambda step: {n: r.tensor for n, r in gptq_layer(step, weights.spec, weights.settings, chosen).items()}

    def describe(self, weights) -> str:
        return (f"gptq {weights.spec.label}" + (" act-order" if weights.act_order else "")
                + (" static-groups" if weights.static_groups else ""))
