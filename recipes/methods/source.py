"""The source weights as they are: for variants that change only the KV cache."""

from __future__ import annotations

from recipes.methods import Plan, WeightMethod, register


@register("none")
class Source(WeightMethod):
    compares_weights = False  # nothing was quantized

    def plan(self, ckpt, variant, imatrix: bool) -> Plan:
        return Plan(ckpt.names)

    def describe(self, weights) -> str:
        return "source weights"
