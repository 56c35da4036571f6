"""Outlier input channels: measuring them, and keeping their weight columns in 16 bits (LLM.int8).

A few input channels of a Linear can carry activations far larger than the rest (Dettmers et al.,
2022). Their weight columns' rounding errors are multiplied by those activations, so they dominate
the output error of a weight-only quantized layer. LLM.int8 finds them by magnitude (6.0) and
computes them in fp16; here they are found once, from the largest |x| each input channel reaches on
the calibration text, and their weight columns are stored in fp16 beside the quantized rest.

The per-channel maxima are also what SmoothQuant balances against the weights, and what a report
shows to explain why a layer suffers under activation quantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from calib.layerwise import LayerInputs, decoder_layers, first_layer_inputs, input_statistics, layers_prefix, linear_groups, run_layer
from quant.rtn import quantize_rtn
from quant.types import InputError, MixedPrecisionTensor, QuantSpec


@dataclass(frozen=True)
class OutlierRule:
    """An input channel is an outlier when its largest calibration |x| exceeds ``threshold``
    (LLM.int8's 6.0) and ``relative`` times the median over the Linear's input channels.

    6.0 alone suits models whose typical activations are near 1. Where every channel of an input
    is large (the down_proj inputs of the shared ref model: median maxima 7 to 13), it would keep
    nearly all columns in fp16 (3952 columns on ref, 6.1 bits per weight at int4); the relative
    factor keeps only channels that stand out from their neighbours (18 columns on ref).
    """

    threshold: float = 6.0
    relative: float = 3.0

    def channels(self, abs_max: torch.Tensor) -> torch.Tensor:
        """The outlier input channels (int32, ascending) of a Linear with these per-channel maxima."""
        limit = max(self.threshold, self.relative * abs_max.median().item())
        return torch.nonzero(abs_max > limit).flatten().to(torch.int32)


def layer_input_abs_max(layer: torch.nn.Module, inputs: LayerInputs, base: str) -> dict[str, torch.Tensor]:
    """Largest |x| per input channel of every Linear in one decoder layer, over all calibration
    tokens, by name relative to the layer (Linears sharing an input share the tensor). ``base``
    (``model.layers.3.``) names the module in the error raised for NaN or Inf inputs."""
    groups = linear_groups(layer, inputs)
    stats = input_statistics(layer, inputs, [g[0] for g in groups])
    result = {}
    for group in groups:
        abs_max = stats[group[0]].abs_max
        if not torch.isfinite(abs_max).all():
            raise InputError(f"{base}{group[0]}: its calibration inputs contain NaN or Inf")
        result.update(dict.fromkeys(group, abs_max))
    return result


def input_abs_max(model: torch.nn.Module, windows: torch.Tensor, on_layer: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
    """``layer_input_abs_max`` for every decoder layer of the (float) model, by full module name
    (``model.layers.0.mlp.down_proj``)."""
    layers = decoder_layers(model)
    prefix = layers_prefix(model)
    inputs = first_layer_inputs(model, windows)
    result: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(layers):
        base = f"{prefix}.{index}."
        result.update({base + n: a for n, a in layer_input_abs_max(layer, inputs, base).items()})
        inputs.hidden = run_layer(layer, inputs)
        if on_layer:
            on_layer()
    return result


def channel_statistics(abs_max: dict[str, torch.Tensor], rule: OutlierRule = OutlierRule()) -> dict[str, dict]:
    """Per Linear: how many outlier input channels ``rule`` finds, the largest |x|, and the
    max/median ratio of the per-channel maxima (1 for flat inputs; large where a few channels
    dominate). Plain numbers, ready for a JSON report."""
    report = {}
    for name, a in abs_max.items():
        median = a.median().item()
        report[name] = {
            "outlier_channels": int(rule.channels(a).numel()),
            "max_abs": round(a.max().item(), 4),
            "max_over_median": round(a.max().item() / median, 3) if median > 0 else float("inf"),
        }
    return report


def mixed_precision_rtn(weight: torch.Tensor, spec: QuantSpec, columns: torch.Tensor, name: str = "tensor") -> MixedPrecisionTensor:
    """RTN-quantize ``weight [out, in]`` except the given input columns, which are kept in fp16;
    those columns are zeroed in the quantized base so they do not widen any group's range."""
    w = weight.to(torch.float32).clone()
    index = columns.long()
    dense = w[:, index].to(torch.float16)
    if not torch.isfinite(dense).all():
        raise InputError(f"{name}: an outlier column holds NaN or Inf or overflows fp16")
    w[:, index] = 0.0
    return MixedPrecisionTensor(quantize_rtn(w, spec, name), columns.to(torch.int32), dense)


@dataclass
class MixedPrecisionResult:
    weights: dict[str, MixedPrecisionTensor]  # by weight name, model.layers.0.mlp.down_proj.weight
    statistics: dict[str, dict]  # channel_statistics by module name


def mixed_precision_model(
    model: torch.nn.Module,
    windows: torch.Tensor,
    spec: QuantSpec,
    rule: OutlierRule = OutlierRule(),
    on_layer: Callable[[], None] | None = None,
) -> MixedPrecisionResult:
    """Quantize every decoder-layer Linear weight with RTN, keeping each one's outlier input
    columns (found on the calibration windows) in fp16. The model is changed in place to the
    quantized weights, as the evaluation and the dense export see them."""
    abs_max = input_abs_max(model, windows, on_layer)
    modules = dict(model.named_modules())
    weights = {}
    for name, a in abs_max.items():
        linear = modules[name]
        tensor = mixed_precision_rtn(linear.weight.data, spec, rule.channels(a), f"{name}.weight")
        linear.weight.data = tensor.dequantize().to(linear.weight.dtype)
        weights[f"{name}.weight"] = tensor
    return MixedPrecisionResult(weights, channel_statistics(abs_max, rule))
