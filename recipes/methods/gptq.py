"""GPTQ, fitted layer by layer on the calibration text (quant/gptq_model.py); each Linear's output
error on its calibration inputs comes with it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from core.schemes import QuantSpec
from core.tensors import LayerResult
from quant.gptq import GPTQSettings
from quant.gptq_model import gptq_layer, gptq_model
from recipes.bit_search import grid_label
from recipes.fields import GridWeights
from recipes.methods import SearchesBits, WeightMethod, chosen_modules, register


class GPTQWeights(GridWeights):
    """GPTQ on the decoder layers' Linear weights, fitted layer by layer on the calibration text."""

    method: Literal["gptq"]
    group_size: int | None = Field(default=128, ge=1)  # null: one scale per output channel
    act_order: bool = False
    static_groups: bool = False
    damp: float = Field(default=0.01, gt=0, le=1)
    calibrated: ClassVar[bool] = True

    @property
    def spec(self) -> QuantSpec:
        return self._spec("group" if self.group_size else "channel", self.group_size)

    @property
    def settings(self) -> GPTQSettings:
        return GPTQSettings(damp=self.damp, act_order=self.act_order, static_groups=self.static_groups)


@register("gptq")
class GPTQ(SearchesBits, WeightMethod):
    weights = GPTQWeights

    def fits(self, weights) -> bool:
        return True

    def fit(self, ckpt, variant, windows, report=None, checkpoint=None, plan=None):
        w = variant.weights
        specs, modules = (plan.specs, plan.modules) if plan is not None else ({}, chosen_modules(ckpt, w))
        for results in gptq_model(ckpt, windows, w.spec, w.settings, modules, specs):
            yield LayerResult({n: r.tensor for n, r in results.items()}, {},
                              {n.removesuffix(".weight"): r.output_error for n, r in results.items()})
            del results  # not held while the next layer is fitted (an 8B layer's codes: 220 MB)

    def layer_quantizer(self, ckpt, weights):
        chosen = set(chosen_modules(ckpt, weights))
        return lambda step: {n: r.tensor for n, r in gptq_layer(step, weights.spec, weights.settings, chosen).items()}

    def fit_record(self, weights: GPTQWeights) -> dict:
        return {"damp_percent": weights.damp, "static_groups": weights.static_groups, "true_sequential": True}

    def describe(self, weights) -> str:
        return (f"gptq {grid_label(weights)}" + (" act-order" if weights.act_order else "")
                + (" static-groups" if weights.static_groups else ""))
