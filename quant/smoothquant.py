"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights, then W8A8.

Per-token activation quantization fails where a few input channels are much larger than the rest:
one scale per token must cover the largest channel, and the small channels round to a handful of
levels. Weights are easy to quantize per output channel. SmoothQuant divides each input channel by
``s_j = max|X_j|^α / max|W_j|^(1-α)`` and multiplies the weight columns by the same (folded into
the feeding norm or Linear, so the float model is unchanged), which flattens the activations at
the cost of slightly rougher weights; ``α`` sets the balance (0.5 splits the difficulty evenly).

Under grouped-query attention v's rows do not line up with o_proj's columns, so o_proj's input is
left as it is (see quant/folding.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import torch

from calib.layerwise import decoder_layers, first_layer_inputs, layers_prefix, run_layer
from quant.activations import ActivationSpec, simulated_activations
from quant.folding import fold_scales, layer_mappings
from quant.outliers import channel_statistics, input_abs_max, layer_input_abs_max
from quant.rtn import quantize_rtn
from quant.types import InputError, QuantizedTensor, QuantSpec

INT8_WEIGHTS = QuantSpec(8, True, "channel")
_TINY = 1e-5  # floor for both maxima and the scales: a dead channel must not give 0 or Inf


def smoothing_scales(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s_j = max|X_j|^α / max|W_j|^(1-α)`` per input channel, ``w_max`` taken over every Linear
    that reads the channel."""
    return (x_max.clamp(min=_TINY).pow(alpha) / w_max.clamp(min=_TINY).pow(1 - alpha)).clamp(min=_TINY)


def smoothquant_model(
    model: torch.nn.Module,
    windows: torch.Tensor,
    alpha: float = 0.5,
    on_layer: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Smooth every decoder layer in place, layer by layer: each layer's statistics come from the
    outputs of the already-smoothed layers before it. The float model computes the same function
    afterwards. Returns, per Linear (full module name), the largest |x| per input channel that the
    smoothed model feeds it on the calibration windows: what an activation quantizer will face."""
    if not 0.0 <= alpha <= 1.0:
        raise InputError(f"SmoothQuant: alpha must be between 0 and 1, got {alpha}")
    layers = decoder_layers(model)
    prefix = layers_prefix(model)
    inputs = first_layer_inputs(model, windows)
    result: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(layers):
        base = f"{prefix}.{index}."
        modules = dict(layer.named_modules())
        abs_max = layer_input_abs_max(layer, inputs, base)
        for feeder, targets in layer_mappings(modules, "SmoothQuant"):
            linears = [modules[t] for t in targets]
            w_max = torch.cat([m.weight.data.to(torch.float32) for m in linears]).abs().amax(0)
            scales = smoothing_scales(abs_max[targets[0]], w_max, alpha)
            fold_scales(modules[feeder], linears, scales)
            abs_max.update(dict.fromkeys(targets, abs_max[targets[0]] / scales))
        result.update({base + n: a for n, a in abs_max.items()})
        inputs.hidden = run_layer(layer, inputs)
        if on_layer:
            on_layer()
    return result


@dataclass
class W8A8Result:
    """A W8A8 model's quantized weights and what an evaluator needs to simulate its activations:
    run the model inside ``result.simulate(model)``."""

    weights: dict[str, QuantizedTensor]  # by weight name, model.layers.0.mlp.down_proj.weight
    activations: ActivationSpec
    modules: list[str]  # the Linear modules whose inputs are quantized
    statistics: dict[str, dict]  # channel_statistics of those inputs (after smoothing), by module

    def simulate(self, model: torch.nn.Module) -> AbstractContextManager[None]:
        return simulated_activations(model, self.activations, self.modules)


def w8a8_model(
    model: torch.nn.Module,
    windows: torch.Tensor,
    activations: ActivationSpec = ActivationSpec("int8"),
    alpha: float | None = 0.5,
    on_layer: Callable[[], None] | None = None,
) -> W8A8Result:
    """SmoothQuant with ``alpha`` (None: no smoothing), then every decoder-layer Linear weight
    quantized to int8 per output channel (symmetric RTN) and every such Linear's input quantized
    per token as ``activations`` says. The model is changed in place to the smoothed, quantized
    weights; activations are quantized only inside ``simulate``."""
    if alpha is None:
        abs_max = input_abs_max(model, windows, on_layer)
    else:
        abs_max = smoothquant_model(model, windows, alpha, on_layer)
    modules = dict(model.named_modules())
    weights = {}
    for name in abs_max:
        linear = modules[name]
        tensor = quantize_rtn(linear.weight.data, INT8_WEIGHTS, f"{name}.weight")
        linear.weight.data = tensor.dequantize().to(linear.weight.dtype)
        weights[f"{name}.weight"] = tensor
    return W8A8Result(weights, activations, list(abs_max), channel_statistics(abs_max))
