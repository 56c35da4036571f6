"""IQ4_NL and IQ4_XS: llama.cpp's 4-bit non-linear types, byte for byte as ``ggml_quantize_chunk``.

Why they exist: a 4-bit grid whose 16 levels (``kvalues_iq4nl``, −127..113) crowd around zero,
where most weights lie, loses less than the evenly spaced Q4_0 at the same size. IQ4_NL is blocks
of 32 with an fp16 scale each (4.5 bits per weight); IQ4_XS packs eight such blocks into a
super-block of 256 with 6-bit block scales under one fp16 ``d`` (4.25 bits per weight). IQ4_XS files
fall back to IQ4_NL for rows that do not split into 256.

Both come from one search, ``quantize_row_iq4_nl_impl``, which llama.cpp runs with or without an
importance matrix (7 tries either way):

- search weights: ``qw·sqrt(sigma2 + x²)`` with ``sigma2 = 2·Σx²/super-block size`` over the
  super-block, or ``x²`` without an importance matrix;
- per block of 32, the first largest-magnitude value ``max`` sets a first scale ``max/127``; each
  element goes to its nearest level (``best_index_int8``, ties to the upper level); the weighted
  least-squares scale ``Σwqx/Σwq²`` is kept, and 15 more inverse scales ``(t − 127)/max`` for
  t in −7..7 replace it when they raise ``(Σwqx)²/Σwq²``;
- IQ4_NL stores the block's scale as fp16 and requantizes against the unrounded float32 scale;
  IQ4_XS stores ``d = −max_scale/32`` (fp16), each block's ``l = nearest_int(scale/d)`` in −32..31,
  and requantizes every block against ``d·l``.

The float arithmetic is ggml's (docs: gguf-kquants.md §1): float32 throughout, sums accumulated
element by element in order, ``nearest_int`` rounding. The work is vectorised over every block of
a chunk of rows at once, element-major (``[32, rows, blocks]``), so each sequential sum over a
block is one pass over contiguous slices; Python loops only over the 16 candidate scales.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType

from quant.ggml.numerics import F32, ZERO, element_major, f16_bytes, importance, nearest_int, seqsum
from quant.ggml.rows import encode_by_rows
from quant.ggml.search import signed_max
from quant.ggml.types import PortedType

BLOCK = 32  # values per block with one scale
# ggml's kvalues_iq4nl: the 16 levels of a block, in units of its scale
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=F32)
_NTRY = 7  # candidate inverse scales (t − 127)/max for t in −7..7
# Input values per chunk: the search keeps about ten float32 arrays of a chunk's size.
_CHUNK_ELEMENTS = 1 << 18


# Every midpoint between neighbouring levels is a multiple of 0.5, so the nearest level of v depends
# only on floor(2v): a table over floor(2v) in [−256, 255] (beyond it the end levels win) is the search.
_MIDPOINTS = (KVALUES[:-1] + KVALUES[1:]) / 2
_NEAREST = np.searchsorted(_MIDPOINTS, np.arange(-256, 256) / 2, side="right").astype(np.uint8)


def best_index(v: np.ndarray) -> np.ndarray:
    """ggml's ``best_index_int8`` over the IQ4 levels, elementwise: the nearest level's index, the
    upper one on a tie, 0 and 15 beyond the ends, 15 for NaN.

    ggml compares ``v − lo < hi − v`` in float32. Near a midpoint both differences are exact (they
    lie in the binade of v or below), and elsewhere rounding cannot reorder them, so that is
    ``v < (lo + hi)/2`` exactly: the number of midpoints <= v, which ``_NEAREST`` tabulates.
    """
    h = np.floor(v * F32(2))
    np.fmin(h, F32(255), out=h)  # NaN -> 255, the last level
    np.maximum(h, F32(-256), out=h)
    h += F32(256)
    return _NEAREST[h.astype(np.intp)]


def block_scales(xe: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The float32 scale of every block of 32 (``[rows, blocks]``), from element-major data and
    search weights ``[32, rows, blocks]``: the first fit and ggml's 15 tries; 0 for a block whose
    largest |x| is below 1e-15."""
    mx, zero = signed_max(xe)

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = KVALUES[best_index(iscale * xe)]
        wq = w * q
        return seqsum(wq * xe), seqsum(wq * q)

    d0 = -mx / KVALUES[0]
    sumqx, sumq2 = sums(F32(1) / d0)
    d = np.where(sumq2 > 0, sumqx / sumq2, ZERO)
    best = d * sumqx
    for t in range(-_NTRY, _NTRY + 1):
        sumqx, sumq2 = sums(F32(t + KVALUES[0]) / mx)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / sumq2, d)
        best = np.where(better, d * sumqx, best)
    return np.where(zero, ZERO, d)


def _inverse(v: np.ndarray) -> np.ndarray:
    """``v ? 1/v : 0`` elementwise."""
    return np.divide(F32(1), v, out=np.zeros_like(v), where=v != 0)


def _nibbles(L: np.ndarray) -> np.ndarray:
    """Level indices ``[rows, blocks, 32]`` as 16 bytes per block: element j low, j + 16 high."""
    return L[..., :16] | (L[..., 16:] << 4)


class _IQ4(PortedType):
    """A 4-bit non-linear type; ``super_block`` values share the search's ``sigma2``, and
    ``encode_blocks`` turns the block scales into the stored fields and levels."""

    super_block: ClassVar[int]

    @classmethod
    def encode_rows(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """Encode chunks of rows, with the importance laid out element-major like the data."""
        n = x.shape[1]
        qw_e = None if qw is None else element_major(qw[None, :], BLOCK)  # [32, 1, blocks]

        def encode_chunk(chunk: np.ndarray) -> np.ndarray:
            xe = element_major(chunk, BLOCK)
            if qw_e is None:
                w = xe * xe
            else:
                per_super = element_major(chunk, cls.super_block)  # sequential Σx² per super-block
                sigma2 = seqsum(per_super * per_super) * F32(2.0 / cls.super_block)
                w = importance(qw_e, xe, np.repeat(sigma2, cls.super_block // BLOCK, axis=1)[None])
            return cls.encode_blocks(xe, block_scales(xe, w))

        return encode_by_rows(x, n // cls.block_size * cls.type_size, _CHUNK_ELEMENTS, encode_chunk)


class IQ4_NL(_IQ4, qtype=GGMLQuantizationType.IQ4_NL):
    """Blocks of 32: fp16 scale, then the level indices as nibbles (element j low, j + 16 high)."""

    super_block = BLOCK

    @staticmethod
    def encode_blocks(xe: np.ndarray, scale: np.ndarray) -> np.ndarray:
        L = best_index(_inverse(scale) * xe).transpose(1, 2, 0)
        return np.concatenate([f16_bytes(scale), _nibbles(L)], axis=2)


class IQ4_XS(_IQ4, qtype=GGMLQuantizationType.IQ4_XS):
    """Super-blocks of 256: fp16 d, the high 2 bits of the eight 6-bit block scales (uint16), their
    low 4 bits (4 bytes), then the level indices of each block of 32 as nibbles."""

    super_block = 256

    @staticmethod
    def encode_blocks(xe: np.ndarray, scale: np.ndarray) -> np.ndarray:
        rows = scale.shape[0]
        per = IQ4_XS.super_block // BLOCK
        scales = scale.reshape(rows, -1, per)
        # ggml's scan ``if (|d| > amax) max = d`` from 0: the first scale of largest magnitude, +0
        # when every one is 0, and never a NaN (a block whose x² overflowed float32)
        size = np.where(np.isnan(scales), F32(-1), np.abs(scales))
        first = np.argmax(size == size.max(axis=2, keepdims=True), axis=2)
        max_scale = np.take_along_axis(scales, first[..., None], axis=2)[..., 0]
        max_scale = np.where(size.max(axis=2) > 0, max_scale, ZERO)
        d = -max_scale / F32(32)
        l = np.clip(nearest_int(_inverse(d)[..., None] * scales), F32(-32), F32(31))
        step = (d[..., None] * l).reshape(rows, -1)
        L = best_index(_inverse(step) * xe).transpose(1, 2, 0).reshape(rows, -1, per * BLOCK)
        biased = (l + F32(32)).astype(np.uint8)  # [rows, super-blocks, 8] in 0..63
        low = biased[..., 0::2] & 15 | (biased[..., 1::2] & 15) << 4
        high = np.bitwise_or.reduce((biased >> 4).astype(np.uint16) << (2 * np.arange(per, dtype=np.uint16)), axis=2)
        high = high.astype("<u2").view(np.uint8).reshape(rows, -1, 2)
        nibbles = _nibbles(L.reshape(rows, -1, per, BLOCK)).reshape(rows, -1, per * 16)
        return np.concatenate([f16_bytes(d), high, low, nibbles], axis=2)
