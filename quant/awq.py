"""AWQ (Lin et al., 2023): protect the input channels that carry large activations by scaling them
up before quantization and folding the inverse scale into the operation that feeds them.

For a group of Linear modules sharing one input (q/k/v after the attention norm, gate/up after the
MLP norm, o after v, down after up), a per-input-channel scale ``s = mean|x|^α / mean|ŵ|^(1-α)``
(``ŵ`` the weights normalised per quantization group; the weight term is optional) multiplies the
weights' columns, and the feeding norm's weight, or the feeding Linear's rows, is divided by it, so
the float model computes exactly the same. The quantization grid then spends its precision on the
scaled-up columns. ``α`` is searched on a grid of 20 for the least output error, then the range of
each quantization group is searched for clipping (q and k are left unclipped, whose errors the
attention softmax amplifies).

Every output error is computed from the Gram matrix of the inputs, ``‖x·ΔWᵀ‖² = tr(ΔW·G·ΔWᵀ)``
with ``G = Σ x xᵀ``, so the searches use all calibration tokens at the cost of one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterator

import torch

from calib.layerwise import InputStats, input_statistics
from calib.streaming import skeleton, to_cpu, walk_layers
from core.schemes import QuantSpec
from core.tensors import LayerResult, TensorPayload
from formats.hf import HFCheckpoint
from quant.error import relative_error
from quant.folding import fold_scales, layer_mappings
from quant.rtn import quantize_rtn

_GRID = 20
_CLIP_STEPS = 10  # group ranges shrunk by 0%, 5%, ... 45%
_NO_CLIP = ("q_proj", "k_proj")


@dataclass(frozen=True)
class AWQSettings:
    weight_term: bool = True  # the mean-|ŵ| term of the scale ("duo scaling")
    clip: bool = True


def awq_model(
    ckpt: HFCheckpoint,
    windows: torch.Tensor,
    spec: QuantSpec,
    settings: AWQSettings = AWQSettings(),
    quantize: bool = True,
    modules: Collection[str] | None = None,
    specs: dict[str, QuantSpec] | None = None,
) -> Iterator[LayerResult]:
    """Scale, clip and quantize every decoder layer's Linear weights, layer by layer as they stream
    from the checkpoint (``calib.streaming``), yielding one ``LayerResult`` per layer: by weight name,
    on the CPU, the quantized weights and every other tensor of the layer as it now is (the norms
    and feeding Linear rows absorb the scales), and each quantized Linear's relative output error. With
    ``quantize=False`` only the (exactly equivalent) scaling is applied and every tensor comes
    back in float. ``modules`` (full names; all by default) limits which Linear weights are
    quantized; the scaling, exact in float, is applied throughout. ``specs`` gives weights a grid
    of their own (by weight name: ``bits: auto``), which their scale and clipping searches use."""
    specs = specs or {}
    for base, layer, inputs in walk_layers(ckpt, skeleton(ckpt), windows):
        layer_modules = dict(layer.named_modules())

        def grid(name: str) -> QuantSpec:
            return specs.get(f"{base}{name}.weight", spec)

        for fold in layer_mappings(layer_modules, ckpt.arch, "AWQ"):
            stats = input_statistics(layer, inputs, fold.targets[:1])[fold.targets[0]]
            scales = _search_scales([layer_modules[t].weight.data for t in fold.targets], stats,
                                    [grid(t) for t in fold.targets], settings)
            fold_scales(layer_modules, fold, scales)
        results: dict[str, TensorPayload] = {}
        errors: dict[str, float] = {}
        if quantize:
            linears = [n for n, m in layer_modules.items() if isinstance(m, torch.nn.Linear) and (modules is None or base + n in modules)]
            stats = input_statistics(layer, inputs, linears)
            for name in linears:
                weight = layer_modules[name].weight
                scaled = weight.data
                if settings.clip and not name.endswith(_NO_CLIP):
                    weight.data = _clip(weight.data, stats[name], grid(name), base + name)
                quantized = quantize_rtn(weight.data, grid(name), base + name)
                weight.data = quantized.dequantize().to(weight.dtype)
                # scaled weights on scaled inputs compute what the original Linear did, so this is
                # the error of the Linear's outputs against the float model's
                errors[base + name] = relative_error(scaled, weight.data, stats[name].hessian)
                results[f"{base}{name}.weight"] = to_cpu(quantized)
        for name, param in layer.named_parameters(prefix=base.rstrip(".")):
            results.setdefault(name, param.detach().cpu().clone())
        yield LayerResult(results, {}, errors)


def _output_error(delta: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``‖x·ΔWᵀ‖²`` summed over tokens and outputs, from the inputs' Gram matrix."""
    return ((delta @ gram) * delta).sum()


def _search_scales(weights: list[torch.Tensor], stats: InputStats, grids: list[QuantSpec],
                   settings: AWQSettings) -> torch.Tensor:
    """The per-input-channel scale (over α in 0, 1/20, ... 19/20) whose quantized weights, each on
    its own grid, give the least output error."""
    by_grid: dict[QuantSpec, list[torch.Tensor]] = {}
    for w, spec in zip(weights, grids):  # the weights that share a grid quantized as one
        by_grid.setdefault(spec, []).append(w.to(torch.float32))
    stacked = {spec: torch.cat(ws) for spec, ws in by_grid.items()}
    gram = stats.hessian  # proportional to Σ x xᵀ: the same minimiser
    x_mean = stats.abs_mean.clamp(min=1e-8)
    if settings.weight_term:
        normalised = []
        for spec, W in stacked.items():  # normalised per group of its own grid
            group = spec.group_size if spec.granularity == "group" else W.shape[1]
            w = W.abs().reshape(W.shape[0], -1, group)
            normalised.append((w / w.amax(-1, keepdim=True).clamp(min=1e-12)).reshape_as(W))
        w_mean = torch.cat(normalised).mean(0)
    best, best_scales = None, torch.ones_like(x_mean)
    for step in range(_GRID):
        alpha = step / _GRID
        scales = x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4) if settings.weight_term else x_mean.pow(alpha)
        scales = scales.clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        err = sum(_output_error(quantize_rtn(W * scales, spec).dequantize() / scales - W, gram) for spec, W in stacked.items())
        if best is None or err < best:
            best, best_scales = err, scales
    return best_scales


def _clip(weight: torch.Tensor, stats: InputStats, spec: QuantSpec, name: str) -> torch.Tensor:
    """Shrink each quantization group's range (by 0%, 5%, ... 45%) where that lowers the output
    error of the group's slice of the product."""
    out, n_in = weight.shape
    group = spec.group_size if spec.granularity == "group" else n_in
    W = weight.to(torch.float32).reshape(out, n_in // group, group)
    blocks = torch.stack([stats.hessian[i : i + group, i : i + group] for i in range(0, n_in, group)])  # [ng, g, g]
    top = W.abs().amax(-1, keepdim=True)
    best_err, best = None, W
    for step in range(_CLIP_STEPS):
        clipped = W.clamp(-top * (1 - step / 20), top * (1 - step / 20))
        Q = quantize_rtn(clipped.reshape(out, n_in), spec, name).dequantize().reshape_as(W)
        delta = Q - W
        err = torch.einsum("ogi,gij,ogj->og", delta, blocks, delta)
        if best_err is None:
            best_err, best = err, clipped
        else:
            better = (err < best_err).unsqueeze(-1)
            best_err = torch.where(better[..., 0], err, best_err)
            best = torch.where(better, clipped, best)
    return best.reshape(out, n_in).to(weight.dtype)
