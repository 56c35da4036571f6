"""GPTQ over a whole decoder: layer by layer, group by group, on calibration windows.

Each decoder layer is fitted to the inputs the already-quantized layers before it produce; inside a
layer, the Linear modules are quantized in call order, group by group (q/k/v, o, gate/up, down), and
each group's Hessians are gathered after the groups before it were quantized ("true sequential").
Quantized weights replace the float ones in the model as they are made, so when the pass ends the
model computes exactly what the quantized checkpoint will.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Callable

import torch

from calib.layerwise import decoder_layers, first_layer_inputs, input_statistics, linear_groups, run_layer
from quant.gptq import GPTQResult, GPTQSettings, gptq_quantize
from quant.types import InputError, QuantSpec


def gptq_model(
    model: torch.nn.Module,
    windows: torch.Tensor,
    spec: QuantSpec,
    settings: GPTQSettings = GPTQSettings(),
    targets: list[str] = ("*",),
    ignore: list[str] = (),
    on_layer: Callable[[], None] | None = None,
) -> dict[str, GPTQResult]:
    """Quantize the decoder layers' Linear weights whose module names match a ``targets`` pattern
    and no ``ignore`` pattern (shell-style, e.g. ``*.mlp.*``); returns results by weight name
    (``model.layers.0.self_attn.q_proj.weight``). The output head is outside the decoder layers and
    is never touched. ``model`` is changed in place to the quantized model."""
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(prefix + ".")]
    chosen = select_modules(linears, targets, ignore)
    inputs = first_layer_inputs(model, windows)
    results: dict[str, GPTQResult] = {}
    for index, layer in enumerate(layers):
        base = f"{prefix}.{index}."
        modules = dict(layer.named_modules())
        for group in linear_groups(layer, inputs):
            names = [n for n in group if base + n in chosen]
            if not names:
                continue
            stats = input_statistics(layer, inputs, names)
            for n in names:
                linear = modules[n]
                result = gptq_quantize(linear.weight.data, stats.pop(n).hessian, spec, settings, name=base + n)
                linear.weight.data = result.tensor.dequantize().to(linear.weight.dtype)
                results[f"{base}{n}.weight"] = result
        inputs.hidden = run_layer(layer, inputs)
        if on_layer:
            on_layer()
    return results


def select_modules(names: list[str], targets: list[str], ignore: list[str]) -> set[str]:
    """The module names a pass applies to: matching a target pattern and no ignore pattern. A
    pattern that matches no module is a mistake worth stopping for."""
    for pattern in [*targets, *ignore]:
        if not any(fnmatchcase(n, pattern) for n in names):
            raise InputError(f"pattern '{pattern}' matches no Linear module of the decoder layers (e.g. '{names[0]}')")
    return {n for n in names if any(fnmatchcase(n, p) for p in targets) and not any(fnmatchcase(n, p) for p in ignore)}
