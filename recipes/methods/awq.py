"""AWQ, fitted layer by layer on the calibration text (quant/awq.py). Its scales are folded into
the norms and feeding Linears, so its weights do not compare one to one with the source's; its
pass measures each Linear's output error instead."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from core.schemes import QuantSpec
from quant.awq import AWQSettings, awq_model
from recipes.fields import Targeted
from recipes.methods import WeightMethod, chosen_modules, register


class AWQWeights(Targeted):
    """AWQ on the decoder layers' Linear weights: activation-aware scales folded into the norms and
    feeding Linear rows, clipping search, then round-to-nearest on the scaled weights."""

    method: Literal["awq"]
    bits: int = Field(ge=2, le=8)
    symmetric: bool = False
    group_size: int | None = Field(default=128, ge=1)
    weight_term: bool = True  # the weight-magnitude term of the scale search
    clip: bool = True
    calibrated: ClassVar[bool] = True

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.symmetric, "group" if self.group_size else "channel", self.group_size)

    @property
    def settings(self) -> AWQSettings:
        return AWQSettings(weight_term=self.weight_term, clip=self.clip)


@register("awq")
class AWQ(WeightMethod):
    weights = AWQWeights
    compares_weights = False

    def fits(self, weights) -> bool:
        return True

    def fit(self, ckpt, variant, windows, report=None, checkpoint=None, plan=None):
        w = variant.weights
        return awq_model(ckpt, windows, w.spec, w.settings, modules=chosen_modules(ckpt, w))

    def describe(self, weights) -> str:
        return f"awq {weights.spec.label}"
