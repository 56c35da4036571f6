"""Walking a decoder one layer at a time over calibration windows.

Passes such as GPTQ fit each layer to the inputs it will really see: those produced by the layers
before it *after* they were quantized. So the calibration windows are run through the embedding
once, and then through one decoder layer at a time, the outputs of layer i (quantized) becoming the
inputs of layer i + 1. Only one layer's inputs are held, ``[windows, tokens, hidden]``.

Inside a layer, the Linear modules are grouped by the input they share (q/k/v, then o, then
gate/up, then down in a Llama block), in the order the layer calls them, so a pass can quantize
one group and let the next group's statistics see its effect ("true sequential").
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from core.errors import InputError


@dataclass
class LayerInputs:
    """What the decoder layers are called with: one hidden-state tensor per window, and the
    keyword arguments the model passes alongside (rotary embeddings, mask, positions), the same
    for all windows since they have one length. They differ between layers where the model's
    layers differ (Gemma's sliding and global layers have their own masks and rope), so they are
    kept per layer module."""

    hidden: torch.Tensor  # [windows, tokens, hidden]
    layer_kwargs: dict[torch.nn.Module, dict]  # decoder layer -> its keyword arguments

    def kwargs(self, layer: torch.nn.Module) -> dict:
        return self.layer_kwargs[layer]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise InputError(f"{type(model).__name__}: not a decoder model with model.layers (Llama, Mistral, Qwen2 family)")
    return layers


def layers_prefix(model: torch.nn.Module) -> str:
    """The module name of the decoder layers' list, e.g. ``model.layers``."""
    layers = decoder_layers(model)
    return next(n for n, m in model.named_modules() if m is layers)


class _Captured(Exception):
    pass


def first_layer_inputs(model: torch.nn.Module, windows: torch.Tensor) -> LayerInputs:
    """Run each window through the embedding only, keeping what decoder layer 0 receives, and
    what keyword arguments every layer receives: while this runs, each layer passes its input on
    unchanged (the layers' weights need not be loaded), and once every layer has been seen, the
    windows stop at layer 0."""
    layers = list(decoder_layers(model))
    hidden, kwargs = [], {}

    def recorder(layer: torch.nn.Module) -> Callable:
        def forward(*args, **kw):
            x = args[0] if args else kw.pop("hidden_states")
            if layer is layers[0]:
                hidden.append(x)
            kwargs.setdefault(layer, {k: v for k, v in kw.items() if k != "hidden_states"} | {"use_cache": False})
            if len(kwargs) == len(layers):
                raise _Captured
            return x

        return forward

    for layer in layers:
        layer.forward = recorder(layer)
    try:
        with torch.inference_mode():
            for i in range(windows.shape[0]):
                try:
                    model(input_ids=windows[i : i + 1], use_cache=False)
                except _Captured:
                    pass
    finally:
        for layer in layers:
            del layer.forward
    return LayerInputs(torch.cat(hidden), kwargs)


# Windows per layer call: large enough for efficient matrix products, small enough that the
# attention scores of one batch stay small.
_BATCH = 8


def _batches(inputs: LayerInputs):
    for i in range(0, len(inputs.hidden), _BATCH):
        yield inputs.hidden[i : i + _BATCH]


@contextmanager
def _forward_mode(inputs: LayerInputs) -> Iterator[None]:
    """No autograd; on CUDA, bfloat16 autocast for the layer's matrix products. Not on the CPU:
    without native bf16 instructions a bf16 forward is slower there (measured on this project's
    2-core Xeon with AVX-512 but no AVX512-BF16, a 1B-model decoder layer on 4 windows of 512
    tokens: 17.9 s under bf16 autocast against 5.0 s in float32)."""
    cuda = inputs.hidden.is_cuda
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
        yield


def run_layer(layer: torch.nn.Module, inputs: LayerInputs) -> torch.Tensor:
    """The layer's outputs for every window: the next layer's inputs."""
    with _forward_mode(inputs):
        return torch.cat([_output(layer(batch, **inputs.kwargs(layer))) for batch in _batches(inputs)])


def ordinary(value):
    """An inference-mode tensor (or a tuple or dict of them, as layer keyword arguments hold) as an
    ordinary one: the walk's tensors are made under inference mode, and autograd cannot save them."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(ordinary(v) for v in value)
    if isinstance(value, dict):
        return {k: ordinary(v) for k, v in value.items()}
    return value


def linear_groups(layer: torch.nn.Module, inputs: LayerInputs) -> list[list[str]]:
    """The layer's Linear modules (names relative to the layer), grouped by shared input, in call order."""
    calls: list[tuple[str, torch.Tensor]] = []  # holding the inputs keeps their memory from being reused

    def record(name: str) -> Callable:
        def hook(module, args):
            calls.append((name, args[0]))

        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        with _forward_mode(inputs):
            layer(inputs.hidden[:1], **inputs.kwargs(layer))
    finally:
        for h in handles:
            h.remove()
    groups: list[list[str]] = []
    last_input = None
    for name, x in calls:
        if groups and x is last_input:
            groups[-1].append(name)
        else:
            groups.append([name])
        last_input = x
    return groups


@dataclass
class InputStats:
    """What the calibration tokens put into one Linear module, per input channel and jointly."""

    hessian: torch.Tensor | None  # [in, in]: 2/n Σ x xᵀ (GPTQ's Hessian; xᵀx/n is the Gram matrix AWQ needs)
    abs_mean: torch.Tensor  # [in]: mean |x|
    abs_max: torch.Tensor  # [in]: max |x|
    tokens: int


def input_statistics(layer: torch.nn.Module, inputs: LayerInputs, names: list[str], hessians: bool = True) -> dict[str, InputStats]:
    """Statistics of the inputs of the named Linear modules over every calibration token. The
    Hessians are most of the cost (``in²`` per token); passes that only look at per-channel
    magnitudes (SmoothQuant, outlier columns) leave them out, and get ``hessian=None``."""
    modules = dict(layer.named_modules())
    device = inputs.hidden.device
    sums = {n: torch.zeros(modules[n].in_features, modules[n].in_features, device=device) for n in names} if hessians else {}
    abs_sums = {n: torch.zeros(modules[n].in_features, dtype=torch.float64, device=device) for n in names}
    abs_max = {n: torch.zeros(modules[n].in_features, device=device) for n in names}
    counts = dict.fromkeys(names, 0)

    def collect(name: str) -> Callable:
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).to(torch.float32)
            if hessians:
                sums[name].addmm_(x.T, x)
            a = x.abs()
            abs_sums[name] += a.sum(0, dtype=torch.float64)
            torch.maximum(abs_max[name], a.amax(0), out=abs_max[name])
            counts[name] += x.shape[0]
            if name == names[-1]:
                raise _Captured  # the rest of the layer cannot change these inputs

        return hook

    handles = [modules[n].register_forward_pre_hook(collect(n)) for n in names]
    try:
        with _forward_mode(inputs):
            for batch in _batches(inputs):
                try:
                    layer(batch, **inputs.kwargs(layer))
                except _Captured:
                    pass
    finally:
        for h in handles:
            h.remove()
    return {
        n: InputStats(sums[n] * (2.0 / max(counts[n], 1)) if hessians else None, (abs_sums[n] / max(counts[n], 1)).float(), abs_max[n], counts[n])
        for n in names
    }


def _output(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result

