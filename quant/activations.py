"""Activation quantization, simulated: what a W8A8 kernel does to a Linear's input, in float.

A W8A8 kernel quantizes each token's input vector on the fly (one scale per token, from that
token's largest magnitude), multiplies integer (or fp8) codes and rescales. Simulating it means
replacing each targeted Linear's input by its quantize-dequantize image ("fake quantization") and
running the float model: the numbers the model sees are then those the kernel would see, up to the
kernel's accumulation order. Hooks do this without touching the weights, so the same model can be
scored with and without activation quantization.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from core.errors import InputError
from core.schemes import ActivationSpec

_INT8_MAX = 127.0
_FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero token: its codes are zeros anyway


def fake_quantize(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """``x`` (tokens along every dimension but the last) quantized per token and dequantized."""
    v = x.to(torch.float32)
    amax = v.abs().amax(dim=-1, keepdim=True)
    if spec.format == "int8":
        scale = (amax / _INT8_MAX).clamp(min=_TINY)
        q = torch.round(v / scale).clamp(-_INT8_MAX, _INT8_MAX)
    else:
        scale = (amax / _FP8_E4M3_MAX).clamp(min=_TINY)
        q = (v / scale).clamp(-_FP8_E4M3_MAX, _FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return (q * scale).to(x.dtype)


@contextmanager
def simulated_activations(model: torch.nn.Module, spec: ActivationSpec, modules: list[str]) -> Iterator[None]:
    """Inside the block, the named Linear modules (full names, e.g.
    ``model.layers.0.mlp.down_proj``) see their inputs quantized per ``spec``; the hooks are gone
    afterwards, even on error."""
    found = dict(model.named_modules())
    for name in modules:
        if not isinstance(found.get(name), torch.nn.Linear):
            raise InputError(f"activation quantization: '{name}' is not a Linear module of the model")

    def hook(module, args):
        return (fake_quantize(args[0], spec), *args[1:])

    handles = [found[name].register_forward_pre_hook(hook) for name in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
