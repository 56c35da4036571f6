"""A 4-bit integer checkpoint's grid carried into Q4_K instead of rounded a second time.

Converting a GPTQ, AWQ or compressed-tensors int4 weight to Q4_K the usual way dequantizes it and
quantizes the result again: every weight moves to the nearest of Q4_K's levels, a second rounding
on top of the first. But the source already is a 4-bit affine grid: in each group, ``s·(c − z)``
for codes ``c`` in 0..15. Q4_K's sub-blocks of 32 are affine 4-bit grids too, ``d·sc·q −
dmin·m``, so where each sub-block lies inside one source group (groups of a multiple of 32
consecutive columns, or one group per row) the source's codes can be kept as Q4_K's levels and
only the group's scale and offset approximated, by the 6-bit sub-block scale and min of an fp16
super-block scale. What is lost is that approximation (well under one level), not a rounding.

Act-order groups (GPTQ's ``g_idx``) mix groups within a sub-block; those weights, and other bit
widths, go through the ordinary encoder.
"""

from __future__ import annotations

import numpy as np

from core.tensors import QuantizedTensor
from quant.ggml.kquant_affine import QK_K, q4_k_from_parts

_SUB = 32  # columns per Q4_K sub-block


def q4_k_from_int4(weight: QuantizedTensor) -> np.ndarray | None:
    """The Q4_K bytes ``[rows, row_bytes]`` of an int4 weight whose groups hold whole sub-blocks,
    its codes kept; None where its grid does not fit Q4_K's."""
    spec = weight.spec
    out, n_in = weight.shape
    group = n_in if spec.granularity == "channel" else spec.group_size
    if spec.format != "int" or spec.bits != 4 or weight.group_index is not None or n_in % QK_K \
            or spec.granularity not in ("group", "channel") or group % _SUB:
        return None
    per_sub = np.repeat(np.arange(n_in // group), group // _SUB)  # the source group of each sub-block
    scale = weight.scales.numpy().astype(np.float64)[:, per_sub]  # [out, sub-blocks]
    offset = scale * weight.zeros.numpy().astype(np.float64)[:, per_sub]  # value = scale·c − offset
    if (scale < 0).any() or (offset < 0).any():
        return None
    scale, offset = scale.reshape(-1, QK_K // _SUB), offset.reshape(-1, QK_K // _SUB)  # [super-blocks, 8]
    d, sc = _six_bit(scale)
    dmin, m = _six_bit(offset)
    codes = weight.codes.numpy().reshape(-1, QK_K // _SUB, _SUB).astype(np.float64)
    values = scale[..., None] * codes - offset[..., None]  # the source's weights
    step = (d[:, None] * sc)[..., None]
    shift = (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint(np.divide(values + shift, step, out=np.zeros_like(values), where=step > 0)), 0, 15)
    raw = q4_k_from_parts(d.astype(np.float32), dmin.astype(np.float32), sc, m, q.reshape(-1, QK_K).astype(np.uint8))
    return raw.reshape(out, -1)


def _six_bit(targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An fp16 super-block factor per row of ``targets`` [B, 8] (all >= 0) and 6-bit multiples of
    it nearest each target."""
    factor = (targets.max(axis=1) / 63).astype(np.float16).astype(np.float64)
    # fp16 rounding may have pulled the factor below max / 63: the largest multiple stays within 63
    levels = np.clip(np.rint(np.divide(targets, factor[:, None], out=np.zeros_like(targets), where=factor[:, None] > 0)), 0, 63)
    return factor, levels.astype(np.int64)
