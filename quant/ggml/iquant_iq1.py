"""IQ1_S: llama.cpp's 1.56-bit type, byte for byte as ``quantize_iq1_s`` writes it.

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
  when it beats the best so far, so the scan runs split by split, vectorised over blocks;
- groups off the grid take the neighbour of least ``Σ w·(scale·q − x)²`` at the fitted scale, and
  then the scale is refitted if that is positive;
- ``d = max scale/15`` is stored as fp16 ``d·1.125``; each block's 3-bit ``nearest_int(0.5·(scale/d
  − 1))``, and bit 15 for a −1/8 shift, sit above the grid indices' top 3 bits in a uint16.

llama.cpp asserts an importance matrix for IQ1_S, and so does this encoder.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

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
    best = np.full(blocks, -np.finfo(F32).max, dtype=F32)
    scale = np.abs(xb).max(axis=1)
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
                    scale = np.where(better, sumqx / np.where(better, sumq2, F32(1)), scale)
                    best = np.where(better, scale * sumqx, best)
                    i1_best[better], i2_best[better], shift[better] = i1, i2, sign
    found = (i1_best >= 0) & (i2_best >= 0) & (shift != 0)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(BLOCK)[None, :], axis=1)
    L = np.where(rank < i1_best[:, None], 0, np.where(rank < i2_best[:, None], 1, 2))
    negative = scale < 0
    L = np.where(negative[:, None], 2 - L, L)
    return np.abs(scale), np.where(negative, -shift, shift), L, found
