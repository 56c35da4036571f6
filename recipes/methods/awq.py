"""AWQ, fitted layer by layer on the calibration text (quant/awq.py). Its scales are folded into
the norms and feeding Linears, so its weights do not compare one to one with the source's; its
pass measures each Linear's output error instead."""

from __future__ import annotations

from quant.awq import awq_model
from recipes.methods import WeightMethod, chosen_modules, register


@register("awq")
class AWQ(WeightMethod):
    compares_weights = False

    def fits(self, weights) -> bool:
        return True

    def fit(self, ckpt, variant, windows, report=None, checkpoint=None):
        w = variant.weights
        return awq_model(ckpt, windows, w.spec, w.settings, modules=chosen_modules(ckpt, w))

    def describe(self, weights) -> str:
        return f"awq {weights.spec.label}"
