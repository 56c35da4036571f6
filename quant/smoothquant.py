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

from typing import Callable, Collection, Iterator

import torch

from calib.layerwise import input_statistics
from calib.streaming import LayerStep, skeleton, to_cpu, walk_layers
from core.architecture import Architecture
from core.errors import InputError
from core.schemes import QuantSpec
from core.tensors import LayerResult, QuantizedTensor, TensorPayload, dequantized
from formats.hf import HFCheckpoint
from quant.error import relative_error
from quant.folding import fold_scales, layer_mappings
from quant.outliers import channel_statistics, layer_input_abs_max
from quant.rtn import quantize_rtn

LayerQuantizer = Callable[[LayerStep], dict[str, TensorPayload]]  # e.g. rtn_layer, quant.gptq_model.gptq_layer
_TINY = 1e-5  # floor for both maxima and the scales: a dead channel must not give 0 or Inf


def smoothing_scales(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s_j = max|X_j|^α / max|W_j|^(1-α)`` per input channel, ``w_max`` taken over every Linear
    that reads the channel."""
    return (x_max.clamp(min=_TINY).pow(alpha) / w_max.clamp(min=_TINY).pow(1 - alpha)).clamp(min=_TINY)


def smooth_layer(step: LayerStep, arch: Architecture, alpha: float) -> dict[str, torch.Tensor]:
    """Fold SmoothQuant's scales into one decoder layer of a walk (the layer computes the same
    function afterwards). Returns the largest |x| per input channel that each Linear (by name
    relative to the layer) now receives: what an activation quantizer will face."""
    modules = dict(step.layer.named_modules())
    abs_max = layer_input_abs_max(step)
    for fold in layer_mappings(modules, arch, "SmoothQuant"):
        linears = [modules[t] for t in fold.targets]
        w_max = torch.cat([m.weight.data.to(torch.float32) for m in linears]).abs().amax(0)
        scales = smoothing_scales(abs_max[fold.targets[0]], w_max, alpha)
        fold_scales(modules, fold, scales)
        abs_max.update(dict.fromkeys(fold.targets, abs_max[fold.targets[0]] / scales))
    return abs_max


def rtn_layer(step: LayerStep, spec: QuantSpec, modules: Collection[str] | None = None) -> dict[str, QuantizedTensor]:
    """Round-to-nearest on the Linear weights of one decoder layer of a walk (those in ``modules``,
    full names; all by default); the layer keeps the quantized weights, so the layers after it are
    calibrated on what the quantized model computes."""
    results = {}
    for name, module in step.layer.named_modules():
        if isinstance(module, torch.nn.Linear) and (modules is None or step.prefix + name in modules):
            tensor = quantize_rtn(module.weight.data, spec, f"{step.prefix}{name}.weight")
            module.weight.data = tensor.dequantize().to(module.weight.dtype)
            results[f"{step.prefix}{name}.weight"] = to_cpu(tensor)
    return results


def smoothquant_model(
    ckpt: HFCheckpoint,
    windows: torch.Tensor,
    alpha: float | None = 0.5,
    quantize_layer: LayerQuantizer | None = None,
) -> Iterator[LayerResult]:
    """SmoothQuant with ``alpha`` (None: no smoothing) on every decoder layer as the layers stream
    from the checkpoint, then ``quantize_layer`` on the smoothed layer (none: the weights stay
    float). Each layer's statistics come from the outputs of the already smoothed (and quantized)
    layers before it. Yields one ``LayerResult`` per layer: every tensor of the layer (the norms
    and feeding Linear rows absorbed the scales), the statistics of the inputs its Linears now
    receive, which an activation quantizer (``quant.activations``) will face, and the weights'
    relative output errors."""
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise InputError(f"SmoothQuant: alpha must be between 0 and 1, got {alpha}")
    for step in walk_layers(ckpt, skeleton(ckpt), windows):
        abs_max = layer_input_abs_max(step) if alpha is None else smooth_layer(step, ckpt.arch, alpha)
        tensors, errors = _quantize_measured(step, quantize_layer) if quantize_layer else ({}, {})
        for name, param in step.layer.named_parameters(prefix=step.prefix.rstrip(".")):
            tensors.setdefault(name, param.detach().cpu().clone())
        yield LayerResult(tensors, channel_statistics({step.prefix + n: a.cpu() for n, a in abs_max.items()}), errors)


def _quantize_measured(step: LayerStep, quantize_layer: LayerQuantizer) -> tuple[dict[str, TensorPayload], dict[str, float]]:
    """``quantize_layer`` on a smoothed layer, and each Linear's relative output error on the
    calibration inputs against the smoothed float Linear, which computes what the original did.
    The Hessians cost one more pass over the layer; the weight pass may gather its own (GPTQ's come
    after the groups before it were quantized), so this measure is the same whatever the pass."""
    linears = {n: m for n, m in step.layer.named_modules() if isinstance(m, torch.nn.Linear)}
    floats = {n: m.weight.data.clone() for n, m in linears.items()}
    hessians = {n: s.hessian for n, s in input_statistics(step.layer, step.inputs, list(linears)).items()}
    tensors = quantize_layer(step)
    errors = {step.prefix + n: relative_error(floats[n], dequantized(tensors[key]), hessians[n])
              for n in linears if (key := f"{step.prefix}{n}.weight") in tensors}
    return tensors, errors
