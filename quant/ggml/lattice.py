"""The lattice grids of llama.cpp's IQ2/IQ3 types and their neighbour tables, built once per grid.

Why: an i-quant stores each group of 4 (IQ3) or 8 (IQ2) magnitudes as the index of one point of a
fixed grid (512 points of {1, 3, ..., 15}^4 for IQ3_S). A group rounded level by level usually
lands off the grid; llama.cpp then picks, among the grid points nearest to that rounded point
(``iq3xs_init_impl``, ``iq2xs_init_impl``), the one of least weighted error. Which points are
"nearest" is part of the byte format: the grid points at the ``nwant`` smallest squared distances,
in the order of qsort on (distance, grid index), a total order, so any stable sort gives it.

The grid points themselves come from gguf-py's decoder tables (``gguf.quants``), which hold the
same grids llama.cpp dequantizes with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import _type_traits  # noqa: PLC2701  (gguf-py's registry of its quant classes)


@dataclass(frozen=True)
class Lattice:
    """A grid of ``points [G, n]`` (levels 0..levels−1 per coordinate) with its lookup tables.

    ``index[u]`` is the grid index of the point whose levels, ``bits`` per coordinate, pack to u
    (coordinate i at bit ``bits·i``), or −1 off the grid. Off-grid codes that rounding can produce
    (every level below ``levels``) have a row ``row[u]`` of the neighbour tables: ``neighbours`` (the
    grid indices llama.cpp tries, −1 padded), ``neighbour_values`` (their values 2·level + 1 as
    float32, coordinate-major ``[rows, n, width]``, so a search gathers one contiguous row per code)
    and ``counts``.
    """

    points: np.ndarray  # int8 [G, n]
    index: np.ndarray  # int32 [2**(bits·n)]
    row: np.ndarray  # int32 [2**(bits·n)]: the code's row of the neighbour tables, −1 if none
    neighbours: np.ndarray  # int32 [rows, width]
    neighbour_values: np.ndarray  # float32 [rows, n, width]
    counts: np.ndarray  # int32 [rows]
    bits: int

    def pack(self, levels: np.ndarray) -> np.ndarray:
        """``levels [..., n]`` (integers) -> the packed code u ``[...]`` (int64)."""
        code = levels[..., 0].astype(np.int64)
        for i in range(1, levels.shape[-1]):  # coordinate by coordinate: a sum over a short last axis is slow in numpy
            code |= levels[..., i].astype(np.int64) << (self.bits * i)
        return code


def _lattice(points: np.ndarray, levels: int, bits: int, nwant: int) -> Lattice:
    """The tables of a grid: the points at the ``nwant`` smallest squared distances from each
    reachable off-grid code, by (distance, grid index), as llama.cpp's qsort orders them."""
    n = points.shape[1]
    shifts = bits * np.arange(n)
    index = np.full(1 << (bits * n), -1, dtype=np.int32)
    index[(points.astype(np.int64) << shifts).sum(axis=1)] = np.arange(len(points), dtype=np.int32)
    codes = np.arange(len(index))
    coords = (codes[:, None] >> shifts) & ((1 << bits) - 1)
    off = np.flatnonzero((index < 0) & (coords < levels).all(axis=1))
    d2 = np.zeros((len(off), len(points)), dtype=np.int32)
    for i in range(n):  # coordinate by coordinate, to keep the work arrays small
        d2 += (coords[off, i : i + 1].astype(np.int32) - points[None, :, i].astype(np.int32)) ** 2
    order = np.argsort(d2, axis=1, kind="stable")  # ties by grid index, as llama.cpp's compare
    sorted_d2 = np.take_along_axis(d2, order, axis=1)
    # the rank of each distance among the distinct distances of its row; kept entries are a prefix
    rank = np.cumsum(np.diff(sorted_d2, axis=1, prepend=sorted_d2[:, :1]) > 0, axis=1)
    keep = rank < nwant
    width = int(keep.sum(axis=1).max())
    neighbours = np.where(keep, order, -1)[:, :width].astype(np.int32)
    values = np.where(neighbours[..., None] >= 0, 2 * points[np.maximum(neighbours, 0)] + 1, 0).astype(np.float32)
    row = np.full(len(index), -1, dtype=np.int32)
    row[off] = np.arange(len(off), dtype=np.int32)
    return Lattice(points.astype(np.int8), index, row, np.ascontiguousarray(neighbours),
                   np.ascontiguousarray(values.transpose(0, 2, 1)), keep.sum(axis=1).astype(np.int32), bits)


def _gguf_levels(qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf-py's grid of a type as levels, ``[G, n]``: each value's place among the type's values
    (IQ3_S: 1, 3, ..., 15 are levels 0..7; the IQ2 types' 8, 25, 43 are 0..2)."""
    cls = _type_traits[qtype]
    cls.init_grid()
    values = np.asarray(cls.grid).reshape(cls.grid_shape)
    return np.searchsorted(np.asarray(cls.grid_map, dtype=np.float32), values).astype(np.int64)


@functools.cache
def iq3_s() -> Lattice:
    """IQ3_S's 512 points of 4 odd values 1..15 (levels (v − 1)/2, 3 bits each), 3 distances."""
    return _lattice(_gguf_levels(GGMLQuantizationType.IQ3_S), 8, 3, nwant=3)


@functools.cache
def iq3_xxs() -> Lattice:
    """IQ3_XXS's 256 points of 4 coordinates of 8 levels, 2 distances."""
    return _lattice(_gguf_levels(GGMLQuantizationType.IQ3_XXS), 8, 3, nwant=2)


@functools.cache
def iq2_xxs() -> Lattice:
    """IQ2_XXS's 256 points of 8 coordinates of 3 levels (2 bits each), 2 distances."""
    return _lattice(_gguf_levels(GGMLQuantizationType.IQ2_XXS), 3, 2, nwant=2)


@functools.cache
def iq2_xs() -> Lattice:
    """IQ2_XS's 512 points of 8 coordinates of 3 levels, 2 distances."""
    return _lattice(_gguf_levels(GGMLQuantizationType.IQ2_XS), 3, 2, nwant=2)


@functools.cache
def iq2_s() -> Lattice:
    """IQ2_S's 1024 points of 8 coordinates of 3 levels; only the nearest distance's points."""
    return _lattice(_gguf_levels(GGMLQuantizationType.IQ2_S), 3, 2, nwant=1)


@functools.cache
def iq1_s() -> Lattice:
    """IQ1_S's (and IQ1_M's) 2048 points of 8 coordinates of 3 levels (−1, 0, 1), 3 distances."""
    return _lattice(_gguf_levels(GGMLQuantizationType.IQ1_S), 3, 2, nwant=3)
