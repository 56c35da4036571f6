"""IQ1_S and IQ1_M: llama.cpp's 1.56- and 1.75-bit types, byte for byte as ``quantize_iq1_s`` and
``quantize_iq1_m`` write them (IQ1_M: see its class).

Why: the smallest llama.cpp type, for the largest models at the smallest files. Each block of 32
is ``scale·(q + shift)`` with q in {−1, 0, 1} and a shift of ±1/8, and each group of 8 is one
point of a 2048-point grid (quant/ggml/lattice.py), with a 3-bit block scale and the shift's sign.

``quantize_row_iq1_s_impl``, per block of 32 (vectorised here over the blocks of a chunk):

- weights ``qw·sqrt(sigma2 + x²)``, ``sigma2 = 2·Σx²/256``; a block whose largest |x| is below
  1e-12 is zero;
- the block's values sorted ascending (a stable sort: glibc's qsort is a merge sort for arrays this
  small, so equal values keep their order); running sums of ``w·x`` and ``w`` in that order;
- every split of the sorted values into three runs (levels 0, 1, 2) with either shift is scored by
  ``(Σwqx)²/Σwq²``, in ggml's order (i1, then i2 ≥ i1, shift +1/8 before −1/8), a candidate kept
  when it beats the best so far: by a small C kernel (``iq1_split.c``, numpy's float32 operations
  in the same order) where it builds, else split by split in numpy, vectorised over blocks;
- groups off the grid take the neighbour of least ``Σ w·(scale·q − x)²`` at the fitted scale, and
  then the scale is refitted if that is positive;
- ``d = max scale/15`` is stored as fp16 ``d·1.125``; each block's 3-bit ``nearest_int(0.5·(scale/d
  − 1))``, and bit 15 for a −1/8 shift, sit above the grid indices' top 3 bits in a uint16.

llama.cpp asserts an importance matrix for IQ1_S, and so does this encoder.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from core import native
from core.native import pointer
from quant.ggml import lattice
from quant.ggml.iquant_lattice import best_neighbours
from quant.ggml.numerics import F32, ZERO, f16_bytes, nearest_int, seqsum
from quant.ggml.rows import encode_by_rows
from quant.ggml.types import PortedType

QK_K = 256
BLOCK = 32
DELTA = F32(0.125)  # IQ1S_DELTA
_SHIFTED = {  # the three values of a level, with the shift +1/8 and −1/8
    1: np.array([F32(-1) + DELTA, DELTA, F32(1) + DELTA], dtype=F32),
    -1: np.array([F32(-1) - DELTA, -DELTA, F32(1) - DELTA], dtype=F32),
}
_EPS = F32(1e-12)  # GROUP_MAX_EPS_IQ1_S
_CHUNK_ELEMENTS = 1 << 17


class IQ1_S(PortedType, qtype=GGMLQuantizationType.IQ1_S):
    """d (fp16), the low 8 bits of 32 grid indices, then per block a uint16: the indices' top 3 bits
    (4 × 3), the 3-bit block scale (bits 12..14) and the shift's sign (bit 15)."""

    @classmethod
    def encode_rows(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        if qw is None:
            raise ValueError("IQ1_S needs an importance matrix (llama.cpp's quantizer asserts one)")
        n = x.shape[1]
        qw_b = qw.reshape(-1, BLOCK)
        return encode_by_rows(x, n // QK_K * cls.type_size, _CHUNK_ELEMENTS, lambda chunk: _encode_chunk(chunk, qw_b))


def _encode_chunk(x: np.ndarray, qw_b: np.ndarray) -> np.ndarray:
    rows, n = x.shape
    supers = n // QK_K
    grid = lattice.iq1_s()
    per_super = np.ascontiguousarray(x.reshape(rows, -1, QK_K).transpose(2, 0, 1))
    sigma2 = F32(2) * seqsum(per_super * per_super) / F32(QK_K)
    xb = x.reshape(rows, -1, BLOCK)
    w = qw_b * np.sqrt(np.repeat(sigma2, QK_K // BLOCK, axis=1)[..., None] + xb * xb)
    blocks = rows * (n // BLOCK)
    xb, w = xb.reshape(blocks, BLOCK), w.reshape(blocks, BLOCK)
    zero = np.abs(xb).max(axis=1) < _EPS
    scale, shift, L, found = _best_split(xb, w)
    skipped = zero | ~found  # ggml writes nothing for these blocks
    xx = np.where((shift == 1)[:, None], _SHIFTED[1], _SHIFTED[-1])  # [blocks, 3]
    groups = (blocks, BLOCK // 8, 8)
    index = grid.index[grid.pack(L.reshape(groups))]
    off = np.nonzero((index < 0) & ~skipped[:, None])
    if off[0].size:
        g = off[0]
        index[off] = best_neighbours(grid, grid.pack(L.reshape(groups)[off]), xb.reshape(groups)[off],
                                     w.reshape(groups)[off], scale[g], level_values=xx[g])
        refit = np.unique(g)
        q = np.take_along_axis(xx[refit], grid.points[index[refit]].reshape(refit.size, BLOCK).astype(np.intp), axis=1).T
        wq = w[refit].T * q
        sumqx, sumq2 = seqsum(wq * xb[refit].T), seqsum(wq * q)
        scale[refit] = np.where((sumqx > 0) & (sumq2 > 0), sumqx / np.where(sumq2 > 0, sumq2, F32(1)), scale[refit])
    scale = np.where(skipped, ZERO, scale)
    shift = np.where(skipped, 1, shift)
    index = np.where(skipped[:, None], 0, index).astype(np.uint32)
    scales = scale.reshape(rows, supers, -1)
    max_scale = scales.max(axis=2)
    d = max_scale / F32(15)
    inv = np.divide(F32(1), d, out=np.zeros_like(d), where=max_scale > 0)
    l = np.clip(nearest_int(F32(0.5) * (inv[..., None] * scales - F32(1))), 0, 7).astype(np.uint32)
    l |= np.where(shift.reshape(rows, supers, -1) == -1, 8, 0).astype(np.uint32)
    l[max_scale == 0] = 0
    idx = index.reshape(rows, supers, -1, 4)
    qh = np.bitwise_or.reduce((idx >> 8) << (3 * np.arange(4, dtype=np.uint32)), axis=3) | l << 12
    stored_d = np.where(max_scale > 0, d * F32(1.125), ZERO)
    return np.concatenate([f16_bytes(stored_d), (idx & 255).astype(np.uint8).reshape(rows, supers, -1),
                           qh.astype("<u2").view(np.uint8).reshape(rows, supers, -1)], axis=2)


def _best_split(xb: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """ggml's exhaustive split search: (scale ≥ 0, shift ±1, levels [blocks, 32], found)."""
    blocks = len(xb)
    order = np.argsort(xb, axis=1, kind="stable")
    wx = np.take_along_axis(w * xb, order, axis=1)
    ws = np.take_along_axis(w, order, axis=1)
    zeros = np.zeros((blocks, 1), dtype=F32)
    sumx = np.concatenate([zeros, np.cumsum(wx, axis=1, dtype=F32)], axis=1)  # sequential, from 0
    sumw = np.concatenate([zeros, np.cumsum(ws, axis=1, dtype=F32)], axis=1)
    scale = np.abs(xb).max(axis=1)
    lib = _kernel()
    if lib is not None:
        i1_best, i2_best, shift = (np.empty(blocks, dtype=np.int64) for _ in range(3))
        arrays = (np.ascontiguousarray(sumx), np.ascontiguousarray(sumw), _SHIFTED[1], _SHIFTED[-1], scale, i1_best,
                  i2_best, shift)
        lib.iq1s_split(blocks, BLOCK, *map(pointer, arrays))
    else:
        i1_best, i2_best, shift = _numpy_split(sumx, sumw, scale)
    found = (i1_best >= 0) & (i2_best >= 0) & (shift != 0)
    negative = scale < 0
    return np.abs(scale), np.where(negative, -shift, shift), _split_levels(order, i1_best, i2_best, negative), found


def _split_levels(order: np.ndarray, i1: np.ndarray, i2: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Each value's level from its block's cut points in sorted ``order``: 0 below ``i1``, 1 below
    ``i2``, else 2; mirrored where the fitted scale is ``negative``."""
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :], axis=1)
    L = np.where(rank < i1[:, None], 0, np.where(rank < i2[:, None], 1, 2))
    return np.where(negative[:, None], 2 - L, L)


def _numpy_split(sumx: np.ndarray, sumw: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ1_S's scan where no C compiler builds the kernel: (i1, i2, shift) per block; ``scale`` in place."""
    blocks = len(sumx)
    best = np.full(blocks, -np.finfo(F32).max, dtype=F32)
    i1_best = np.full(blocks, -1)
    i2_best = np.full(blocks, -1)
    shift = np.zeros(blocks, dtype=np.int64)
    total_x, total_w = sumx[:, BLOCK], sumw[:, BLOCK]
    for i1 in range(BLOCK + 1):
        a, aw = sumx[:, i1] - sumx[:, 0], sumw[:, i1] - sumw[:, 0]
        for i2 in range(i1, BLOCK + 1):
            b, bw = sumx[:, i2] - sumx[:, i1], sumw[:, i2] - sumw[:, i1]
            c, cw = total_x - sumx[:, i2], total_w - sumw[:, i2]
            for sign in (1, -1):
                v = _SHIFTED[sign]
                sumqx = a * v[0] + b * v[1] + c * v[2]
                sumq2 = aw * v[0] * v[0] + bw * v[1] * v[1] + cw * v[2] * v[2]
                better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
                if better.any():
                    scale[:] = np.where(better, sumqx / np.where(better, sumq2, F32(1)), scale)
                    best = np.where(better, scale * sumqx, best)
                    i1_best[better], i2_best[better], shift[better] = i1, i2, sign
    return i1_best, i2_best, shift


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load(Path(__file__).with_name("iq1_split.c"), ("-ffp-contract=off",))
    if lib is not None:
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.iq1s_split.argtypes = [i64, i64, *[p] * 8]
        lib.iq1m_split.argtypes = [i64, i64, p, p, *[f32] * 6, *[p] * 4]
        lib.iq1s_split.restype = lib.iq1m_split.restype = None
    return lib


# ------------------------------------------------------------------------------------------------
# IQ1_M

_EPS_M = F32(1e-7)  # GROUP_MAX_EPS_IQ1_M
_MASKS = np.array([0x00, 0x80, 0x08, 0x88], dtype=np.uint32)  # the two groups' shift signs, by k


class IQ1_M(PortedType, qtype=GGMLQuantizationType.IQ1_M):
    """The low 8 bits of 32 grid indices; per block of 16 a byte of the two indices' top 3 bits and
    their shift signs (bits 3 and 7); four uint16 of 3-bit block scales whose top 4 bits hold, in
    turn, the 4 nibbles of the fp16 super-block scale.

    As IQ1_S on blocks of 16, but each half of a block (a grid group) has its own shift sign, so a
    split is scored with 4 sign combinations k (first half +1/8 if k < 2, second if k is even),
    from running sums kept per half; and the super-block scale is refitted at the end over every
    element, with the chosen levels times each block's odd scale 2l + 1. It runs without an
    importance matrix too (weights x²); llama.cpp files need one.
    """

    @classmethod
    def encode_rows(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        n = x.shape[1]
        qw_b = None if qw is None else qw.reshape(-1, 16)
        return encode_by_rows(x, n // QK_K * cls.type_size, _CHUNK_ELEMENTS, lambda chunk: _encode_chunk_m(chunk, qw_b))


def _encode_chunk_m(x: np.ndarray, qw_b: np.ndarray | None) -> np.ndarray:
    rows, n = x.shape
    supers, size = n // QK_K, 16
    grid = lattice.iq1_s()
    per_super = np.ascontiguousarray(x.reshape(rows, -1, QK_K).transpose(2, 0, 1))
    sigma2 = F32(2) * seqsum(per_super * per_super) / F32(QK_K)
    xb = x.reshape(rows, -1, size)
    w = xb * xb if qw_b is None else qw_b * np.sqrt(np.repeat(sigma2, QK_K // size, axis=1)[..., None] + xb * xb)
    blocks = rows * (n // size)
    xb, w = xb.reshape(blocks, size), w.reshape(blocks, size)
    zero = np.abs(xb).max(axis=1) < _EPS_M
    scale, k, L, found = _best_split_m(xb, w)
    skipped = zero | ~found
    k = np.where(skipped, 0, k)
    # each group's three values: the first half's sign is + for k < 2, the second's for even k
    plus = np.stack([k < 2, k % 2 == 0], axis=1)  # [blocks, 2]
    xx = np.where(plus[..., None], _SHIFTED[1], _SHIFTED[-1])  # [blocks, 2, 3]
    groups = (blocks, 2, 8)
    index = grid.index[grid.pack(L.reshape(groups))]
    off = np.nonzero((index < 0) & ~skipped[:, None])
    if off[0].size:
        index[off] = best_neighbours(grid, grid.pack(L.reshape(groups)[off]), xb.reshape(groups)[off],
                                     w.reshape(groups)[off], scale[off[0]], level_values=xx[off])
        refit = np.unique(off[0])
        q = _group_values(grid, index[refit], xx[refit]).T
        wq = w[refit].T * q
        sumqx, sumq2 = seqsum(wq * xb[refit].T), seqsum(wq * q)
        scale[refit] = np.where((sumqx > 0) & (sumq2 > 0), sumqx / np.where(sumq2 > 0, sumq2, F32(1)), scale[refit])
    scale = np.where(skipped, ZERO, scale)
    index = np.where(skipped[:, None], 0, index)  # what ggml's refit of d reads back for these blocks
    scales = scale.reshape(rows, supers, -1)  # [rows, supers, 16]
    max_scale = scales.max(axis=2)
    empty = max_scale == 0
    d = max_scale / F32(15)
    inv = np.divide(F32(1), d, out=np.zeros_like(d), where=~empty)
    l = np.clip(nearest_int(F32(0.5) * (inv[..., None] * scales - F32(1))), 0, 7)
    # d refitted over every element: the levels' values times each block's 2l + 1
    q = _group_values(grid, index, xx) * (F32(2) * l.reshape(-1, 1) + F32(1))  # [blocks, 16]
    q_e = np.ascontiguousarray(q.reshape(rows, supers, -1).transpose(2, 0, 1))
    w_e = np.ascontiguousarray(w.reshape(rows, supers, -1).transpose(2, 0, 1))
    x_e = np.ascontiguousarray(xb.reshape(rows, supers, -1).transpose(2, 0, 1))
    wq = w_e * q_e
    sumqx, sumq2 = seqsum(wq * x_e), seqsum(wq * q_e)
    d = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, F32(1)), d)
    bits = (d * F32(1.1125)).astype("<f2").view(np.uint16).astype(np.uint32)
    l = l.astype(np.uint32).reshape(rows, supers, 4, 4)
    sc = np.bitwise_or.reduce(l << (3 * np.arange(4, dtype=np.uint32)), axis=3)
    sc |= ((bits[..., None] >> (4 * np.arange(4, dtype=np.uint32))) & 15) << 12
    sc[empty] = 0
    idx = index.astype(np.uint32).reshape(rows, supers, -1, 2)
    qh = (idx[..., 0] >> 8) | (idx[..., 1] >> 8) << 4
    qh |= np.where(empty[..., None], 0, _MASKS[k.reshape(rows, supers, -1)])
    return np.concatenate([(idx & 255).astype(np.uint8).reshape(rows, supers, -1), qh.astype(np.uint8),
                           sc.astype("<u2").view(np.uint8).reshape(rows, supers, -1)], axis=2)


def _group_values(grid: lattice.Lattice, index: np.ndarray, xx: np.ndarray) -> np.ndarray:
    """The values of grid points ``index [B, 2]`` at each group's shifted levels ``xx [B, 2, 3]``, [B, 16]."""
    levels = grid.points[index].astype(np.intp)  # [B, 2, 8]
    return np.take_along_axis(xx, levels, axis=2).reshape(len(index), -1)


def _m_constants() -> tuple[np.float32, ...]:
    """IQ1_M's scan constants, float32: the top shifted levels p2, m2 and the level-square steps."""
    xp, xm = _SHIFTED[1], _SHIFTED[-1]
    return (xp[2], xm[2], xp[0] * xp[0] - xp[1] * xp[1], xp[1] * xp[1] - xp[2] * xp[2],
            xm[0] * xm[0] - xm[1] * xm[1], xm[1] * xm[1] - xm[2] * xm[2])


_M_CONSTANTS = _m_constants()  # p2, m2, cp1, cp2, cm1, cm2


def _best_split_m(xb: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """IQ1_M's split search: (scale ≥ 0, sign combination k, levels [blocks, 16], found)."""
    blocks, size = xb.shape
    order = np.argsort(xb, axis=1, kind="stable")
    wx = np.take_along_axis(w * xb, order, axis=1)
    ws = np.take_along_axis(w, order, axis=1)
    second = order >= size // 2  # which half each sorted element belongs to
    zeros = np.zeros((blocks, 1), dtype=F32)
    px = [np.concatenate([zeros, np.cumsum(np.where(second == h, wx, ZERO), axis=1, dtype=F32)], axis=1) for h in (0, 1)]
    pw = [np.concatenate([zeros, np.cumsum(np.where(second == h, ws, ZERO), axis=1, dtype=F32)], axis=1) for h in (0, 1)]
    scale = np.abs(xb).max(axis=1)
    lib = _kernel()
    if lib is not None:
        i1_best, i2_best, k_best = (np.empty(blocks, dtype=np.int64) for _ in range(3))
        sums = np.ascontiguousarray(np.stack(px)), np.ascontiguousarray(np.stack(pw))
        lib.iq1m_split(blocks, size, *map(pointer, sums), *map(float, _M_CONSTANTS),
                       *map(pointer, (scale, i1_best, i2_best, k_best)))
    else:
        i1_best, i2_best, k_best = _numpy_split_m(px, pw, scale, size)
    found = (i1_best >= 0) & (i2_best >= 0) & (k_best >= 0)
    negative = scale < 0
    return np.abs(scale), np.where(negative, 3 - k_best, k_best), _split_levels(order, i1_best, i2_best, negative), found


def _numpy_split_m(px: list[np.ndarray], pw: list[np.ndarray], scale: np.ndarray,
                   size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ1_M's scan where no C compiler builds the kernel: (i1, i2, k) per block; ``scale`` in place."""
    blocks = len(scale)
    p2, m2, cp1, cp2, cm1, cm2 = _M_CONSTANTS
    txs, tws = [px[h][:, size] for h in (0, 1)], [pw[h][:, size] for h in (0, 1)]
    tp2 = [tws[h] * p2 * p2 for h in (0, 1)]
    tm2 = [tws[h] * m2 * m2 for h in (0, 1)]
    best = np.full(blocks, -np.finfo(F32).max, dtype=F32)
    i1_best = np.full(blocks, -1)
    i2_best = np.full(blocks, -1)
    k_best = np.full(blocks, -1)
    for i1 in range(size + 1):
        for i2 in range(i1, size + 1):
            qx_p, qx_m, q2_p, q2_m = [], [], [], []
            for h in (0, 1):
                sx = px[h][:, i1] + px[h][:, i2]
                qx_p.append(txs[h] * p2 - sx)
                qx_m.append(txs[h] * m2 - sx)
                q2_p.append(tp2[h] + pw[h][:, i1] * cp1 + pw[h][:, i2] * cp2)
                q2_m.append(tm2[h] + pw[h][:, i1] * cm1 + pw[h][:, i2] * cm2)
            combos = ((qx_p[0] + qx_p[1], q2_p[0] + q2_p[1]), (qx_p[0] + qx_m[1], q2_p[0] + q2_m[1]),
                      (qx_m[0] + qx_p[1], q2_m[0] + q2_p[1]), (qx_m[0] + qx_m[1], q2_m[0] + q2_m[1]))
            for k, (sumqx, sumq2) in enumerate(combos):
                better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
                if better.any():
                    scale[:] = np.where(better, sumqx / np.where(better, sumq2, F32(1)), scale)
                    best = np.where(better, scale * sumqx, best)
                    i1_best[better], i2_best[better], k_best[better] = i1, i2, k
    return i1_best, i2_best, k_best
