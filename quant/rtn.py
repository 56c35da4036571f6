"""Round-to-nearest weight quantization: the baseline every smarter pass is measured against.

This module is also the one place where weights become codes, for every number format: GPTQ fits
its grids with ``fit_grid``, rounds with ``round_to_grid`` and measures its error with
``grid_values``, so both quantizers mean the same thing by "the nearest code".
"""

from __future__ import annotations

import math

import torch

from core.errors import InputError
from core.schemes import FORMAT_MAX, FOUR_BIT_CODES, FP8_DTYPES, QuantSpec, code_values
from core.tensors import QuantizedTensor, all_finite

_FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal): a scale must survive the fp16 round trip
_RECIPROCAL_FLOOR = 1e-38  # bitsandbytes' floor on a block's absmax before it takes the reciprocal


def quantize_rtn(weight: torch.Tensor, spec: QuantSpec, name: str = "tensor") -> QuantizedTensor:
    """Quantize a ``[out, in]`` weight to ``spec``'s codes, each group rounded to nearest.

    Integer scales are rounded *up* to fp16 before the codes are computed, because every integer
    checkpoint format stores fp16 scales: the codes are then the best ones for the scale really
    used, and rounding up keeps the whole range covered, so no weight is clipped by more than half
    a step. Symmetric: ``scale = 2·absmax / (2**bits - 1)`` around the fixed zero ``2**(bits-1)``
    (GPTQ's grid): ``[-absmax, absmax]`` spans ``2**bits - 1`` steps, and the largest positive
    weight, which would need the missing level ``+2**(bits-1)``, clips by at most half a step, no
    more than rounding costs any other weight (``absmax / (2**(bits-1) - 1)``, which represents the
    largest weight exactly, has every step 7% wider at 4 bits). Asymmetric:
    the range ``[min, max]`` (widened to include 0, so zeros stay exact) is split into
    ``2**bits - 1`` steps. Float formats keep float32 scales (bitsandbytes stores its absmax in
    float32, fp8 checkpoints their scales too): ``scale = absmax / FORMAT_MAX``.
    """
    if weight.dim() != 2:
        raise InputError(f"{name}: RTN quantizes 2-D weights, got shape {tuple(weight.shape)}")
    groups = _groups(weight.to(torch.float32), spec, name)
    scales, zeros = fit_grid(groups, spec, name)
    codes = round_to_grid(groups, scales.unsqueeze(-1), zeros.unsqueeze(-1), spec)
    return QuantizedTensor(spec=spec, codes=_ungroup(codes, spec), scales=scales.contiguous(), zeros=zeros.contiguous())


def _groups(w: torch.Tensor, spec: QuantSpec, name: str) -> torch.Tensor:
    """``w [out, in]`` as ``[rows, n_groups, elements]``: the weights sharing each scale along the
    last dimension; ``B x B`` blocks become ``[out/B, in/B, B*B]``."""
    out, n_in = w.shape
    if spec.granularity == "block":
        b = spec.group_size
        if out % b or n_in % b:
            raise InputError(f"{name}: shape {out}x{n_in} is not a multiple of the block size {b} in both dimensions")
        return w.reshape(out // b, b, n_in // b, b).transpose(1, 2).reshape(out // b, n_in // b, b * b)
    group = spec.group_size if spec.granularity == "group" else n_in
    if n_in % group:
        raise InputError(f"{name}: input size {n_in} is not a multiple of group_size {group}")
    return w.reshape(out, n_in // group, group)


def _ungroup(t: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The inverse of ``_groups``: back to the weight's ``[out, in]`` layout."""
    rows, n_groups, elements = t.shape
    if spec.granularity == "block":
        b = spec.group_size
        return t.reshape(rows, n_groups, b, b).transpose(1, 2).reshape(rows * b, n_groups * b)
    return t.reshape(rows, n_groups * elements)


# The MSE range search tries the min-max range shrunk by 0%, 1%, ... 79% (as GPTQ's reference
# quantizer does) and keeps, per group, the one with the least squared error.
_SHRINKS = 1.0 - torch.arange(80) / 100


def fit_grid(w: torch.Tensor, spec: QuantSpec, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero-point of each group of ``w [rows, n_groups, elements]`` (see
    ``quantize_rtn``), for any format and range choice; per-tensor specs share one range across
    every group. Float formats' zero-points are 0."""
    if not all_finite(w):
        raise InputError(f"{name}: weights contain NaN or Inf")
    lo, hi = _bounds(w, spec)
    if spec.range != "mse":
        return _grid(lo, hi, spec, 1.0, name)
    best_err = best_scales = best_zeros = None
    for shrink in _SHRINKS.tolist():
        scales, zeros = _grid(lo, hi, spec, shrink, name)
        s, z = scales.unsqueeze(-1), zeros.unsqueeze(-1)
        err = (grid_values(round_to_grid(w, s, z, spec), s, z, spec) - w).square().sum(-1)
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


def _bounds(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's range ``(lo, hi)`` before any shrinking, shaped ``w.shape[:-1]``: the
    magnitude to cover (``hi``; ``lo`` is ``-hi``) when symmetric, else ``[min, max]`` widened to
    include 0. ``percentile`` clips it at the percentile of the magnitudes (symmetric) or at the
    (100 - p, p) percentiles (asymmetric); per-tensor specs take it over the whole tensor."""
    x = w.reshape(-1) if spec.granularity == "tensor" else w
    if spec.range == "percentile":
        q = spec.percentile / 100
        lo, hi = (None, _quantile(x.abs(), q)) if spec.symmetric else (_quantile(x, 1.0 - q), _quantile(x, q))
    else:
        lo, hi = (None, x.abs().amax(dim=-1)) if spec.symmetric else (x.amin(dim=-1), x.amax(dim=-1))
    lo, hi = (-hi, hi) if spec.symmetric else (lo.clamp(max=0.0), hi.clamp(min=0.0))
    return lo.expand(w.shape[:-1]), hi.expand(w.shape[:-1])


def _quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(x, q, dim=-1)`` (linear interpolation between order statistics), by
    selection: torch.quantile refuses inputs over 2**24 elements, and a per-tensor range over a
    large weight matrix is one such input."""
    pos = q * (x.shape[-1] - 1)
    k = math.floor(pos)
    below = x.kthvalue(k + 1, dim=-1).values
    if pos == k:
        return below
    return torch.lerp(below, x.kthvalue(k + 2, dim=-1).values, pos - k)


def _grid(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec, shrink: float, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero-point of each group for its range ``(lo, hi)`` shrunk by ``shrink``."""
    if spec.format != "int":
        scales = _divided(shrink * hi, FORMAT_MAX[spec.format])
        return scales, torch.zeros_like(scales)
    if spec.symmetric:
        scales = _fp16_scale(_divided(shrink * 2 * hi, 2**spec.bits - 1), name)
        return scales, torch.full_like(scales, float(2 ** (spec.bits - 1)))
    maxq = 2**spec.bits - 1
    scales = _fp16_scale(_divided(shrink * (hi - lo), maxq), name)
    return scales, torch.round(-shrink * lo / scales).clamp(0, maxq)


def _divided(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` rounded once, on any device: torch's CUDA division by a Python number
    multiplies by its reciprocal (a second rounding, which changes a third or more of the scales'
    last bits), its division by a tensor on the same device divides, as the CPU always does."""
    return x / x.new_full((), divisor)


def round_to_grid(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The uint8 code nearest to each weight on its group's grid (scales and zeros broadcast
    against ``w``), saturating at the grid's ends.

    Integers: ``round(w / scale) + zero`` in ``[0, 2**bits - 1]``. Float formats first map ``w``
    onto the format's own range by multiplying with ``1 / scale``, as bitsandbytes does (so nf4
    and fp4 codes equal its codes bit for bit), and clamp it to ``±FORMAT_MAX``. fp8 then takes
    torch's cast (round to nearest even); nf4/fp4 the nearest table entry, a value exactly
    halfway going to the lower one, as bitsandbytes' ``quantize_4bit`` does."""
    if spec.format == "int":
        return (torch.round(w / scales) + zeros).clamp(0, 2**spec.bits - 1).to(torch.uint8)
    top = FORMAT_MAX[spec.format]
    unit = (w * (1.0 / scales.clamp(min=_RECIPROCAL_FLOOR))).clamp(-top, top)
    if spec.format in FOUR_BIT_CODES:
        return _nearest_four_bit(unit, spec.format)
    return unit.to(FP8_DTYPES[spec.format]).view(torch.uint8)


def grid_values(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The weights that codes stand for, ``(code_values(codes) - zero) * scale``: what a
    quantizer's error is measured against."""
    return (code_values(codes, spec.format) - zeros) * scales


def _nearest_four_bit(unit: torch.Tensor, fmt: str) -> torch.Tensor:
    """The code of the table value nearest to each ``unit`` value: the number of midpoints below it,
    which is what bitsandbytes' ``torch.bucketize`` computes. Counting with 15 whole-tensor
    comparisons costs about twice bucketize's time on a large matrix (2 s for 4096x4096 here),
    but bucketize's thread start-up made GPTQ's single-column calls a hundred times slower
    (10 ms per column on this loaded 2-core machine)."""
    midpoints, order = _FOUR_BIT_SEARCH[fmt]
    rank = torch.zeros_like(unit, dtype=torch.uint8)
    for m in midpoints:
        rank += unit > m
    return order.to(rank.device)[rank.long()]


def _four_bit_search(table: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """Midpoints between consecutive table values in ascending order, and the code (uint8) of
    each value in that order. Ties between +0 and -0 (fp4) keep table order, as bitsandbytes'
    sort does."""
    order = torch.argsort(table, stable=True)
    ascending = table[order]
    return ((ascending[:-1] + ascending[1:]) / 2).tolist(), order.to(torch.uint8)


_FOUR_BIT_SEARCH = {fmt: _four_bit_search(table) for fmt, table in FOUR_BIT_CODES.items()}


def _fp16_scale(scale: torch.Tensor, name: str) -> torch.Tensor:
    if not torch.isfinite(scale).all():
        raise InputError(f"{name}: a quantization scale overflows (weights too large)")
    half = scale.clamp(min=_FP16_TINY).to(torch.float16)
    below = half.to(torch.float32) < scale  # stepped up by a where, not a masked write: no sync on a GPU
    half = torch.where(below, torch.nextafter(half, torch.tensor(float("inf"), dtype=torch.float16, device=half.device)), half)
    if torch.isinf(half).any():
        raise InputError(f"{name}: a quantization scale overflows fp16 (weights too large)")
    return half.to(torch.float32)
