"""Round-to-nearest weight quantization: the baseline every smarter pass is measured against."""

from __future__ import annotations

import torch

from quant.types import InputError, QuantizedTensor, QuantSpec

_FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal): a scale must survive the fp16 round trip


def quantize_rtn(weight: torch.Tensor, spec: QuantSpec, name: str = "tensor") -> QuantizedTensor:
    """Quantize a ``[out, in]`` weight to ``spec.bits``-bit codes, each group rounded to nearest.

    Scales are rounded *up* to fp16 before the codes are computed, because every checkpoint format
    stores fp16 scales: the codes are then the best ones for the scale really used, and rounding up
    keeps the whole range covered, so no weight is clipped by more than half a step.
    Symmetric: ``scale = absmax / (2**(bits-1) - 1)`` around the fixed zero ``2**(bits-1)``, so the
    largest weight is represented exactly and nothing clips. Asymmetric: the range ``[min, max]``
    (widened to include 0, so zeros stay exact) is split into ``2**bits - 1`` steps.
    """
    if weight.dim() != 2:
        raise InputError(f"{name}: RTN quantizes 2-D weights, got shape {tuple(weight.shape)}")
    out, n_in = weight.shape
    group = {"tensor": n_in, "channel": n_in, "group": spec.group_size}[spec.granularity]
    if n_in % group:
        raise InputError(f"{name}: input size {n_in} is not a multiple of group_size {group}")
    w = weight.to(torch.float32).reshape(out, n_in // group, group)
    scales, zeros = fit_grid(w, spec, name)
    codes = round_to_grid(w, scales.unsqueeze(-1), zeros.unsqueeze(-1), spec.bits).to(torch.uint8).reshape(out, n_in)
    return QuantizedTensor(spec=spec, codes=codes, scales=scales.contiguous(), zeros=zeros.contiguous())


# The MSE range search tries the min-max range shrunk by 0%, 1%, ... 79% (as GPTQ's reference
# quantizer does) and keeps, per group, the one with the least squared error.
_SHRINKS = 1.0 - torch.arange(80) / 100


def fit_grid(w: torch.Tensor, spec: QuantSpec, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero-point of each group of ``w [out, n_groups, group]`` (see ``quantize_rtn``);
    per-tensor specs share one range across every group."""
    if spec.range == "minmax":
        return _grid(w, spec, 1.0, name)
    best_err = best_scales = best_zeros = None
    for shrink in _SHRINKS.tolist():
        scales, zeros = _grid(w, spec, shrink, name)
        q = round_to_grid(w, scales.unsqueeze(-1), zeros.unsqueeze(-1), spec.bits)
        err = ((q - zeros.unsqueeze(-1)) * scales.unsqueeze(-1) - w).square().sum(-1)
        if spec.granularity == "tensor":
            err = err.sum().expand_as(err)
        if best_err is None:
            best_err, best_scales, best_zeros = err, scales, zeros
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scales = torch.where(better, scales, best_scales)
            best_zeros = torch.where(better, zeros, best_zeros)
    return best_scales, best_zeros


def _grid(w: torch.Tensor, spec: QuantSpec, shrink: float, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and zero-point of each group, its range shrunk by ``shrink``."""
    if spec.symmetric:
        amax = w.abs().amax(dim=-1)
        if spec.granularity == "tensor":
            amax = amax.amax().expand_as(amax)
        scales = _fp16_scale(shrink * amax / (2 ** (spec.bits - 1) - 1), name)
        return scales, torch.full_like(scales, float(2 ** (spec.bits - 1)))
    lo = w.amin(dim=-1).clamp(max=0.0)
    hi = w.amax(dim=-1).clamp(min=0.0)
    if spec.granularity == "tensor":
        lo, hi = lo.amin().expand_as(lo), hi.amax().expand_as(hi)
    maxq = 2**spec.bits - 1
    scales = _fp16_scale(shrink * (hi - lo) / maxq, name)
    return scales, torch.round(-shrink * lo / scales).clamp(0, maxq)


def round_to_grid(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """The nearest level ``round(w / scale) + zero`` in ``[0, 2**bits - 1]``, as float codes."""
    return (torch.round(w / scales) + zeros).clamp(0, 2**bits - 1)


def _fp16_scale(scale: torch.Tensor, name: str) -> torch.Tensor:
    if not torch.isfinite(scale).all():
        raise InputError(f"{name}: weights contain NaN or Inf")
    half = scale.clamp(min=_FP16_TINY).to(torch.float16)
    below = half.to(torch.float32) < scale
    half[below] = torch.nextafter(half[below], torch.tensor(float("inf"), dtype=torch.float16))
    if torch.isinf(half).any():
        raise InputError(f"{name}: a quantization scale overflows fp16 (weights too large)")
    return half.to(torch.float32)
