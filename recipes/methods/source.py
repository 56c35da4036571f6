"""The source weights as they are: for variants that change only the KV cache."""

from __future__ import annotations

from typing import ClassVar, Literal

from recipes.fields import Strict
from recipes.methods import Plan, WeightMethod, register


class SourceWeights(Strict):
    """The source weights as they are: for variants that change only the KV cache."""

    method: Literal["none"]
    calibrated: ClassVar[bool] = False


@register("none")
class Source(WeightMethod):
    weights = SourceWeights
    on_grid = False
    compares_weights = False  # nothing was quantized

    def plan(self, ckpt, variant, imatrix: bool) -> Plan:
        return Plan(ckpt.names)

    def describe(self, weights) -> str:
        return "source weights"
