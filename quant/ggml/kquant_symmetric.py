"""Q6_K and Q3_K encoders that write exactly the bytes llama.cpp's ``ggml_quantize_chunk`` writes.

A GGUF file is only trustworthy if llama.cpp would have produced the same tensors, so these
encoders are byte-exact ports rather than approximations: every intermediate is float32, every sum
ggml does in a loop is done in the same order, rounding is ggml's round-half-to-even, and fp16 and
int8 stores are reproduced (docs: gguf-kquants.md §1). Q6_K and Q3_K are the *symmetric* K-quants
(a signed scale per 16-element sub-block and no offset), which is why they share one search.

Speed comes from vectorising across every 16-element sub-block of a chunk of rows at once. Arrays
are kept element-major, ``[16, rows, sub-blocks]``, so that the sequential sums over the 16 elements
of a sub-block run over contiguous slices; Python only loops over element indices, search steps and
greedy passes. Rows are processed in chunks to bound memory; blocks are independent, so chunking
never changes the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType

from quant.ggml.numerics import F32, GROUP_MAX_EPS, element_major, first_absmax, importance, nearest_int, seqsum
from quant.ggml.rows import encode_by_rows
from quant.ggml.search import signed_max, symmetric_search
from quant.ggml.types import PortedType

QK_K = 256
SUB = 16  # elements per sub-block

_CHUNK_ELEMENTS = 1 << 19  # rows per chunk are chosen to stay near this many input values


class _SymmetricK(PortedType):
    """A symmetric K-quant, encoded a chunk of rows at a time by ``encode_chunk``.

    Q6_K and Q3_K differ in how they choose a block's signed sub-block scales and its fp16 ``d``
    (``block_scales``), in the offset their quants are stored with and in their byte layout
    (``pack``); what follows the scales is the same in both (ggml refits every quant to its stored
    step ``d·scale_j``), so it is written once, here.
    """

    quant_offset: ClassVar[int]  # stored quant = l + quant_offset, l in [-quant_offset, quant_offset - 1]
    block_scales: ClassVar[Callable[[np.ndarray, np.ndarray, np.ndarray | None], tuple[np.ndarray, np.ndarray, np.ndarray]]]
    pack: ClassVar[Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]]

    @classmethod
    def encode_rows(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """Encode rows in chunks, with the importance laid out element-major like the data."""
        n = x.shape[1]
        # weights[i, 0, s] belongs to element i of sub-block s.
        weights = None if qw is None else np.ascontiguousarray(qw.reshape(n // SUB, SUB).T[:, None, :])
        row_bytes = n // QK_K * cls.type_size
        return encode_by_rows(x, row_bytes, _CHUNK_ELEMENTS, lambda chunk: cls.encode_chunk(chunk, weights))

    @classmethod
    def encode_chunk(cls, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """``[rows, n/256, type_size]`` bytes of a chunk of rows ``x [rows, n]``, given the importance
        laid out element-major (``[16, 1, n/16]``) or None.

        ``block_scales`` returns fp16 ``d`` [rows, n/256], the signed sub-block scales
        [rows, n/256, 16] and the quants of the sub-block search (element-major, as ``xt``).
        """
        rows = len(x)
        xt = element_major(x, SUB)
        d, scales, L = cls.block_scales(x, xt, qw)
        dj = d.astype(F32)[..., None] * scales.astype(F32)
        L = _requantize(xt, L, dj.reshape(rows, -1), cls.quant_offset)
        return cls.pack(L.transpose(1, 2, 0).reshape(rows, -1, QK_K).astype(np.uint8), scales, d)


# ----------------------------------------------------------------------------------------------
# Q6_K


def _q6_k_scales(x: np.ndarray, xt: np.ndarray, qw: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp16 d, int8 sub-block scales (linear in the largest |scale|) and the search's quants, on
    the reference path or as ``quantize_row_q6_K_impl`` with qw.

    With an importance matrix ggml feeds qw to the sub-block search directly (its sigma2 weighting
    is commented out for Q6_K), so both paths differ only in the search weights. ggml zeroes
    every quant of a block whose largest scale is below 1e-15; such a block's d and scales are 0,
    so its steps are 0 and the refit keeps the quants zeroed here.
    """
    w = xt * xt if qw is None else qw
    scale, L = symmetric_search(xt, w, 32)
    scales = scale.reshape(len(x), -1, SUB)
    max_scale = first_absmax(np.moveaxis(scales, 2, 0))
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = F32(-128) / np.where(empty, F32(1), max_scale)
    d = (F32(1) / iscale).astype(np.float16)
    # MIN(127, nearest_int(..)) stored to int8; the product lies within [-128, 128].
    q = np.minimum(np.rint(iscale[..., None] * scales), F32(127)).astype(np.int32).astype(np.int8)
    d[empty] = 0
    q[empty] = 0
    L[:, np.repeat(empty, SUB, axis=1)] = 0
    return d, q, L


def _pack_q6_k(L: np.ndarray, scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Lay out ``ql | qh | scales | d`` (§2): quants 0..63, int8 scales, fp16 d per block."""
    rows, nb = d.shape
    Lr = L.reshape(rows, nb, 2, 4, 32)  # element 128c + 32k + l
    ql = (Lr[:, :, :, 0:2] & 15) | ((Lr[:, :, :, 2:4] & 15) << 4)
    hi = Lr >> 4
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    return np.concatenate(
        [
            ql.reshape(rows, nb, 128),
            qh.reshape(rows, nb, 64),
            scales.view(np.uint8),
            d[..., None].view(np.uint8),
        ],
        axis=2,
    )


class Q6_K(_SymmetricK, qtype=GGMLQuantizationType.Q6_K):
    """6-bit quants and int8 sub-block scales, one fp16 d per super-block."""

    quant_offset, block_scales, pack = 32, staticmethod(_q6_k_scales), staticmethod(_pack_q6_k)


# ----------------------------------------------------------------------------------------------
# Q3_K


def _q3_k_scales(x: np.ndarray, xt: np.ndarray, qw: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp16 d, signed 6-bit sub-block scales (−32..31, float32) and the search's quants:
    ``quantize_row_q3_K_ref``, or ``_impl`` when qw is given."""
    blocks = (len(x), -1, SUB)
    if qw is None:
        scale, L = _q3_greedy_search(xt)
        s, d = _q3_k_scales_ref(scale.reshape(blocks))
    else:
        scale, L, sw = _q3_k_subblocks_imatrix(x, xt, qw)
        s, d = _q3_k_scales_imatrix(scale.reshape(blocks), sw.reshape(blocks))
    return d, s.astype(F32) - F32(32), L


def _q3_k_scales_ref(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """6-bit sub-scales and fp16 d on the reference path: linear in the largest |scale|.

    A block whose largest scale is exactly zero keeps all-zero scale bytes and d = 0.
    """
    max_scale = first_absmax(np.moveaxis(scales, 2, 0))
    nonzero = max_scale != 0
    iscale = F32(-32) / np.where(nonzero, max_scale, F32(1))
    # ggml stores nearest_int into an int8 before clamping; the product lies within [-32, 32].
    s = np.clip(np.rint(iscale[..., None] * scales), F32(-32), F32(31)) + F32(32)
    s = np.where(nonzero[..., None], s, F32(0)).astype(np.uint8)
    d = np.where(nonzero, F32(1) / iscale, F32(0)).astype(np.float16)
    return s, d


def _q3_k_subblocks_imatrix(
    x: np.ndarray, xt: np.ndarray, qw: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sub-block scales, quants and weight sums with ``w = qw * sqrt(sigma2 + x^2)``.

    sigma2 is twice the mean square of the super-block, so small weights still count a little
    where the importance matrix says a column matters.
    """
    rows = len(x)
    x2 = (x * x).reshape(rows, -1, QK_K)
    sum_x2 = np.add.accumulate(x2, axis=2)[..., -1]  # sequential, as ggml sums
    sigma2 = F32(2) * sum_x2 / F32(QK_K)
    sigma2 = np.repeat(sigma2, QK_K // SUB, axis=1)[None]  # [1, rows, sub-blocks]
    w = importance(qw, xt, sigma2)
    sw = seqsum(w)
    scale, L = symmetric_search(xt, w, 4)
    return scale, L, sw


def _q3_k_scales_imatrix(scales: np.ndarray, sw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """6-bit sub-scales and fp16 d with an imatrix: the 16 scales of a block are themselves
    quantized by the weighted symmetric search (nmax 32), weighted by each sub-block's weight sum.
    """
    st = np.ascontiguousarray(scales.transpose(2, 0, 1))
    swt = np.ascontiguousarray(sw.transpose(2, 0, 1))
    d_block, Ls = symmetric_search(st, swt, 32)
    return Ls.transpose(1, 2, 0).astype(np.uint8), d_block.astype(np.float16)


def _q3_greedy_search(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``make_q3_quants(nmax=4, do_rmse=true)`` over every group of ``x [16, *groups]``.

    Starts from l = rint(-4 x / max) and then, for up to five passes, moves each l in turn to
    its least-squares value given the others, keeping the move only if it raises
    sumlx^2/suml2. Two facts keep this cheap without changing a byte:

    - A pass without any accepted move leaves the state as it found it, so another pass would
      repeat it exactly: only groups that changed in a pass take the next one.
    - When the largest-magnitude element is positive, iscale < 0 gives every l the opposite sign
      of its x, so every term (x^2 x) l is <= 0. A float sum of non-positive terms is at most
      each of its terms, so sumlx - term <= 0 and the move (taken only if that is > 0) never
      happens: such groups never enter the passes.

    Returns the scale per group and L = l + 4, or 0 and L = 0 for an all-zero group.
    """
    xf = x.reshape(SUB, -1)
    mx, zero = signed_max(xf)
    w = xf * xf
    wx = w * xf
    L = np.rint((F32(-4) / mx) * xf)
    np.clip(L, F32(-4), F32(3), out=L)
    sumlx = seqsum(wx * L)
    suml2 = seqsum(w * L * L)

    idx = np.flatnonzero(~zero & (mx < 0))
    # np.take keeps rows contiguous (xf[:, idx] would not), so each element's slice stays dense.
    xs, Ls, lx, l2 = np.take(xf, idx, axis=1), np.take(L, idx, axis=1), sumlx[idx], suml2[idx]
    ws = xs * xs
    wxs = ws * xs
    for _ in range(5):
        changed = _q3_greedy_pass(xs, ws, wxs, Ls, lx, l2)
        L[:, idx], sumlx[idx], suml2[idx] = Ls, lx, l2
        if not changed.any():
            break
        idx, lx, l2 = idx[changed], lx[changed], l2[changed]
        xs, ws, wxs, Ls = (np.compress(changed, a, axis=1) for a in (xs, ws, wxs, Ls))

    scale = np.divide(sumlx, suml2, out=np.zeros_like(sumlx), where=suml2 > 0)
    L += F32(4)
    L[:, zero] = 0
    return scale.reshape(x.shape[1:]), L.reshape(x.shape)


def _q3_greedy_pass(
    x: np.ndarray, w: np.ndarray, wx: np.ndarray, L: np.ndarray, sumlx: np.ndarray, suml2: np.ndarray
) -> np.ndarray:
    """One greedy pass over the 16 elements of groups ``[16, n]``; updates L and the sums in place.

    Most elements keep their l, so the accept test is only evaluated where a move is proposed.
    Returns which groups accepted at least one move.
    """
    changed = np.zeros(x.shape[1], dtype=bool)
    for i in range(SUB):
        li = L[i]
        slx = sumlx - wx[i] * li
        sl2 = suml2 - w[i] * li * li
        nl = nearest_int(x[i] * sl2 / slx)
        np.clip(nl, F32(-4), F32(3), out=nl)
        j = np.flatnonzero((slx > 0) & (nl != li))
        if j.size == 0:
            continue
        nl, slx, sl2, lx, l2 = nl[j], slx[j], sl2[j], sumlx[j], suml2[j]
        slx += wx[i, j] * nl
        sl2 += w[i, j] * nl * nl
        ok = (sl2 > 0) & (slx * slx * l2 > lx * lx * sl2)
        j = j[ok]
        li[j], sumlx[j], suml2[j] = nl[ok], slx[ok], sl2[ok]
        changed[j] = True
    return changed


def _pack_q3_k(L: np.ndarray, scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Lay out ``hmask | qs | scales | d`` (§2) from quants 0..7 and signed 6-bit scales, which
    are stored plus 32."""
    rows, nb = d.shape
    s = (scales + F32(32)).astype(np.uint8)
    bit = (L >> 2).reshape(rows, nb, 8, 32)  # high bit of element 32b + m goes to bit b of hmask[m]
    hmask = bit[:, :, 0].copy()
    for b in range(1, 8):
        hmask |= bit[:, :, b] << b
    low = (L & 3).reshape(rows, nb, 2, 4, 32)  # element 128c + 32k + l
    qs = low[:, :, :, 0] | (low[:, :, :, 1] << 2) | (low[:, :, :, 2] << 4) | (low[:, :, :, 3] << 6)
    high = (s >> 4).reshape(rows, nb, 4, 4)  # scale 4q + m contributes bits 2q of byte 8 + m
    packed = np.concatenate(
        [
            (s[:, :, :8] & 15) | ((s[:, :, 8:] & 15) << 4),
            high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6),
        ],
        axis=2,
    )
    return np.concatenate(
        [hmask, qs.reshape(rows, nb, 64), packed, d[..., None].view(np.uint8)], axis=2
    )


class Q3_K(_SymmetricK, qtype=GGMLQuantizationType.Q3_K):
    """3-bit quants and 6-bit sub-block scales, one fp16 d per super-block."""

    quant_offset, block_scales, pack = 4, staticmethod(_q3_k_scales), staticmethod(_pack_q3_k)


def _requantize(xt: np.ndarray, L: np.ndarray, dj: np.ndarray, offset: int) -> np.ndarray:
    """Re-round every element against its stored sub-block step ``dj = fp16(d) * scale_j``.

    Sub-blocks whose step is zero keep the quants of the search, as ggml does.
    """
    q = np.rint(xt / dj)
    np.clip(q, F32(-offset), F32(offset - 1), out=q)
    q += F32(offset)
    return np.where(dj != 0, q, L)
