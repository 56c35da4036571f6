"""llama.cpp's importance-matrix encoders for the legacy 32-element types Q4_0, Q4_1, Q5_0, Q5_1.

Why this exists: K-quant files fall back to these types for tensors whose rows are not a multiple
of 256 (hidden size 576, 896, ...), and with an importance matrix ggml does not use the simple
"absmax / 8" reference encoders that ``gguf.quants.quantize`` reproduces: ``quantize_q4_0`` and
friends then run ``quantize_row_q*_impl``, a weighted search per block. A file is only byte-exact
with `llama-quantize` if these tensors are too, so this module ports that path bit for bit.

How it stays exact (docs: gguf-kquants.md §1): every intermediate is float32 (constants are wrapped
in ``np.float32``), each sum ggml accumulates in a loop is accumulated element by element in the
same order, rounding is ggml's round-half-to-even ``nearest_int`` (``np.rint`` where that is
provably the same), fp16 stores round to nearest even, and even the sign of a zero is kept where it
reaches a stored fp16 field.

The importance weights of element j of a row are ``qw[j]·sqrt(sigma2 + x[j]²)`` with
``sigma2 = Σx²/n_per_row`` over the whole row (``quantize_row_q4_0_impl``). Then:

- Q4_0 / Q5_0 (x ≈ d·(q − nmax)): ggml's symmetric search ``make_qx_quants`` with nmax 8 / 16;
- Q4_1 / Q5_1 (x ≈ d·q + m): ggml's affine search ``make_qkx3_quants`` with nmax 15 / 31,
  rmin −0.9, rdelta 0.05 and 37 candidate steps, squared error.

Work is vectorised across every block of a chunk of rows, element-major (``[32, rows, blocks]``),
so that the sequential sums over a block's 32 elements run over contiguous slices; Python loops
only over the element index and search steps. Rows are encoded in chunks to bound memory; blocks
are independent, so the bytes do not depend on the chunking.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from quant.ggml.numerics import F32, element_major, f16_bytes, importance
from quant.ggml.rows import encode_by_rows
from quant.ggml.search import affine_search, symmetric_search
from quant.ggml.types import PortedType

QK = 32  # elements per block
# Input values per chunk (1 MB per float32 work array): big enough that per-block bookkeeping is
# cheap next to the full-array passes, small enough that the work arrays stay near the CPU caches.
_CHUNK_ELEMENTS = 1 << 18


class _Legacy(PortedType):
    """A legacy 32-block type: gguf-py's reference encoder without an importance matrix (byte-exact
    there), ours with one. ``encode_blocks`` fits and packs element-major blocks ``[32, rows,
    blocks]`` given their search weights."""

    bits: ClassVar[int] = 4  # per quant; a 5th bit goes into a uint32 after the scales
    offset: ClassVar[bool] = False  # x ≈ d·q + m (affine search) rather than d·(q − 2^(bits−1))

    @classmethod
    def quantize(cls, rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """``[n, row bytes]`` of float32 ``rows [n, width]``, weighted by ``imatrix [width]`` if given."""
        if imatrix is None:
            return gguf_quantize(rows, cls.qtype)
        return super().quantize(rows, imatrix)

    @classmethod
    def encode_rows(cls, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
        """Encode chunks of rows; ``encode_blocks`` gets element-major data and weights."""
        qw_e = element_major(qw[None, :], QK)  # [32, 1, blocks]: the weights of every row's blocks

        def encode_chunk(chunk: np.ndarray) -> np.ndarray:
            xe = element_major(chunk, QK)
            return cls.encode_blocks(xe, _weights(chunk, xe, qw_e))

        return encode_by_rows(x, x.shape[1] // QK * cls.type_size, _CHUNK_ELEMENTS, encode_chunk)

    @classmethod
    def encode_blocks(cls, xe: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Fit element-major blocks ``[32, rows, blocks]`` with their search weights, then pack
        them (§2 block layouts): the fp16 fields, the 5th bits if any, the low nibbles."""
        levels = 1 << cls.bits
        if cls.offset:
            d, m, L = _affine(xe, w, levels - 1)
            fields = [f16_bytes(d), f16_bytes(m)]
        else:
            d, L = _symmetric(xe, w, levels // 2)
            fields = [f16_bytes(d)]
        if cls.bits == 5:
            fields.append(_high_bits(L))
        return np.concatenate([*fields, _nibbles(L)], axis=2)


def q4_0_from_levels(levels: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q4_0 bytes of a grid chosen elsewhere (quantization-aware training): ``levels [rows, n]``
    in 0..15 with one scale ``d [rows, n/32]`` per block, the value of each ``(q − 8)·d``, stored as
    they are rather than searched again."""
    rows, n = levels.shape
    blocks = element_major(levels.astype(np.uint8), QK)
    return np.concatenate([f16_bytes(np.asarray(d, dtype=F32)), _nibbles(blocks)], axis=2).reshape(rows, -1)


def _weights(rows: np.ndarray, xe: np.ndarray, qw_e: np.ndarray) -> np.ndarray:
    """Importance weights with ``sigma2 = Σx²/n_per_row`` over each whole row.

    ggml sums x² left to right along the row; ``np.cumsum`` accumulates sequentially in float32
    (unlike ``np.sum``, which is pairwise), so its last column is that sum.
    """
    n = rows.shape[1]
    sigma2 = np.cumsum(rows * rows, axis=1, dtype=F32)[:, -1] / F32(n)
    return importance(qw_e, xe, sigma2[None, :, None])


# ------------------------------------------------------------------------------------------------
# The types: what each stores


class Q4_0(_Legacy, qtype=GGMLQuantizationType.Q4_0):
    """x ≈ d·(q − 8): fp16 d, then nibbles (element j low, j + 16 high)."""


class Q5_0(_Legacy, qtype=GGMLQuantizationType.Q5_0):
    """x ≈ d·(q − 16): fp16 d, a uint32 of 5th bits, then the low nibbles."""

    bits = 5


class Q4_1(_Legacy, qtype=GGMLQuantizationType.Q4_1):
    """x ≈ d·q + m: fp16 d, fp16 m, then nibbles."""

    offset = True


class Q5_1(_Legacy, qtype=GGMLQuantizationType.Q5_1):
    """x ≈ d·q + m: fp16 d, fp16 m, a uint32 of 5th bits, then the low nibbles."""

    bits, offset = 5, True


def _nibbles(L: np.ndarray) -> np.ndarray:
    """Quants ``[32, rows, blocks]`` as 16 bytes per block: low 4 bits of j and j + 16."""
    q = L.transpose(1, 2, 0)
    return (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)


def _high_bits(L: np.ndarray) -> np.ndarray:
    """The 5th bit of element j as bit j of a little-endian uint32 (4 bytes per block)."""
    bits = ((L.transpose(1, 2, 0) >> 4) & 1).astype(np.uint32)
    qh = np.bitwise_or.reduce(bits << np.arange(QK, dtype=np.uint32), axis=2)
    return qh.astype("<u4").view(np.uint8).reshape(*qh.shape, 4)


def _symmetric(xe: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0's fit: ``make_qx_quants``, quants ``q = l + nmax`` as bytes."""
    d, L = symmetric_search(xe, w, nmax)
    return d, L.astype(np.uint8)


def _affine(xe: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1/Q5_1's fit: ``make_qkx3_quants`` (rmin −0.9, rdelta 0.05, 37 steps, squared error, no
    guard on the rounding: the llama.cpp we are checked against rounds every step plainly).

    Returns (d, m, quants as bytes): ggml stores ``m = −the_min``, the block's offset itself, so
    the sign of a zero offset is kept ggml's (``signed_zeros``).
    """
    d, off, L = affine_search(xe, w, nmax, -0.9, 0.05, 36, use_mad=False, guarded=False, signed_zeros=True)
    return d, -off, L.astype(np.uint8)
