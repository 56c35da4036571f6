"""GPTQ over a whole decoder: layer by layer, group by group, on calibration windows.

Each decoder layer is fitted to the inputs the already-quantized layers before it produce; inside a
layer, the Linear modules are quantized in call order, group by group (q/k/v, o, gate/up, down), and
each group's Hessians are gathered after the groups before it were quantized ("true sequential").
The layers stream from the checkpoint (``calib.streaming``): one decoder layer is in memory at a
time, and its results are handed out as soon as it is done, so a caller can write them out rather
than keep them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection, Iterator

import torch

from calib.layerwise import input_statistics, layers_prefix, linear_groups
from calib.streaming import LayerStep, skeleton, to_cpu, walk_layers
from core.schemes import QuantSpec
from formats.hf import HFCheckpoint
from quant.gptq import GPTQResult, GPTQSettings, gptq_quantize


def gptq_model(
    ckpt: HFCheckpoint,
    windows: torch.Tensor,
    spec: QuantSpec,
    settings: GPTQSettings = GPTQSettings(),
    modules: Collection[str] | None = None,
    specs: dict[str, QuantSpec] | None = None,
) -> Iterator[dict[str, GPTQResult]]:
    """Quantize the decoder layers' Linear weights of ``modules`` (full module names; all by
    default), yielding each layer's results by weight name (``model.layers.0.self_attn.q_proj.weight``,
    on the CPU) in layer order, one dict per decoder layer (empty when no module of the layer was
    chosen). The output head is outside the decoder layers and is never touched. ``specs`` gives
    weights a grid of their own (by weight name; the rest take ``spec``), as ``bits: auto`` chooses
    them."""
    model = skeleton(ckpt)
    prefix = layers_prefix(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(prefix + ".")]
    chosen = set(linears) if modules is None else set(modules) & set(linears)
    for step in walk_layers(ckpt, model, windows):
        yield gptq_layer(step, spec, settings, chosen, specs)


def gptq_layer(step: LayerStep, spec: QuantSpec, settings: GPTQSettings, chosen: set[str],
               specs: dict[str, QuantSpec] | None = None) -> dict[str, GPTQResult]:
    """GPTQ on one decoder layer of a walk: the ``chosen`` Linear modules (full names), group by
    group in call order, each group's Hessians gathered after the groups before it were quantized.
    The layer keeps the quantized weights, so what it feeds the next layer is what a quantized
    model computes. Results by weight name, on the CPU."""
    base, layer, inputs = step
    modules = dict(layer.named_modules())
    results: dict[str, GPTQResult] = {}
    for group in linear_groups(layer, inputs):
        names = [n for n in group if base + n in chosen]
        if not names:
            continue
        stats = input_statistics(layer, inputs, names)
        for n in names:
            linear = modules[n]
            grid = (specs or {}).get(f"{base}{n}.weight", spec)
            result = gptq_quantize(linear.weight.data, stats.pop(n).hessian, grid, settings, name=base + n)
            linear.weight.data = result.tensor.dequantize().to(linear.weight.dtype)  # what later groups and layers see
            results[f"{base}{n}.weight"] = replace(result, tensor=to_cpu(result.tensor))
    return results
