"""IQ3_S and IQ3_XXS: llama.cpp's 3-bit lattice types, byte for byte as ``quantize_iq3_s`` and
``quantize_iq3_xxs`` write them.

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

IQ3_XXS (3.06 bits per weight) runs the same search on a 256-point grid, with 31 tries (is in
−15..15), a zero threshold of 1e-8, and 7 sign bits per group of 8 (see ``IQ3_XXS.pack``); its
``d`` is stored as ``d·1.0125``. llama.cpp makes it only with an importance matrix in a file.
"""

from __future__ import annotations

from collections.abc import Callable
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


class _Lattice3(PortedType):
    """A 3-bit lattice type: blocks of 32 searched on a grid of groups of 4 (``_search``), stored
    with their signs by ``pack``."""

    lattice: ClassVar[Callable[[], lattice.Lattice]]
    steps: ClassVar[range]  # the search's ``is``: inverse scales (15 + 0.2·is)/max

    @classmethod
    def encode_rows(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        n = x.shape[1]
        qw_b = None if qw is None else qw.reshape(-1, BLOCK)  # [blocks per row, 32]
        return encode_by_rows(x, n // QK_K * cls.type_size, _CHUNK_ELEMENTS, lambda chunk: cls.encode_chunk(chunk, qw_b))

    @classmethod
    def encode_chunk(cls, x: np.ndarray, qw_b: np.ndarray | None) -> np.ndarray:
        rows, n = x.shape
        xb = x.reshape(rows, -1, BLOCK)  # [rows, blocks, 32]
        if qw_b is None:
            w = xb * xb
        else:
            per_super = np.ascontiguousarray(x.reshape(rows, -1, QK_K).transpose(2, 0, 1))
            sigma2 = F32(2) * seqsum(per_super * per_super) / F32(QK_K)  # [rows, super-blocks]
            w = qw_b * np.sqrt(np.repeat(sigma2, QK_K // BLOCK, axis=1)[..., None] + xb * xb)
        blocks = rows * (n // BLOCK)
        return cls.pack(rows, n // QK_K, cls.lattice(), xb.reshape(blocks, BLOCK), w.reshape(blocks, BLOCK))


class IQ3_S(_Lattice3, qtype=GGMLQuantizationType.IQ3_S):
    """d (fp16), the low 8 bits of 64 grid indices, their 9th bits (8 bytes), 32 bytes of signs, and
    eight 4-bit block scales."""

    lattice, steps = staticmethod(lattice.iq3_s), range(-9, 10)

    @staticmethod
    def pack(rows: int, supers: int, grid: lattice.Lattice, xb: np.ndarray, w: np.ndarray) -> np.ndarray:
        positive = xb >= 0
        xval = np.where(positive, xb, -xb)
        mx = xval.max(axis=1)
        scale, L = _search(grid, xval, w, IQ3_S.steps, mx == 0, start_on_grid=False, redo_blocks=True)
        signs = np.packbits(~positive.reshape(len(xb), -1, 8), axis=2, bitorder="little")[..., 0]  # [blocks, 4]
        flip = scale < 0  # only with negative importance: ggml flips the scale and every sign
        signs = np.where(flip[:, None], ~signs, signs)
        index = grid.index[grid.pack(L.reshape(len(xb), -1, 4))]  # [blocks, 8]
        return _pack(rows, supers, np.abs(scale), index, signs, mx != 0)


class IQ3_XXS(_Lattice3, qtype=GGMLQuantizationType.IQ3_XXS):
    """d (fp16), 64 grid indices of the 256-point grid, then per block a uint32 of four 7-bit sign
    groups and the 4-bit block scale (bits 28..31)."""

    lattice, steps = staticmethod(lattice.iq3_xxs), range(-15, 16)

    @staticmethod
    def pack(rows: int, supers: int, grid: lattice.Lattice, xb: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Signs are stored 7 to a group of 8, the 8th implied by even parity: a group with an odd
        number of negatives flips its element of least ``w·x²`` (the first such), whose magnitude
        the search then sees negated, as in ggml."""
        blocks = len(xb)
        negative = ~(xb >= 0).reshape(blocks, 4, 8)
        xval = np.abs(xb).reshape(blocks, 4, 8)
        odd = negative.sum(axis=2) % 2 == 1
        flipped = (np.arange(8) == np.argmin((w * xb * xb).reshape(blocks, 4, 8), axis=2)[..., None]) & odd[..., None]
        xval = np.where(flipped, -xval, xval).reshape(blocks, BLOCK)
        signs = np.packbits(negative ^ flipped, axis=2, bitorder="little")[..., 0] & 127  # [blocks, 4]
        mx = xval.max(axis=1)
        zero = mx < _EPS_IQ3_XXS
        scale, L = _search(grid, xval, w, IQ3_XXS.steps, zero, start_on_grid=True, redo_blocks=False)
        signs = np.where((scale < 0)[:, None], ~signs & 127, signs)  # only with negative importance
        scale = np.abs(scale)
        index = np.where(zero[:, None], 0, grid.index[grid.pack(L.reshape(blocks, -1, 4))]).astype(np.uint8)
        signs[zero] = 0
        scales = scale.reshape(rows, supers, -1)
        max_scale = scales.max(axis=2)
        d = max_scale / F32(31)
        inv = np.divide(F32(1), d, out=np.zeros_like(d), where=max_scale > 0)
        l = np.clip(nearest_int(F32(0.5) * (inv[..., None] * scales - F32(1))), 0, 15).astype(np.uint32)
        s4 = signs.astype(np.uint32).reshape(rows, supers, -1, 4)
        words = s4[..., 0] | s4[..., 1] << 7 | s4[..., 2] << 14 | s4[..., 3] << 21 | l << 28
        empty = max_scale == 0  # ggml clears the whole super-block
        words[empty] = 0
        qs = index.reshape(rows, supers, -1)
        qs[empty] = 0
        stored_d = np.where(empty, ZERO, d * F32(1.0125))
        return np.concatenate([f16_bytes(stored_d), qs, words.astype("<u4").view(np.uint8).reshape(rows, supers, -1)], axis=2)


_EPS_IQ3_XXS = F32(1e-8)  # ggml's GROUP_MAX_EPS_IQ3_XXS: a block whose largest magnitude is below is zero


def _search(grid: lattice.Lattice, xval: np.ndarray, w: np.ndarray, steps: range, zero: np.ndarray,
            start_on_grid: bool, redo_blocks: bool) -> tuple[np.ndarray, np.ndarray]:
    """ggml's search over blocks ``[blocks, 32]`` of magnitudes ``xval`` with weights ``w``: each
    block's signed scale (0 for the ``zero`` blocks) and levels (int64, on the grid).

    After the tries, the groups the best try left off the grid are rounded again at the best scale
    (``redo_blocks``: IQ3_S rounds every group of such a block again; IQ3_XXS only those groups,
    and counts a block no try improved as on the grid, ``start_on_grid``).
    """
    blocks = len(xval)
    groups = (blocks, BLOCK // 4, 4)
    xval4, waux4 = xval.reshape(groups), np.sqrt(w).reshape(groups)
    wx_e, w_e = np.ascontiguousarray((w * xval).T), np.ascontiguousarray(w.T)  # element-major sums
    mx = np.where(zero, F32(1), xval.max(axis=1))

    def sums(L: np.ndarray, sel: slice | np.ndarray = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        q = (F32(2) * L + F32(1)).T
        return seqsum(wx_e[:, sel] * q), seqsum(w_e[:, sel] * q * q)

    scale = mx / F32(15)
    best = np.zeros(blocks, dtype=F32)
    L = np.zeros((blocks, BLOCK), dtype=F32)
    on_grid = np.full(groups[:2], start_on_grid)
    for step in steps:
        iscale = (F32(15) + F32(step) * F32(0.2)) / mx
        levels = _round_levels(iscale[:, None, None], xval4, 7)
        index, on_try = grid_levels(grid, levels, xval4, waux4, np.broadcast_to((F32(1) / iscale)[:, None], groups[:2]))
        L_try = grid.points[index].reshape(blocks, BLOCK).astype(F32)
        sumqx, sumq2 = sums(L_try)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = np.where(better, sumqx / sumq2, scale)
        best = np.where(better, scale * sumqx, best)
        L[better], on_grid[better] = L_try[better], on_try[better]
    redo = ~on_grid & (scale > 0)[:, None]
    if redo_blocks:
        redo = np.broadcast_to(redo.any(axis=1, keepdims=True), redo.shape)
    again = np.flatnonzero(redo.any(axis=1))
    if again.size:
        g = np.nonzero(redo)  # (block, group) of every group rounded again
        sub = scale[g[0]]
        levels = _round_levels((F32(1) / sub)[:, None], xval4[g], 7)
        index, _ = grid_levels(grid, levels, xval4[g], waux4[g], sub)
        L4 = L.reshape(groups)
        L4[g] = grid.points[index]
        sumqx, sumq2 = sums(L[again], again)
        scale[again] = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, F32(1)), scale[again])
    scale[zero] = 0
    return scale, L.astype(np.int64)


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
