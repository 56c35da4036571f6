"""llama.cpp's affine K-quant encoders (Q4_K, Q5_K, Q2_K) in numpy, byte for byte.

A GGUF file we write must hold exactly the bytes `llama-quantize` would write, so that our files can
be checked tensor for tensor against llama.cpp's and so that the model we evaluate is the model users
get. These types store x ≈ d·sc_j·q − dmin·m_j: every sub-block gets its own scale and offset from
ggml's weighted search, and those are quantized again against one fp16 pair per 256-element
super-block. The rules that make this exact (docs/gguf-kquants.md §1) are followed throughout: every
intermediate is float32 (constants are wrapped in ``np.float32``), each sum ggml computes left to
right is accumulated in that order, rounding is half-to-even (``np.rint``), and every store into a
C ``uint8_t`` wraps modulo 256 where ggml's does.

Work is vectorised across all sub-blocks of a chunk of super-blocks, laid out element-major
([element, sub-block]) so that a sequential sum over a sub-block is one ``np.add.reduce`` over the
outer axis; Python loops only over search steps. Nearly all the time goes into the weighted search,
whose cost is the number of numpy passes over the chunk per step plus a fixed cost per call, so the
search keeps both few (see ``quant.ggml.search.affine_search``). Blocks are independent: the bytes do not depend on
chunking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType

from quant.ggml.numerics import F32, ZERO, f16_bytes, fp16r, importance, nearest_int, seqsum
from quant.ggml.search import affine_search, qp_quants
from quant.ggml.types import PortedType

QK_K = 256
# Super-blocks per chunk (128K values, 512 KB per float32 work array). Smaller chunks keep the
# passes in L2 but pay the per-call cost of the per-group operations more often, and in the
# row-block workers of quant.ggml every numpy call has a fixed cost, which favours fewer, larger
# calls. Measured on 2 cores: 512 fastest single-threaded and as fast as 1024-2048 in two threads.
_CHUNK_BLOCKS = 512

Encoder = Callable[[np.ndarray, np.ndarray | None], np.ndarray]


class _AffineK(PortedType):
    """An affine K-quant: super-blocks of 256 values, encoded ``_CHUNK_BLOCKS`` at a time by
    ``encode_blocks`` (``[B, 256]`` values and their importance, or None, to ``[B, type_size]``)."""

    encode_blocks: ClassVar[Encoder]

    @classmethod
    def encode_rows(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """Split the rows into super-blocks and encode them chunk by chunk.

        ggml gives every super-block the importance weights of its own columns, so each chunk gets the
        matching slice of ``qw`` however the chunk boundaries fall across rows.
        """
        rows, n_per_row = x.shape
        per_row = n_per_row // QK_K
        blocks = x.reshape(-1, QK_K)
        qw_blocks = None if qw is None else qw.reshape(per_row, QK_K)
        out = np.empty((len(blocks), cls.type_size), dtype=np.uint8)
        # Division by zero, overflow and NaN happen in ggml too (flat groups, subnormal data, rejected
        # candidates); the encoders mask or reproduce their effect instead of avoiding them.
        with np.errstate(all="ignore"):
            for start in range(0, len(blocks), _CHUNK_BLOCKS):
                stop = min(start + _CHUNK_BLOCKS, len(blocks))
                qwb = None if qw_blocks is None else qw_blocks[np.arange(start, stop) % per_row]
                out[start:stop] = cls.encode_blocks(blocks[start:stop], qwb)
        return out.reshape(rows, per_row * cls.type_size)


def q4_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The grid Q4_K bytes store, per super-block of 256: ``d``, ``dmin`` [B] (float32, from fp16),
    the 6-bit scales and mins of its 8 sub-blocks ``sc``, ``m`` [B, 8] and the 4-bit levels ``q``
    [B, 256] (uint8), each value ``d·sc_j·q − dmin·m_j``."""
    b = raw.reshape(-1, 144)
    d = np.ascontiguousarray(b[:, 0:2]).view(np.float16).astype(F32).ravel()
    dmin = np.ascontiguousarray(b[:, 2:4]).view(np.float16).astype(F32).ravel()
    sc, m = _unpack_k4(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, QK_K)
    return d, dmin, np.ascontiguousarray(sc.T), np.ascontiguousarray(m.T), q


def q4_k_from_parts(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K bytes [B, 144] of a grid chosen elsewhere (quantization-aware training), as
    ``q4_k_parts`` reads it: fp16 ``d`` and ``dmin``, integer ``sc`` and ``m`` in 0..63 and levels
    in 0..15, stored as they are rather than searched again."""
    scales = _pack_k4(sc.T.astype(np.int64), m.T.astype(np.int64))
    pairs = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    return np.concatenate([f16_bytes(np.asarray(d, F32)), f16_bytes(np.asarray(dmin, F32)), scales,
                           qs.reshape(-1, 128)], axis=1)


class _K4(_AffineK):
    """Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins (``_encode_k4``); nibble pairs
    hold elements l and l + 32 of each 64, so two sub-blocks share 32 bytes, and Q5_K adds one
    byte of 5th bits per lane l of 32 before them."""

    nmax: ClassVar[int]
    ref_search: ClassVar[tuple[float, float, int]]  # rmin, rdelta, nstep of the reference path
    clamp_imatrix_scales: ClassVar[bool]

    @classmethod
    def encode_blocks(cls, xb: np.ndarray, qwb: np.ndarray | None) -> np.ndarray:
        """``[B, type_size]`` bytes of super-blocks ``xb [B, 256]`` and their importance (or None)."""
        d, dmin, scales, L = _encode_k4(xb, qwb, cls.nmax, cls.ref_search, cls.clamp_imatrix_scales)
        Lb = _block_order(L)
        low = (Lb & 15).reshape(-1, 4, 2, 32)
        qs = low[:, :, 0] | (low[:, :, 1] << 4)
        fields = [f16_bytes(d), f16_bytes(dmin), scales]
        if cls.nmax > 15:
            high = (Lb >> 4).reshape(-1, 8, 32)  # bit j of qh[l] is the 5th bit of element 32j + l
            qh = np.zeros((len(Lb), 32), dtype=np.uint8)
            for j in range(8):
                qh |= high[:, j] << j
            fields.append(qh)
        return np.concatenate([*fields, qs.reshape(-1, 128)], axis=1)


class Q4_K(_K4, qtype=GGMLQuantizationType.Q4_K):
    """x ≈ d·sc_j·q − dmin·m_j with 4-bit q; the importance path packs its scales unclamped."""

    nmax, ref_search, clamp_imatrix_scales = 15, (-1.0, 0.1, 20), False


class Q5_K(_K4, qtype=GGMLQuantizationType.Q5_K):
    """Q4_K with 5-bit q; the importance path clamps its scales to 63 again."""

    nmax, ref_search, clamp_imatrix_scales = 31, (-0.5, 0.1, 15), True


class Q2_K(_AffineK, qtype=GGMLQuantizationType.Q2_K):
    """Q2_K: 16 sub-blocks of 16, each with a 4-bit scale and min sharing a byte (a_j | b_j << 4)."""

    @staticmethod
    def encode_blocks(xb: np.ndarray, qwb: np.ndarray | None) -> np.ndarray:
        xs = _groups(xb, 16)
        if qwb is None:
            # Reference path: weights |x|, absolute-error search, sub-scales "max then /15".
            scale, off, L = affine_search(xs, np.abs(xs), 3, -0.5, 0.1, 15, use_mad=True, guarded=False)
            a, d = _max_quantize(scale, 15)
            b, dmin = _max_quantize(off, 15)
            byte = a | ((b << 4) & 0xFF)
        else:
            d, dmin, Ls, Lm, L = _imatrix_scales(xs, _groups(qwb, 16), F32(1.0), 3, 15)
            byte = (Ls | (Lm << 4)) & 0xFF
        d, dmin = fp16r(d), fp16r(dmin)
        L = _requantize(xs, L, d * (byte & 15).astype(F32), dmin * (byte >> 4).astype(F32), 3)
        Lb = _block_order(L).reshape(-1, 2, 4, 32)
        qs = Lb[:, :, 0] | (Lb[:, :, 1] << 2) | (Lb[:, :, 2] << 4) | (Lb[:, :, 3] << 6)
        return np.concatenate(
            [byte.T.astype(np.uint8), qs.reshape(-1, 64), f16_bytes(d), f16_bytes(dmin)], axis=1
        )


def _encode_k4(
    xb: np.ndarray,
    qwb: np.ndarray | None,
    nmax: int,
    ref_search: tuple[float, float, int],
    clamp_imatrix_scales: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What Q4_K and Q5_K share: 8 sub-blocks of 32, 6-bit scales and mins in the k4 packing.

    Returns fp16-rounded ``d``, ``dmin`` [B], the 12 packed scale bytes [B, 12] and the quants
    [32, 8, B]. The requantization reads the scales back from the packed bytes, as ggml does, so
    that whatever a wrapped ``uint8_t`` store did to them is what the quants are fitted to.
    """
    xs = _groups(xb, 32)
    if qwb is None:
        # Reference path: weights av + |x| with av the RMS of the sub-block, sub-scales "max then /63".
        av = np.sqrt(seqsum(xs * xs) / F32(32))
        rmin, rdelta, nstep = ref_search
        w = av + np.abs(xs)
        scale, off, L = affine_search(xs, w, nmax, rmin, rdelta, nstep, use_mad=False, guarded=False)
        ls, d = _max_quantize(scale, 63, clamp=True)
        lm, dmin = _max_quantize(off, 63, clamp=True)
    else:
        d, dmin, ls, lm, L = _imatrix_scales(xs, _groups(qwb, 32), F32(2.0), nmax, 63)
        if clamp_imatrix_scales:  # Q5_K clamps to 63 again; Q4_K packs Ls as they are.
            ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    scales = _pack_k4(ls, lm)
    sc, m = _unpack_k4(scales)
    d, dmin = fp16r(d), fp16r(dmin)
    L = _requantize(xs, L, d * sc, dmin * m, nmax)
    return d, dmin, scales, L


# ------------------------------------------------------------------------------------------------
# Layout


def _groups(xb: np.ndarray, group: int) -> np.ndarray:
    """[B, 256] super-blocks as [group, 256 // group, B]: element index first, so a sequential sum
    over a sub-block is a loop over contiguous slices, vectorised across every sub-block at once."""
    nsub = QK_K // group
    return np.ascontiguousarray(xb.T.reshape(nsub, group, len(xb)).transpose(1, 0, 2))


def _block_order(L: np.ndarray) -> np.ndarray:
    """Quants [group, nsub, B] back to uint8 [B, 256] in element order."""
    return np.ascontiguousarray(L.transpose(2, 1, 0)).reshape(L.shape[2], QK_K).astype(np.uint8)


def _pack_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [8, B] into the 12-byte k4 layout, with C's uint8 truncations.

    The Q4_K importance path packs ``Ls`` unclamped, so a wrapped (>63) value spills into the high
    bits exactly as ``(ls >> 4) << 6`` stored in a byte does.
    """
    s = np.zeros((ls.shape[1], 12), dtype=np.int64)
    for j in range(4):
        s[:, j] = ls[j] & 0xFF
        s[:, j + 4] = lm[j] & 0xFF
    for j in range(4, 8):
        s[:, j + 4] = ((ls[j] & 15) | ((lm[j] & 15) << 4)) & 0xFF
        s[:, j - 4] |= ((ls[j] >> 4) << 6) & 0xFF
        s[:, j] |= ((lm[j] >> 4) << 6) & 0xFF
    return s.astype(np.uint8)


def _unpack_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scales and mins [8, B] (float32) a decoder reads from k4-packed bytes [B, 12]."""
    s = s.T.astype(np.int64)
    sc = np.concatenate([s[0:4] & 63, (s[8:12] & 15) | ((s[0:4] >> 6) << 4)])
    m = np.concatenate([s[4:8] & 63, (s[8:12] >> 4) | ((s[4:8] >> 6) << 4)])
    return sc.astype(F32), m.astype(F32)


# ------------------------------------------------------------------------------------------------
# Sub-block scales


def _imatrix_scales(
    xs: np.ndarray, qws: np.ndarray, factor: np.float32, nmax: int, levels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The importance-matrix path of Q2_K, Q4_K and Q5_K (``quantize_row_q*_K_impl``), up to the
    packing of the sub-scales, which differs per type.

    Weights are ``qw·sqrt(sigma2 + x²)`` with ``sigma2 = factor·Σx²/256`` over the whole
    super-block (Σx² in element order, sub-block by sub-block); the weighted affine search to
    0..nmax runs from rmin −0.9 in 36 steps of 0.05, and its scales and mins are quantized to
    0..levels by ``make_qp_quants``, weighted by each sub-block's weight sum. Returns the unrounded
    ``d``, ``dmin`` [B], the sub-scale and sub-min quants (int64, as C's ``uint8_t`` holds them)
    [nsub, B] and the search's quants [group, nsub, B].
    """
    sum_x2 = seqsum((xs * xs).transpose(1, 0, 2).reshape(QK_K, -1))
    w = importance(qws, xs, factor * sum_x2 / F32(QK_K))
    sw = seqsum(w)
    scale, off, L = affine_search(xs, w, nmax, -0.9, 0.05, 36, use_mad=False, guarded=True)
    d, ls = qp_quants(scale, sw, levels)
    dmin, lm = qp_quants(off, sw, levels)
    return d, dmin, ls.astype(np.int64), lm.astype(np.int64), L


def _max_quantize(v: np.ndarray, levels: int, clamp: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Reference-path sub-scale quantization: ``rint(levels/max·v)`` against ``max/levels``.

    ``max`` is the largest positive value of the super-block (0 when there is none, and then all
    quants are 0). The result is what ggml's ``uint8_t`` store keeps, optionally then clamped to
    ``levels`` (Q4_K/Q5_K clamp after the wrap, Q2_K does not clamp). Returns (quants int64 [n, B],
    unrounded super-scale [B]).
    """
    top = v.max(axis=0)
    top = np.where(top > 0, top, ZERO)
    inv = np.where(top > 0, F32(levels) / top, ZERO)
    q = nearest_int(inv * v).astype(np.int64) & 0xFF
    if clamp:
        q = np.minimum(q, levels)
    return q, top / F32(levels)


def _requantize(xs: np.ndarray, L: np.ndarray, d: np.ndarray, dm: np.ndarray, nmax: int) -> np.ndarray:
    """Refit the quants to the stored (fp16, 4/6-bit) scale and min: ``rint((x + dm)/d)``.

    A sub-block whose stored scale is 0 keeps the quants of its search, as ggml's ``continue`` does.
    """
    q = nearest_int((xs + dm) / d)
    np.clip(q, 0, nmax, out=q)
    return np.where(d != 0, q, L)
