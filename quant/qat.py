"""Quantization-aware training, block by block (EfficientQAT's Block-AP, Chen et al. 2024): each
decoder layer is trained to reproduce the float layer's outputs with its Linear weights seen
through the integer grid the exports store.

The forward pass uses ``(clamp(round(w / s) + z, 0, 2^b - 1) - z) · s``, per group of input
columns, with straight-through gradients for the rounding (the weights ``w`` learn where to sit
between levels) and, with ``learn_scales``, for the scales ``s`` too (LSQ: the step size is a
parameter trained through the rounding). Zero-points stay the integers they started at, and the
scales are seen as fp16, as every integer checkpoint stores them, so the trained layer computes
exactly what its export dequantizes to. Training starts from round-to-nearest's grid or from
GPTQ's solution (its weights and scales).

Layers stream from the checkpoint as in GPTQ's walk (``calib.streaming``): one decoder layer is
in memory at a time, with its calibration inputs and the float layer's outputs on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Iterator, Literal

import torch
from torch.func import functional_call

from calib.layerwise import input_statistics, run_layer
from calib.streaming import LayerStep, skeleton, to_cpu, walk_layers
from formats.hf import HFCheckpoint
from quant.error import relative_error
from quant.gptq import GPTQSettings, gptq_quantize
from quant.rtn import quantize_rtn
from quant.types import InputError, LayerResult, QuantizedTensor, QuantSpec

_FP16_TINY = 2.0**-24  # the smallest positive fp16: a trained scale must stay storable


@dataclass(frozen=True)
class QATSettings:
    steps: int = 200  # optimizer steps per decoder layer
    lr: float = 0.02  # AdamW, in steps of the grid per step (see _Grid), cosine-decayed to zero
    batch: int = 2  # calibration windows per step
    learn_scales: bool = True
    init: Literal["rtn", "gptq"] = "rtn"
    damp: float = 0.01  # GPTQ's damping, with init "gptq"
    seed: int = 0  # the order windows are drawn in


def qat_model(ckpt: HFCheckpoint, windows: torch.Tensor, spec: QuantSpec, settings: QATSettings = QATSettings(),
              modules: Collection[str] | None = None, on_step=None) -> Iterator[LayerResult]:
    """Train and quantize the chosen decoder Linears (``modules``, full names; all by default)
    layer by layer as the layers stream from the checkpoint; one ``LayerResult`` per layer: the
    quantized weights as trained and each one's relative output error on the calibration inputs
    against the float layer (quant/error.py). ``on_step(layer, step, loss)`` follows training."""
    if spec.format != "int" or spec.granularity not in ("group", "channel"):
        raise InputError(f"QAT trains integer grids by group or channel, not {spec.label}")
    if settings.steps < 1:
        raise InputError("QAT needs at least one training step")
    for step in walk_layers(ckpt, skeleton(ckpt), windows):
        yield qat_layer(step, spec, settings, modules, on_step)


def qat_layer(step: LayerStep, spec: QuantSpec, settings: QATSettings, modules: Collection[str] | None = None,
              on_step=None) -> LayerResult:
    """Block-AP on one decoder layer of a walk; the layer keeps the trained quantized weights, so
    the layers after it are trained on what the quantized model computes."""
    base, layer, inputs = step
    linears = {n: m for n, m in layer.named_modules()
               if isinstance(m, torch.nn.Linear) and (modules is None or base + n in modules)}
    if not linears:
        return LayerResult({}, {}, {})
    floats = {n: m.weight.data.clone() for n, m in linears.items()}
    hessians = {n: s.hessian for n, s in input_statistics(layer, inputs, list(linears)).items()}
    targets = run_layer(layer, inputs).clone()  # what the float layer computes on these inputs
    grids = _initial_grids(step, linears, hessians, spec, settings)
    weights = {n: g.dequantize().to(floats[n].device) if settings.init == "gptq" else floats[n]  # read, not changed
               for n, g in grids.items()}
    trained = _train(layer, inputs, targets, weights, grids, spec, settings,
                     lambda i, loss: on_step(base, i, loss) if on_step else None)
    results, errors = {}, {}
    for n, tensor in trained.items():
        linears[n].weight.data = tensor.dequantize().to(linears[n].weight.dtype)
        errors[base + n] = relative_error(floats[n], linears[n].weight.data, hessians[n])
        results[f"{base}{n}.weight"] = to_cpu(tensor)
    for name, param in layer.named_parameters(prefix=base.rstrip(".")):
        results.setdefault(name, param.detach().cpu().clone())
    return LayerResult(results, {}, errors)


def _initial_grids(step: LayerStep, linears: dict, hessians: dict, spec: QuantSpec,
                   settings: QATSettings) -> dict[str, QuantizedTensor]:
    """Each Linear's starting grid: round-to-nearest's, or GPTQ's on the float layer's inputs."""
    if settings.init == "rtn":
        return {n: quantize_rtn(m.weight.data, spec, step.prefix + n) for n, m in linears.items()}
    gptq = GPTQSettings(damp=settings.damp)
    return {n: gptq_quantize(m.weight.data, hessians[n], spec, gptq, step.prefix + n).tensor for n, m in linears.items()}


class _Grid(torch.nn.Module):
    """One Linear's trainable weights and scales on a fixed integer zero-point grid, both in units
    of the starting step size: AdamW moves every parameter by about ``lr`` per step whatever its
    size, so in these units one learning rate moves weights by the same share of a step at 2 bits
    as at 8, and scales by the same share of themselves."""

    def __init__(self, weight: torch.Tensor, start: QuantizedTensor, spec: QuantSpec, learn_scales: bool):
        super().__init__()
        out, n_in = weight.shape
        self.spec, self.groups = spec, start.scales.shape[1]
        step = start.scales.to(weight.device, torch.float32).unsqueeze(-1)
        self.register_buffer("step", step)
        self.register_buffer("zeros", start.zeros.to(weight.device).unsqueeze(-1))
        self.units = torch.nn.Parameter(weight.to(torch.float32).reshape(out, self.groups, n_in // self.groups) / step)
        self.relative = torch.nn.Parameter(torch.ones_like(step), requires_grad=learn_scales)

    def scale(self) -> torch.Tensor:
        """The scales as stored: positive, in fp16 (straight through the fp16 rounding)."""
        s = (self.relative * self.step).clamp(min=_FP16_TINY)
        return s + (s.half().float() - s).detach()

    def forward(self) -> torch.Tensor:
        s = self.scale()
        x = self.units * self.step / s
        codes = (x + (torch.round(x) - x).detach() + self.zeros).clamp(0, 2**self.spec.bits - 1)
        return ((codes - self.zeros) * s).reshape(self.units.shape[0], -1)

    @torch.no_grad()
    def quantized(self) -> QuantizedTensor:
        s = self.scale()
        codes = (torch.round(self.units * self.step / s) + self.zeros).clamp(0, 2**self.spec.bits - 1)
        out = self.units.shape[0]
        return QuantizedTensor(self.spec, codes.reshape(out, -1).to(torch.uint8), s.squeeze(-1).contiguous(),
                               self.zeros.squeeze(-1).contiguous())


def _train(layer: torch.nn.Module, inputs, targets: torch.Tensor, weights: dict, grids: dict,
           spec: QuantSpec, settings: QATSettings, on_step) -> dict[str, QuantizedTensor]:
    """AdamW on the mean squared error of the layer's outputs, a batch of windows per step, over
    the named Linears' ``weights`` on their starting ``grids``."""
    trainable = {n: _Grid(weights[n], grids[n], spec, settings.learn_scales) for n in grids}
    params = [p for g in trainable.values() for p in g.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / settings.steps)))
    hidden = inputs.hidden.clone()  # out of inference mode: autograd needs ordinary tensors
    kwargs = {k: _ordinary(v) for k, v in inputs.kwargs.items()}
    generator = torch.Generator().manual_seed(settings.seed)
    frozen = {n: p.detach() for n, p in layer.named_parameters()}
    order = torch.empty(0, dtype=torch.long)
    for i in range(settings.steps):
        if len(order) < settings.batch:  # every window once before any twice
            order = torch.cat([order, torch.randperm(len(hidden), generator=generator)])
        batch, order = order[: settings.batch], order[settings.batch:]
        params_now = dict(frozen) | {f"{n}.weight": g() for n, g in trainable.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=hidden.is_cuda):
            out = functional_call(layer, params_now, (hidden[batch],), kwargs)
        out = out[0] if isinstance(out, tuple) else out
        loss = torch.nn.functional.mse_loss(out.float(), targets[batch].float())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        on_step(i, loss.item())
    return {n: g.quantized() for n, g in trainable.items()}


def _ordinary(value):
    """An inference-mode tensor (or a tuple of them) as an ordinary one."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_ordinary(v) for v in value)
    return value
