"""Round-to-nearest on the chosen decoder Linears, optionally keeping each one's outlier input
columns in fp16 (fitted on the calibration text: quant/outliers.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from calib.streaming import to_cpu
from core.device import working_device
from core.schemes import QuantSpec
from quant.outliers import OutlierRule, mixed_precision_model
from quant.rtn import quantize_rtn
from quant.smoothquant import rtn_layer
from recipes.bit_search import grid_label
from recipes.fields import GridWeights, Strict
from recipes.methods import SearchesBits, WeightMethod, chosen_modules, finite, register


class Outliers(Strict):
    """LLM.int8-style mixed precision: the input columns whose calibration activations exceed both
    ``threshold`` and ``relative`` times their Linear's median stay in fp16 (quant/outliers.py)."""

    threshold: float = Field(default=6.0, ge=0)
    relative: float = Field(default=3.0, ge=0)

    @property
    def rule(self) -> OutlierRule:
        return OutlierRule(self.threshold, self.relative)


class RTNWeights(GridWeights):
    """Round-to-nearest quantization of the decoder's Linear weights."""

    method: Literal["rtn"]
    granularity: Literal["tensor", "channel", "group", "block"] = "channel"
    group_size: int | None = Field(default=None, ge=1)  # group: input columns; block: rows and columns
    outliers: Outliers | None = None  # {} for the defaults: fitted on the calibration text

    @property
    def calibrated(self) -> bool:  # each weights class: whether it needs calibration text
        return self.outliers is not None or self.searches_bits

    @model_validator(mode="after")
    def _group_size_matches_granularity(self) -> "RTNWeights":
        if self.searches_bits and self.outliers is not None:
            raise ValueError("outliers (16-bit weight columns) and bits auto do not mix: a checkpoint vLLM loads holds neither")
        sized = self.granularity in ("group", "block")
        if sized and self.group_size is None:
            raise ValueError(f"granularity '{self.granularity}' needs group_size")
        if not sized and self.group_size is not None:
            raise ValueError(f"group_size is only valid with granularity 'group' or 'block', not '{self.granularity}'")
        return self

    @property
    def spec(self) -> QuantSpec:
        return self._spec(self.granularity, self.group_size)


@register("rtn")
class RTN(SearchesBits, WeightMethod):
    weights = RTNWeights

    def fits(self, weights) -> bool:
        return weights.outliers is not None

    def fit(self, ckpt, variant, windows, report=None, checkpoint=None, plan=None):
        w = variant.weights
        return mixed_precision_model(ckpt, windows, w.spec, w.outliers.rule, chosen_modules(ckpt, w))

    def quantize(self, ckpt, variant, plan, name, tensor, imatrix):
        if name in plan.quantized:  # on the GPU when there is one (core/device.py), the codes back on the CPU
            return to_cpu(quantize_rtn(tensor.to(working_device()), plan.spec(name, variant.weights), name))
        return finite(ckpt, name, tensor)

    def layer_quantizer(self, ckpt, weights):
        chosen = chosen_modules(ckpt, weights)
        return lambda step: rtn_layer(step, weights.spec, chosen)

    def describe(self, weights) -> str:
        return f"rtn {grid_label(weights)}" + (" fp16-outliers" if weights.outliers else "")

    def pass_label(self, weights) -> str:
        return "outliers"
