"""The grids QAT trains on, each in two forms: trainable weights for the layer phase, and fixed
codes with trainable scales for the end-to-end phase (quant/qat.py, quant/qat_e2e.py).

- The integer grid of GPTQ, AWQ and compressed-tensors checkpoints: ``(q − z)·s`` per group of
  input columns, q in ``0..2^b − 1``, an integer zero-point z and an fp16 scale s (Q4_0 is the
  symmetric 4-bit grid in groups of 32, z = 8).
- GGUF's Q4_K: super-blocks of 256 with fp16 ``d`` and ``dmin``, eight sub-blocks of 32 with
  6-bit scales and mins, ``d·sc_j·q − dmin·m_j`` with q in 0..15, exactly as llama.cpp decodes it.

Every forward pass computes what the stored tensor dequantizes to: rounding goes straight through
(the gradient of ``round(x)`` taken as 1), and so do the fp16 roundings of stored scales. Zero-
points and Q4_K's 6-bit sub-block scales and mins stay the integers they started at; what trains
is the weights (which levels they take) and, optionally, the fp16 scales. Weights and scales are
parameters in units of where they started, so one learning rate means the same share of a step at
any bit width and in any layer.
"""

from __future__ import annotations

import numpy as np
import torch

from core.tensors import GGMLTensor, QuantizedTensor
from quant.ggml.kquant_affine import q4_k_from_parts, q4_k_parts

_FP16_TINY = 2.0**-24  # the smallest positive fp16: a trained scale must stay storable


def _fp16(s: torch.Tensor) -> torch.Tensor:
    """``s`` as fp16 stores it, straight through the rounding."""
    return s + (s.half().float() - s).detach()


def _round(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


def trainable_grid(weight: torch.Tensor, start, learn_scales: bool) -> torch.nn.Module:
    """The layer phase's form of a Linear's ``weight`` on the grid of ``start`` (its starting
    quantization): ``module()`` is the fake-quantized weight, ``module.quantized()`` the payload."""
    return _Q4KGrid(weight, start, learn_scales) if isinstance(start, GGMLTensor) else _IntGrid(weight, start, learn_scales)


def fixed_codes(tensor, device: torch.device) -> torch.nn.Module:
    """The end-to-end phase's form of a quantized weight: its codes fixed, its fp16 scales trainable."""
    return _Q4KCodes(tensor, device) if isinstance(tensor, GGMLTensor) else _IntCodes(tensor, device)


class _IntGrid(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, start: QuantizedTensor, learn_scales: bool):
        super().__init__()
        out, n_in = weight.shape
        self.spec, self.groups = start.spec, start.scales.shape[1]
        step = start.scales.to(weight.device, torch.float32).unsqueeze(-1)
        self.register_buffer("step", step)
        self.register_buffer("zeros", start.zeros.to(weight.device).unsqueeze(-1))
        self.units = torch.nn.Parameter(weight.to(torch.float32).reshape(out, self.groups, n_in // self.groups) / step)
        self.relative = torch.nn.Parameter(torch.ones_like(step), requires_grad=learn_scales)

    def scale(self) -> torch.Tensor:
        return _fp16((self.relative * self.step).clamp(min=_FP16_TINY))

    def _codes(self, rounding) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.scale()
        return (rounding(self.units * self.step / s) + self.zeros).clamp(0, 2**self.spec.bits - 1), s

    def forward(self) -> torch.Tensor:
        codes, s = self._codes(_round)
        return ((codes - self.zeros) * s).reshape(self.units.shape[0], -1)

    @torch.no_grad()
    def quantized(self) -> QuantizedTensor:
        codes, s = self._codes(torch.round)
        out = self.units.shape[0]
        return QuantizedTensor(self.spec, codes.reshape(out, -1).to(torch.uint8), s.squeeze(-1).contiguous(),
                               self.zeros.squeeze(-1).contiguous())


class _IntCodes(torch.nn.Module):
    def __init__(self, tensor: QuantizedTensor, device: torch.device):
        super().__init__()
        self.spec = tensor.spec
        self.register_buffer("codes", tensor.codes.to(device))
        self.register_buffer("zeros", tensor.zeros.to(device, torch.float32))
        self.register_buffer("start", tensor.scales.to(device, torch.float32))
        self.relative = torch.nn.Parameter(torch.ones_like(self.start))

    def scales(self) -> torch.Tensor:
        return _fp16((self.relative * self.start).clamp(min=_FP16_TINY))

    def forward(self) -> torch.Tensor:
        out, n_in = self.codes.shape
        groups = self.start.shape[1]
        q = self.codes.reshape(out, groups, n_in // groups).to(torch.float32) - self.zeros.unsqueeze(-1)
        return (q * self.scales().unsqueeze(-1)).reshape(out, n_in)

    @torch.no_grad()
    def quantized(self) -> QuantizedTensor:
        return QuantizedTensor(self.spec, self.codes.cpu(), self.scales().cpu().contiguous(), self.zeros.cpu())


class _Q4KParts(torch.nn.Module):
    """A Q4_K tensor's fixed integer sub-block scales and mins, and its trainable fp16 ``d`` and
    ``dmin`` (relative to where they started), as ``[out, super-blocks, ...]``."""

    def __init__(self, start: GGMLTensor, device: torch.device):
        super().__init__()
        out, n_in = start.shape
        d, dmin, sc, m, q = (torch.from_numpy(a) for a in q4_k_parts(start.raw))
        self.shape, blocks = (out, n_in), n_in // 256
        self.register_buffer("d0", d.reshape(out, blocks).to(device))
        self.register_buffer("dmin0", dmin.reshape(out, blocks).to(device))
        self.register_buffer("sc", sc.reshape(out, blocks, 8).to(device))
        self.register_buffer("m", m.reshape(out, blocks, 8).to(device))
        self.start_levels = q.reshape(out, blocks, 8, 32)
        self.relative_d = torch.nn.Parameter(torch.ones_like(self.d0))
        self.relative_dmin = torch.nn.Parameter(torch.ones_like(self.dmin0))

    def steps(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp16 ``d`` and ``dmin`` [out, blocks], and each sub-block's step ``d·sc`` and offset
        ``dmin·m`` [out, blocks, 8, 1], in the order llama.cpp multiplies them."""
        d = _fp16((self.relative_d * self.d0).clamp(min=0))
        dmin = _fp16((self.relative_dmin * self.dmin0).clamp(min=0))
        return d, dmin, (d.unsqueeze(-1) * self.sc).unsqueeze(-1), (dmin.unsqueeze(-1) * self.m).unsqueeze(-1)

    def payload(self, levels: torch.Tensor) -> GGMLTensor:
        d, dmin, _, _ = self.steps()
        parts = [t.detach().cpu().numpy() for t in (d.reshape(-1), dmin.reshape(-1), self.sc.reshape(-1, 8),
                                                    self.m.reshape(-1, 8), levels.reshape(-1, 256))]
        raw = q4_k_from_parts(*parts[:4], parts[4].astype(np.uint8))
        return GGMLTensor("Q4_K", raw.reshape(self.shape[0], -1), self.shape)


class _Q4KGrid(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, start: GGMLTensor, learn_scales: bool):
        super().__init__()
        self.parts = _Q4KParts(start, weight.device)
        self.parts.relative_d.requires_grad_(learn_scales)
        self.parts.relative_dmin.requires_grad_(learn_scales)
        _, _, step, _ = self.parts.steps()
        out, n_in = weight.shape
        self.register_buffer("step", step.detach().clamp(min=_FP16_TINY))
        self.units = torch.nn.Parameter(weight.to(torch.float32).reshape(out, n_in // 256, 8, 32) / self.step)

    def _levels(self, rounding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, _, step, offset = self.parts.steps()
        live = step > 0  # a sub-block of scale 0 holds -offset whatever its levels
        x = (self.units * self.step + offset) / torch.where(live, step, torch.ones_like(step))
        return rounding(x).clamp(0, 15) * live, step, offset

    def forward(self) -> torch.Tensor:
        q, step, offset = self._levels(_round)
        return (q * step - offset).reshape(self.parts.shape)

    @torch.no_grad()
    def quantized(self) -> GGMLTensor:
        return self.parts.payload(self._levels(torch.round)[0])


class _Q4KCodes(torch.nn.Module):
    def __init__(self, tensor: GGMLTensor, device: torch.device):
        super().__init__()
        self.parts = _Q4KParts(tensor, device)
        self.register_buffer("levels", self.parts.start_levels.to(device))

    def forward(self) -> torch.Tensor:
        _, _, step, offset = self.parts.steps()
        return (self.levels.to(torch.float32) * step - offset).reshape(self.parts.shape)

    @torch.no_grad()
    def quantized(self) -> GGMLTensor:
        return self.parts.payload(self.levels)
