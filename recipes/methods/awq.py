"""AWQ, fitted layer by layer on the calibration text (quant/awq.py). Its scales are folded into
the norms and feeding Linears, so its weights do not compare one to one with the source's; its
pass measures each Linear's output error instead. With ``bits: auto`` each Linear's grid is
chosen first (recipes/bit_search.py), and AWQ's scale and clipping searches run on those grids."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from core.schemes import QuantSpec
from quant.awq import AWQSettings, awq_model
from recipes.bit_search import grid_label
from recipes.fields import GridWeights
from recipes.methods import SearchesBits, WeightMethod, chosen_modules, register


class AWQWeights(GridWeights):
    """AWQ on the decoder layers' Linear weights: activation-aware scales folded into the norms and
    feeding Linear rows, clipping search, then round-to-nearest on the scaled weights."""

    method: Literal["awq"]
    symmetric: bool = False
    group_size: int | None = Field(default=128, ge=1)
    weight_term: bool = True  # the weight-magnitude term of the scale search
    clip: bool = True
    calibrated: ClassVar[bool] = True

    @model_validator(mode="after")
    def _integer_grids(self) -> "AWQWeights":
        if self.format != "int":
            raise ValueError("AWQ searches its scales for integer grids: format must be int")
        return self

    @property
    def spec(self) -> QuantSpec:
        return self._spec("group" if self.group_size else "channel", self.group_size)

    @property
    def settings(self) -> AWQSettings:
        return AWQSettings(weight_term=self.weight_term, clip=self.clip)


@register("awq")
class AWQ(SearchesBits, WeightMethod):
    weights = AWQWeights
    compares_weights = False

    def fits(self, weights) -> bool:
        return True

    def fit(self, ckpt, variant, windows, report=None, checkpoint=None, plan=None):
        w = variant.weights
        specs, modules = (plan.specs, plan.modules) if plan is not None else ({}, chosen_modules(ckpt, w))
        return awq_model(ckpt, windows, w.spec, w.settings, modules=modules, specs=specs)

    def describe(self, weights) -> str:
        return f"awq {grid_label(weights)}"
