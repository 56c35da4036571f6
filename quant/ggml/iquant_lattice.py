"""IQ3_S: llama.cpp's 3-bit lattice type, byte for byte as ``quantize_iq3_s`` writes it.

Why it exists: at about 3.44 bits per weight it keeps more than Q3_K by storing magnitudes in
groups of 4 as one of 512 grid points (quant/ggml/lattice.py) and signs separately, so every code
is a likely combination. Super-blocks of 256 hold 8 blocks of 32, each with a 4-bit scale under one
fp16 ``d``.

``quantize_row_iq3_s_impl``, per block of 32 (vectorised here over every block of a chunk):

- search weights ``w = qw·sqrt(sigma2 + x²)`` (``sigma2 = 2·Σx²/256`` over the super-block), or
  ``x²``; the neighbour search weighs by ``sqrt(w)``;
- magnitudes ``|x|`` and a sign bit per element (``x >= 0`` is positive, so −0 is too);
- for 19 inverse scales ``(15 + 0.2·is)/max``, is in −9..9: each group of 4 rounds to levels
  ``nearest_int(0.5·(id·|x| − 1))`` in 0..7; a group off the grid takes its best neighbour at scale
  ``1/id``; the scale ``Σwq|x|/Σwq²`` (q = 2·level + 1) is kept when it raises ``(Σwq|x|)²/Σwq²``;
- if any group of the best try was off the grid, every group is rounded again at the best scale
  (neighbours at that scale) and the scale refitted;
- ``d = max scale/31`` is stored as fp16 ``d·1.033``, each block's 4-bit scale as
  ``nearest_int(0.5·(scale/d − 1))``.

A block of all zeros is skipped without advancing the write position of its codes and signs
(ggml's ``continue`` before ``qs += ...``): the next blocks' codes move up into its place and the
super-block's last slots stay zero, while the 9th bits (``qh``) are indexed by block. The bytes
keep that too.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType

from quant.ggml import lattice
from quant.ggml.numerics import F32, ZERO, f16_bytes, nearest_int, seqsum
from quant.ggml.rows import encode_by_rows
from quant.ggml.types import PortedType

QK_K = 256
BLOCK = 32  # values per block with one scale
_CHUNK_ELEMENTS = 1 << 16  # the neighbour search holds [groups, neighbours, 4] float32 arrays


def best_neighbours(grid: lattice.Lattice, codes: np.ndarray, xval: np.ndarray, w: np.ndarray,
                    scale: np.ndarray) -> np.ndarray:
    """ggml's ``iq3_find_best_neighbour`` for off-grid groups: among the neighbours of each packed
    code ``[M]``, the grid index of least ``Σ w·(scale·q − x)²`` (summed in order, q = 2·level + 1,
    the first of equal errors), for magnitudes and weights ``[M, n]`` and ``scale [M]``.

    Most codes have a handful of neighbours and a few have dozens, so codes are searched in
    buckets of similar counts, each as wide as its longest list rather than the longest of all.
    """
    out = np.empty(len(codes), dtype=np.int32)
    counts = grid.counts[codes]
    for low, high in _BUCKETS:
        sel = np.flatnonzero((counts > low) & (counts <= high))
        if sel.size == 0:
            continue
        width = min(high, grid.neighbours.shape[1])
        c = codes[sel]
        cand = grid.neighbours[c, :width]  # [m, width], −1 padded
        q = grid.neighbour_values[c, :, :width]  # [m, n, width]
        s = scale[sel, None]
        d2 = np.zeros(cand.shape, dtype=F32)
        for i in range(q.shape[1]):
            diff = s * q[:, i] - xval[sel, i : i + 1]
            d2 += w[sel, i : i + 1] * diff * diff
        d2[(cand < 0) | np.isnan(d2)] = np.inf  # padding, and what ggml's ``d2 < best`` never takes
        out[sel] = np.take_along_axis(cand, np.argmin(d2, axis=1)[:, None], axis=1)[:, 0]
    return out


_BUCKETS = ((0, 4), (4, 8), (8, 16), (16, 1 << 30))  # (fewer than, at most) neighbours


def grid_levels(grid: lattice.Lattice, levels: np.ndarray, xval: np.ndarray, w: np.ndarray,
                scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of rounded levels ``[..., n]`` moved onto the grid: (grid index, on the grid as
    rounded), with ``xval``, ``w`` like ``levels`` and one ``scale`` per group (``[...]``)."""
    index = grid.index[grid.pack(levels)]
    on_grid = index >= 0
    off = np.flatnonzero(~on_grid)
    if off.size:
        n = levels.shape[-1]
        index.reshape(-1)[off] = best_neighbours(grid, grid.pack(levels.reshape(-1, n)[off]), xval.reshape(-1, n)[off],
                                                 w.reshape(-1, n)[off], scale.reshape(-1)[off])
    return index, on_grid


def _round_levels(iscale: np.ndarray, xval: np.ndarray, top: int) -> np.ndarray:
    """``MAX(0, MIN(top, nearest_int(0.5·(iscale·x − 1))))`` with iscale broadcast over x."""
    return np.clip(nearest_int(F32(0.5) * (iscale * xval - F32(1))), 0, top).astype(np.int64)


class IQ3_S(PortedType, qtype=GGMLQuantizationType.IQ3_S):
    """d (fp16), the low 8 bits of 64 grid indices, their 9th bits (8 bytes), 32 bytes of signs, and
    eight 4-bit block scales."""

    groups: ClassVar[int] = 4  # values per grid point

    @classmethod
    def encode_rows(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        n = x.shape[1]
        qw_b = None if qw is None else qw.reshape(-1, BLOCK)  # [blocks per row, 32]
        return encode_by_rows(x, n // QK_K * cls.type_size, _CHUNK_ELEMENTS, lambda chunk: cls.encode_chunk(chunk, qw_b))

    @classmethod
    def encode_chunk(cls, x: np.ndarray, qw_b: np.ndarray | None) -> np.ndarray:
        rows, n = x.shape
        grid = lattice.iq3_s()
        xb = x.reshape(rows, -1, BLOCK)  # [rows, blocks, 32]
        if qw_b is None:
            w = xb * xb
        else:
            per_super = np.ascontiguousarray(x.reshape(rows, -1, QK_K).transpose(2, 0, 1))
            sigma2 = F32(2) * seqsum(per_super * per_super) / F32(QK_K)  # [rows, super-blocks]
            w = qw_b * np.sqrt(np.repeat(sigma2, QK_K // BLOCK, axis=1)[..., None] + xb * xb)
        blocks = rows * (n // BLOCK)
        xb, w = xb.reshape(blocks, BLOCK), w.reshape(blocks, BLOCK)
        positive = xb >= 0
        xval = np.where(positive, xb, -xb)
        scale, levels, signs = _fit_blocks(grid, xval, w, positive)
        index = grid.index[grid.pack(levels.reshape(blocks, -1, cls.groups))]  # [blocks, 8]
        return _pack(rows, n // QK_K, scale, index, signs, xval.max(axis=1) != 0)


def _fit_blocks(grid: lattice.Lattice, xval: np.ndarray, w: np.ndarray,
                positive: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each block's scale, levels ``[blocks, 32]`` and sign bytes ``[blocks, 4]`` (ggml's search)."""
    blocks = len(xval)
    groups = (blocks, BLOCK // 4, 4)
    xval4, waux4 = xval.reshape(groups), np.sqrt(w).reshape(groups)
    wx_e, w_e = np.ascontiguousarray((w * xval).T), np.ascontiguousarray(w.T)  # element-major sums
    mx = xval.max(axis=1)
    zero = mx == 0
    mx = np.where(zero, F32(1), mx)

    def fit(iscale: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        levels = _round_levels(iscale[:, None, None], xval4, 7)
        index, on_grid = grid_levels(grid, levels, xval4, waux4, np.broadcast_to(scale[:, None], groups[:2]))
        L = grid.points[index].reshape(blocks, BLOCK).astype(F32)
        q = (F32(2) * L + F32(1)).T
        return seqsum(wx_e * q), seqsum(w_e * q * q), L, on_grid

    scale = mx / F32(15)
    best = np.zeros(blocks, dtype=F32)
    L = np.zeros((blocks, BLOCK), dtype=F32)
    on_grid = np.zeros(groups[:2], dtype=bool)
    for step in range(-9, 10):
        iscale = (F32(15) + F32(step) * F32(0.2)) / mx
        sumqx, sumq2, L_try, on_try = fit(iscale, F32(1) / iscale)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = np.where(better, sumqx / sumq2, scale)
        best = np.where(better, scale * sumqx, best)
        L[better], on_grid[better] = L_try[better], on_try[better]
    again = np.flatnonzero(~on_grid.all(axis=1) & (scale > 0))
    if again.size:
        sub = scale[again]
        levels = _round_levels((F32(1) / sub)[:, None, None], xval4[again], 7)
        index, _ = grid_levels(grid, levels, xval4[again], waux4[again], np.broadcast_to(sub[:, None], (again.size, groups[1])))
        L[again] = grid.points[index].reshape(again.size, BLOCK)
        q = (F32(2) * L[again] + F32(1)).T
        sumqx, sumq2 = seqsum(wx_e[:, again] * q), seqsum(w_e[:, again] * q * q)
        scale[again] = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, F32(1)), sub)
    signs = np.packbits(~positive.reshape(blocks, -1, 8), axis=2, bitorder="little")[..., 0]  # [blocks, 4]
    flip = scale < 0  # only with negative importance: ggml flips the scale and every sign
    scale = np.where(flip, -scale, scale)
    signs = np.where(flip[:, None], ~signs, signs)
    scale[zero] = 0
    return scale, L.astype(np.int64), signs


def _pack(rows: int, supers: int, scale: np.ndarray, index: np.ndarray, signs: np.ndarray,
          nonzero: np.ndarray) -> np.ndarray:
    """The 110 bytes of each super-block; a zero block's codes and signs are skipped over (see the
    module's docstring)."""
    per = QK_K // BLOCK
    shape = (rows, supers, per)
    scales = scale.reshape(shape)
    max_scale = scales.max(axis=2)
    d = max_scale / F32(31)
    stored_d = np.where(max_scale > 0, d * F32(1.033), ZERO)
    inv = np.divide(F32(1), d, out=np.zeros_like(d), where=max_scale > 0)
    l = np.clip(nearest_int(F32(0.5) * (inv[..., None] * scales - F32(1))), 0, 15).astype(np.uint8)
    l[max_scale == 0] = 0
    nz = nonzero.reshape(shape)
    order = np.argsort(~nz, axis=2, kind="stable")  # the non-zero blocks first, in order
    kept = np.take_along_axis(nz, order, axis=2)[..., None]
    index = index.reshape(*shape, -1)
    qs = np.where(kept, np.take_along_axis(index & 255, order[..., None], axis=2), 0).astype(np.uint8)
    sg = np.where(kept, np.take_along_axis(signs.reshape(*shape, -1), order[..., None], axis=2), 0).astype(np.uint8)
    qh = np.where(nz, np.packbits((index >> 8).astype(bool), axis=3, bitorder="little")[..., 0], 0).astype(np.uint8)
    return np.concatenate([f16_bytes(stored_d), qs.reshape(rows, supers, -1), qh, sg.reshape(rows, supers, -1),
                           l[..., 0::2] | (l[..., 1::2] << 4)], axis=2)
