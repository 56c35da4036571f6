"""IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS and IQ2_S: llama.cpp's lattice types, byte for byte as its
``quantize_iq3_s``, ``quantize_iq3_xxs`` and ``quantize_iq2_*`` write them.

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

IQ2_XXS (2.06 bits) and IQ2_XS (2.31 bits) are the same search on 8-value groups of levels 0..2
(256 and 512 grid points, 2 distances of neighbours), with sigma2 = Σx²/256, the parity signs of
IQ3_XXS, and ``Search`` constants of their own; IQ2_XXS starts from ``make_qp_quants``' scale, IQ2_XS
works on blocks of 16. ggml asserts an importance matrix for both, so their encoders refuse to run
without one. IQ2_S (2.56 bits) is IQ2_XS's search on a 1024-point grid (neighbours at the nearest
distance only) with 8 plain sign bits, sigma2 = 2·Σx²/256, weights ``sigma2/4 + x²`` without an
importance matrix, and ``d`` stored as ``d·0.9875``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType

from core import native
from core.native import pointer
from quant.ggml import lattice
from quant.ggml.numerics import F32, ZERO, f16_bytes, nearest_int, seqsum
from quant.ggml.rows import encode_by_rows
from quant.ggml.search import qp_quants
from quant.ggml.types import PortedType

QK_K = 256
BLOCK = 32  # values per block with one scale
_CHUNK_ELEMENTS = 1 << 16  # the neighbour search holds [groups, neighbours, 4] float32 arrays


def best_neighbours(grid: lattice.Lattice, codes: np.ndarray, xval: np.ndarray, w: np.ndarray,
                    scale: np.ndarray, level_values: np.ndarray | None = None) -> np.ndarray:
    """ggml's ``iq3_find_best_neighbour`` for off-grid groups: among the neighbours of each packed
    code ``[M]``, the grid index of least ``Σ w·(scale·q − x)²`` (summed in order, q = 2·level + 1,
    the first of equal errors), for magnitudes and weights ``[M, n]`` and ``scale [M]``.
    ``level_values [M, levels]``, if given, are each group's values of a level in place of
    2·level + 1 (IQ1_S's shifted −1, 0, 1: ``iq1_find_best_neighbour2``).

    By the C kernel (lattice_search.c) where it builds, which runs each group's short list of
    neighbours without numpy's padding and bucketing; else by ``_numpy_best_neighbours``. The two
    give the same indices (tests/test_iquants.py).
    """
    lib = _kernel()
    if lib is None:
        return _numpy_best_neighbours(grid, codes, xval, w, scale, level_values)
    m, n = xval.shape
    if level_values is None:
        values, stride = np.arange(1, 2 * (1 << grid.bits), 2, dtype=F32), 0  # 2·level + 1
    else:
        values, stride = np.ascontiguousarray(level_values, dtype=F32), level_values.shape[1]
    rows = np.ascontiguousarray(grid.row[codes], dtype=np.int32)
    xval, w = np.ascontiguousarray(xval, dtype=F32), np.ascontiguousarray(w, dtype=F32)
    scale = np.ascontiguousarray(np.broadcast_to(scale, (m,)), dtype=F32)
    out = np.empty(m, dtype=np.int32)
    lib.lattice_best_neighbours(m, n, pointer(rows), pointer(grid.neighbours), grid.neighbours.shape[1],
                                pointer(grid.counts), pointer(grid.points), pointer(values), stride, pointer(xval),
                                pointer(w), pointer(scale), pointer(out))
    return out


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load(Path(__file__).with_name("lattice_search.c"), ("-ffp-contract=off",))
    if lib is not None:
        lib.lattice_best_neighbours.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_int64, *[ctypes.c_void_p] * 3, ctypes.c_int64,
                                                *[ctypes.c_void_p] * 4]
        lib.lattice_best_neighbours.restype = None
    return lib


def _numpy_best_neighbours(grid: lattice.Lattice, codes: np.ndarray, xval: np.ndarray, w: np.ndarray,
                           scale: np.ndarray, level_values: np.ndarray | None = None) -> np.ndarray:
    """``best_neighbours`` by numpy, where no C compiler builds the kernel.

    Most codes have a handful of neighbours and a few have dozens, so codes are searched in
    buckets of similar counts, each as wide as its longest list rather than the longest of all.
    """
    out = np.empty(len(codes), dtype=np.int32)
    rows = grid.row[codes]
    counts = grid.counts[rows]
    by_count = np.argsort(counts, kind="stable")
    edges = np.searchsorted(counts[by_count], [high for _, high in _BUCKETS], side="right")
    for (low, high), start, stop in zip(_BUCKETS, [0, *edges[:-1]], edges):
        sel = by_count[start:stop]
        if sel.size == 0:
            continue
        width = min(high, grid.neighbours.shape[1])
        c = rows[sel]
        cand = grid.neighbours[c, :width]  # [m, width], −1 padded
        if level_values is None:
            q = grid.neighbour_values[c, :, :width]  # [m, n, width]
        else:
            levels = grid.points[np.maximum(cand, 0)].astype(np.intp)  # [m, width, n]
            q = np.take_along_axis(level_values[sel][:, None, :], levels, axis=2).transpose(0, 2, 1)
        s, xs, ws = scale[sel, None], xval[sel], w[sel]
        d2 = np.zeros(cand.shape, dtype=F32)
        diff, term = np.empty_like(d2), np.empty_like(d2)
        for i in range(q.shape[1]):  # d2 += (w·diff)·diff with diff = s·q − x, into reused buffers
            np.multiply(s, q[:, i], out=diff)
            np.subtract(diff, xs[:, i : i + 1], out=diff)
            np.multiply(ws[:, i : i + 1], diff, out=term)
            np.multiply(term, diff, out=term)
            np.add(d2, term, out=d2)
        d2[(cand < 0) | np.isnan(d2)] = np.inf  # padding, and what ggml's ``d2 < best`` never takes
        out[sel] = np.take_along_axis(cand, np.argmin(d2, axis=1)[:, None], axis=1)[:, 0]
    return out


_BUCKETS = ((0, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, 1 << 30))  # (fewer than, at most) neighbours


def grid_levels(grid: lattice.Lattice, levels: np.ndarray, xval: np.ndarray, w: np.ndarray,
                scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of rounded levels ``[..., n]`` moved onto the grid: (grid index, on the grid as
    rounded), with ``xval``, ``w`` like ``levels`` and one ``scale`` per group (``[...]``)."""
    codes = grid.pack(levels)
    index = grid.index[codes]
    on_grid = index >= 0
    off = np.flatnonzero(~on_grid)
    if off.size:
        n = levels.shape[-1]
        index.reshape(-1)[off] = best_neighbours(grid, codes.reshape(-1)[off], xval.reshape(-1, n)[off],
                                                 w.reshape(-1, n)[off], scale.reshape(-1)[off])
    return index, on_grid


def _round_levels(iscale: np.ndarray, xval: np.ndarray, top: int) -> np.ndarray:
    """``MAX(0, MIN(top, nearest_int(0.5·(iscale·x − 1))))`` with iscale broadcast over x."""
    return np.clip(nearest_int(F32(0.5) * (iscale * xval - F32(1))), 0, top).astype(np.int64)


@dataclass(frozen=True)
class Search:
    """How a lattice type searches a block (the constants of its ``quantize_row_*_impl``)."""

    steps: range  # the tries' ``is``: inverse scales (center + delta·is)/max
    delta: float
    center: int  # 2·kMaxQ − 1
    top: int  # the largest level, kMaxQ − 1
    eps: float  # a block whose largest magnitude is below this is zero
    start_on_grid: bool  # a block no try improved counts as on the grid (IQ3_XXS, IQ2_XS)
    redo: str  # after the tries, round again: "groups" off the grid, their whole "blocks", or "always" every block


class _LatticeType(PortedType):
    """A lattice type: blocks of ``block`` values searched on a grid (``_search``), then packed with
    their signs by ``pack``; ``sigma2_factor`` is the 2 of IQ3's ``sigma2 = 2·Σx²/256`` (IQ2: 1)."""

    lattice: ClassVar[Callable[[], lattice.Lattice]]
    search: ClassVar[Search]
    block: ClassVar[int] = 32
    sigma2_factor: ClassVar[int] = 2
    needs_imatrix: ClassVar[bool] = False  # ggml asserts it has one

    @classmethod
    def encode_rows(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        if qw is None and cls.needs_imatrix:
            raise ValueError(f"{cls.name} needs an importance matrix (llama.cpp's quantizer asserts one)")
        n = x.shape[1]
        qw_b = None if qw is None else qw.reshape(-1, cls.block)  # [blocks per row, block]
        return encode_by_rows(x, n // QK_K * cls.type_size, _CHUNK_ELEMENTS, lambda chunk: cls.encode_chunk(chunk, qw_b))

    @classmethod
    def encode_chunk(cls, x: np.ndarray, qw_b: np.ndarray | None) -> np.ndarray:
        rows, n = x.shape
        xb = x.reshape(rows, -1, cls.block)  # [rows, blocks, block]
        per_super = np.ascontiguousarray(x.reshape(rows, -1, QK_K).transpose(2, 0, 1))
        sigma2 = F32(cls.sigma2_factor) * seqsum(per_super * per_super) / F32(QK_K)  # [rows, super-blocks]
        sigma2 = np.repeat(sigma2, QK_K // cls.block, axis=1)[..., None]
        w = cls.plain_weights(xb, sigma2) if qw_b is None else qw_b * np.sqrt(sigma2 + xb * xb)
        blocks = rows * (n // cls.block)
        return cls.pack(rows, n // QK_K, cls.lattice(), xb.reshape(blocks, cls.block), w.reshape(blocks, cls.block))

    @staticmethod
    def plain_weights(xb: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
        """The search weights without an importance matrix."""
        return xb * xb

    @classmethod
    def fit(cls, grid: lattice.Lattice, xval: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, ...]:
        """(scale ≥ 0, grid index per group, the blocks whose scale ggml flipped, the zero blocks
        ggml skips) from the search started at ``max/center`` over the largest magnitude."""
        mx = xval.max(axis=1)
        zero = mx < F32(cls.search.eps) if cls.search.eps else mx == 0
        return _finish(grid, *_search(grid, xval, w, cls.search, mx, mx / F32(cls.search.center), zero), zero)


class _ParitySigns(_LatticeType):
    """A lattice type storing 7 sign bits per group of 8 (IQ3_XXS and the IQ2 types)."""

    @classmethod
    def parity_fit(cls, rows: int, supers: int, grid: lattice.Lattice, xb: np.ndarray,
                   w: np.ndarray) -> tuple[np.ndarray, ...]:
        """Grid indices per group and 7-bit signs per 8 (uint32, 0 in the blocks ggml skips), and
        the super-blocks' d, 4-bit block scales and emptiness (``_super_scales``)."""
        xval, signs = _parity_signs(xb, w)
        scale, index, flip, zero = cls.fit(grid, xval, w)
        signs = np.where(flip[:, None], ~signs & 127, signs)  # a negative scale flips every sign
        index = np.where(zero[:, None], 0, index).astype(np.uint32)
        signs = np.where(zero[:, None], 0, signs).astype(np.uint32)
        return index, signs, *_super_scales(scale, rows, supers)


def _finish(grid: lattice.Lattice, scale: np.ndarray, L: np.ndarray, zero: np.ndarray) -> tuple[np.ndarray, ...]:
    n = grid.points.shape[1]
    index = np.where(zero[:, None], 0, grid.index[grid.pack(L.reshape(len(L), -1, n))])
    return np.abs(scale), index, scale < 0, zero  # a negative scale (only with negative importance) flips the signs


def _parity_signs(xb: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Magnitudes and 7-bit sign bytes per group of 8, the 8th sign implied by even parity.

    A group with an odd number of negatives flips the sign of its element of least ``w·x²`` (the
    first such), whose magnitude the search then sees negated, as ggml does.
    """
    blocks, size = xb.shape
    negative = ~(xb >= 0).reshape(blocks, -1, 8)
    xval = np.abs(xb).reshape(blocks, -1, 8)
    odd = negative.sum(axis=2) % 2 == 1
    flipped = (np.arange(8) == np.argmin((w * xb * xb).reshape(blocks, -1, 8), axis=2)[..., None]) & odd[..., None]
    signs = np.packbits(negative ^ flipped, axis=2, bitorder="little")[..., 0] & 127
    return np.where(flipped, -xval, xval).reshape(blocks, size), signs


def _super_scales(scale: np.ndarray, rows: int, supers: int, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``d = max scale/31`` per super-block, each block's ``nearest_int(0.5·(scale/d − 1))`` in
    0..15, and which super-blocks are empty (max scale 0: ggml clears them)."""
    scales = scale.reshape(rows, supers, -1)
    max_scale = scales.max(axis=2)
    d = max_scale / F32(31)
    inv = np.divide(F32(1), d, out=np.zeros_like(d), where=max_scale > 0)
    l = np.clip(nearest_int(F32(0.5) * (inv[..., None] * scales - F32(1))), 0, (1 << bits) - 1).astype(np.uint32)
    return d, l, max_scale == 0


_IQ3 = dict(center=15, top=7, delta=0.2)


class IQ3_S(_LatticeType, qtype=GGMLQuantizationType.IQ3_S):
    """d (fp16), the low 8 bits of 64 grid indices, their 9th bits (8 bytes), 32 bytes of signs, and
    eight 4-bit block scales."""

    lattice = staticmethod(lattice.iq3_s)
    search = Search(range(-9, 10), eps=0.0, start_on_grid=False, redo="blocks", **_IQ3)

    @classmethod
    def pack(cls, rows: int, supers: int, grid: lattice.Lattice, xb: np.ndarray, w: np.ndarray) -> np.ndarray:
        positive = xb >= 0
        xval = np.where(positive, xb, -xb)
        scale, index, flip, _ = cls.fit(grid, xval, w)
        signs = np.packbits(~positive.reshape(len(xb), -1, 8), axis=2, bitorder="little")[..., 0]  # [blocks, 4]
        signs = np.where(flip[:, None], ~signs, signs)
        return _pack(rows, supers, scale, index, signs, xval.max(axis=1) != 0)


class IQ3_XXS(_ParitySigns, qtype=GGMLQuantizationType.IQ3_XXS):
    """d (fp16), 64 grid indices of the 256-point grid, then per block a uint32 of four 7-bit sign
    groups and the 4-bit block scale (bits 28..31)."""

    lattice = staticmethod(lattice.iq3_xxs)
    search = Search(range(-15, 16), eps=1e-8, start_on_grid=True, redo="groups", **_IQ3)  # GROUP_MAX_EPS_IQ3_XXS

    @classmethod
    def pack(cls, rows: int, supers: int, grid: lattice.Lattice, xb: np.ndarray, w: np.ndarray) -> np.ndarray:
        index, signs, d, l, empty = cls.parity_fit(rows, supers, grid, xb, w)
        s4 = signs.reshape(rows, supers, -1, 4)
        words = s4[..., 0] | s4[..., 1] << 7 | s4[..., 2] << 14 | s4[..., 3] << 21 | l << 28
        qs = index.astype(np.uint8).reshape(rows, supers, -1)
        words[empty], qs[empty] = 0, 0
        stored_d = np.where(empty, ZERO, d * F32(1.0125))
        return np.concatenate([f16_bytes(stored_d), qs, words.astype("<u4").view(np.uint8).reshape(rows, supers, -1)], axis=2)


_IQ2 = dict(center=5, top=2, delta=0.1, eps=1e-15)


class IQ2_XXS(_ParitySigns, qtype=GGMLQuantizationType.IQ2_XXS):
    """d (fp16), then per block of 32 two uint32: four 8-bit grid indices (256 points of 8), and four
    7-bit sign groups with the 4-bit block scale. Only with an importance matrix."""

    lattice = staticmethod(lattice.iq2_xxs)
    search = Search(range(-6, 7), start_on_grid=False, redo="always", **_IQ2)
    sigma2_factor, needs_imatrix = 1, True

    @classmethod
    def fit(cls, grid: lattice.Lattice, xval: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, ...]:
        """Started at ``make_qp_quants``' scale (levels 0..3) rather than max/5, with the tries
        over ``3·that scale``; a block whose largest magnitude or that is 0 is zero."""
        mx = xval.max(axis=1)
        qp, _ = qp_quants(np.ascontiguousarray(xval.T), np.ascontiguousarray(w.T), cls.search.top + 2)
        eff_max = qp * F32(cls.search.top + 1)
        zero = (mx < F32(cls.search.eps)) | (eff_max <= 0)
        return _finish(grid, *_search(grid, xval, w, cls.search, eff_max, qp, zero), zero)

    @classmethod
    def pack(cls, rows: int, supers: int, grid: lattice.Lattice, xb: np.ndarray, w: np.ndarray) -> np.ndarray:
        index, signs, d, l, empty = cls.parity_fit(rows, supers, grid, xb, w)
        g, s4 = index.reshape(rows, supers, -1, 4), signs.reshape(rows, supers, -1, 4)
        words = np.stack([g[..., 0] | g[..., 1] << 8 | g[..., 2] << 16 | g[..., 3] << 24,
                          s4[..., 0] | s4[..., 1] << 7 | s4[..., 2] << 14 | s4[..., 3] << 21 | l << 28], axis=-1)
        words[empty] = 0
        stored_d = np.where(empty, ZERO, d)
        return np.concatenate([f16_bytes(stored_d), words.astype("<u4").view(np.uint8).reshape(rows, supers, -1)], axis=2)


class IQ2_XS(_ParitySigns, qtype=GGMLQuantizationType.IQ2_XS):
    """d (fp16), then per group of 8 a uint16 of its 9-bit grid index (512 points) and 7 sign bits,
    then a 4-bit scale per block of 16. Only with an importance matrix."""

    lattice = staticmethod(lattice.iq2_xs)
    search = Search(range(-9, 10), start_on_grid=True, redo="groups", **_IQ2)
    block, sigma2_factor, needs_imatrix = 16, 1, True

    @classmethod
    def pack(cls, rows: int, supers: int, grid: lattice.Lattice, xb: np.ndarray, w: np.ndarray) -> np.ndarray:
        index, signs, d, l, empty = cls.parity_fit(rows, supers, grid, xb, w)
        q = (index | signs << 9).reshape(rows, supers, -1)
        q[empty] = 0
        l[empty] = 0
        stored_d = np.where(empty, ZERO, d)
        return np.concatenate([f16_bytes(stored_d), q.astype("<u2").view(np.uint8).reshape(rows, supers, -1),
                               (l[..., 0::2] | l[..., 1::2] << 4).astype(np.uint8)], axis=2)


class IQ2_S(_LatticeType, qtype=GGMLQuantizationType.IQ2_S):
    """d (fp16), the low 8 bits of 32 grid indices (1024 points of 8), 32 sign bytes, the indices'
    top 2 bits (8 bytes), and a 4-bit scale per block of 16."""

    lattice = staticmethod(lattice.iq2_s)
    search = Search(range(-9, 10), start_on_grid=True, redo="groups", **{**_IQ2, "eps": 1e-8})  # GROUP_MAX_EPS_IQ2_S
    block = 16

    @staticmethod
    def plain_weights(xb: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
        """``sigma2/4 + x²`` (sigma2 = 2·Σx²/256): some weight on the small values too."""
        return F32(0.25) * sigma2 + xb * xb

    @classmethod
    def pack(cls, rows: int, supers: int, grid: lattice.Lattice, xb: np.ndarray, w: np.ndarray) -> np.ndarray:
        """A zero block is left zero; an empty super-block (max scale 0) keeps its codes and signs,
        with d and the scales 0, as ggml leaves it."""
        positive = xb >= 0
        scale, index, flip, zero = cls.fit(grid, np.where(positive, xb, -xb), w)
        signs = np.packbits(~positive.reshape(len(xb), -1, 8), axis=2, bitorder="little")[..., 0]  # [blocks, 2]
        signs = np.where(flip[:, None], ~signs, signs)
        index = np.where(zero[:, None], 0, index).reshape(rows, supers, -1)  # [rows, supers, 32 groups]
        signs = np.where(zero[:, None], 0, signs).astype(np.uint8).reshape(rows, supers, -1)
        d, l, empty = _super_scales(scale, rows, supers)
        l[empty] = 0
        top = (index >> 8).reshape(rows, supers, -1, 4) << (2 * np.arange(4))
        qh = np.bitwise_or.reduce(top, axis=3).astype(np.uint8)
        stored_d = np.where(empty, ZERO, d * F32(0.9875))
        return np.concatenate([f16_bytes(stored_d), (index & 255).astype(np.uint8), signs, qh,
                               (l[..., 0::2] | l[..., 1::2] << 4).astype(np.uint8)], axis=2)


def _search(grid: lattice.Lattice, xval: np.ndarray, w: np.ndarray, search: Search, top_value: np.ndarray,
            scale0: np.ndarray, zero: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's search over blocks ``[blocks, size]`` of magnitudes ``xval`` with weights ``w``: each
    block's signed scale (0 for the ``zero`` blocks) and levels (int64, on the grid).

    Try t scales the block by ``(center + delta·t)/top_value`` and rounds each group's levels,
    moving off-grid groups to their best neighbour; the least-squares scale of the best try is
    kept. Then groups are rounded again at that scale, as ``search.redo`` says (see ``Search``).
    """
    blocks, size = xval.shape
    n = grid.points.shape[1]
    groups = (blocks, size // n, n)
    xval_g, waux_g = xval.reshape(groups), np.sqrt(w).reshape(groups)
    wx_e, w_e = np.ascontiguousarray((w * xval).T), np.ascontiguousarray(w.T)  # element-major sums
    top_value = np.where(zero, F32(1), top_value)

    def sums(L: np.ndarray, sel: slice | np.ndarray = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        q = (F32(2) * L + F32(1)).T
        return seqsum(wx_e[:, sel] * q), seqsum(w_e[:, sel] * q * q)

    scale = np.where(zero, F32(1), scale0)
    best = np.zeros(blocks, dtype=F32)
    L = np.zeros((blocks, size), dtype=F32)
    on_grid = np.full(groups[:2], search.start_on_grid)
    for step in search.steps:
        iscale = (F32(search.center) + F32(step) * F32(search.delta)) / top_value
        levels = _round_levels(iscale[:, None, None], xval_g, search.top)
        index, on_try = grid_levels(grid, levels, xval_g, waux_g, np.broadcast_to((F32(1) / iscale)[:, None], groups[:2]))
        L_try = grid.points[index].reshape(blocks, size).astype(F32)
        sumqx, sumq2 = sums(L_try)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = np.where(better, sumqx / sumq2, scale)
        best = np.where(better, scale * sumqx, best)
        L[better], on_grid[better] = L_try[better], on_try[better]
    redo = {"groups": ~on_grid, "blocks": ~on_grid.all(axis=1, keepdims=True),
            "always": np.ones((blocks, 1), dtype=bool)}[search.redo]
    redo = np.broadcast_to(redo & ((scale > 0) & ~zero)[:, None], groups[:2])
    again = np.flatnonzero(redo.any(axis=1))
    if again.size:
        g = np.nonzero(redo)  # (block, group) of every group rounded again
        sub = scale[g[0]]
        levels = _round_levels((F32(1) / sub)[:, None], xval_g[g], search.top)
        index, _ = grid_levels(grid, levels, xval_g[g], waux_g[g], sub)
        L.reshape(groups)[g] = grid.points[index]
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
