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

import numpy as np

QK_K = 256
SUB = 16  # elements per sub-block
Q6_K_BYTES = 210
Q3_K_BYTES = 110

_CHUNK_ELEMENTS = 1 << 19  # rows per chunk are chosen to stay near this many input values
_GROUP_MAX_EPS = np.float32(1e-15)  # ggml's GROUP_MAX_EPS: a group this small is all zero
_ROUND_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23, the constant of ggml's nearest_int

F32 = np.float32


def quantize_q6_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Encode float32 rows ``x [rows, n_per_row]`` as Q6_K; ``qw`` is the importance per column.

    Returns uint8 ``[rows, n_per_row // 256 * 210]``.
    """
    return _encode_rows(x, qw, _q6_k_chunk, Q6_K_BYTES)


def quantize_q3_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Encode float32 rows ``x [rows, n_per_row]`` as Q3_K; ``qw`` is the importance per column.

    Returns uint8 ``[rows, n_per_row // 256 * 110]``.
    """
    return _encode_rows(x, qw, _q3_k_chunk, Q3_K_BYTES)


# ----------------------------------------------------------------------------------------------
# Driver


def _encode_rows(
    x: np.ndarray,
    qw: np.ndarray | None,
    encode_chunk: Callable[[np.ndarray, np.ndarray | None], np.ndarray],
    block_bytes: int,
) -> np.ndarray:
    """Validate, then encode rows in chunks so intermediates stay a bounded multiple of a chunk."""
    x = np.ascontiguousarray(x, dtype=F32)
    if x.ndim != 2 or x.shape[1] % QK_K:
        raise ValueError(f"expected [rows, n_per_row] with n_per_row % {QK_K} == 0, got {x.shape}")
    rows, n = x.shape
    weights = None
    if qw is not None:
        qw = np.ascontiguousarray(qw, dtype=F32)
        if qw.shape != (n,):
            raise ValueError(f"importance weights must have shape ({n},), got {qw.shape}")
        # Element-major like the data: weights[i, 0, s] belongs to element i of sub-block s.
        weights = np.ascontiguousarray(qw.reshape(n // SUB, SUB).T[:, None, :])
    out = np.empty((rows, n // QK_K * block_bytes), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // n)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, rows, step):
            chunk = x[start:start + step]
            out[start:start + step] = encode_chunk(chunk, weights).reshape(len(chunk), -1)
    return out


def _element_major(x: np.ndarray) -> np.ndarray:
    """``[rows, n]`` -> ``[16, rows, n/16]``: element i of every sub-block is one contiguous slice."""
    rows, n = x.shape
    return np.ascontiguousarray(x.reshape(rows, n // SUB, SUB).transpose(2, 0, 1))


# ----------------------------------------------------------------------------------------------
# Q6_K


def _q6_k_chunk(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """Q6_K blocks for a chunk of rows (reference path, or ``quantize_row_q6_K_impl`` with qw).

    With an importance matrix ggml feeds qw to the sub-block search directly (its sigma2 weighting
    is commented out for Q6_K), so both paths differ only in the search weights.
    """
    rows, n = x.shape
    nb = n // QK_K
    xt = _element_major(x)
    w = xt * xt if qw is None else qw
    scale, L = _symmetric_search(xt, w, 32)

    scales = scale.reshape(rows, nb, SUB)
    max_scale = _first_absmax(np.moveaxis(scales, 2, 0))
    empty = np.abs(max_scale) < _GROUP_MAX_EPS
    iscale = F32(-128) / np.where(empty, F32(1), max_scale)
    d = (F32(1) / iscale).astype(np.float16)
    # MIN(127, nearest_int(..)) stored to int8; the product lies within [-128, 128].
    q = np.minimum(np.rint(iscale[..., None] * scales), F32(127)).astype(np.int32).astype(np.int8)
    d[empty] = 0
    q[empty] = 0

    dj = d.astype(F32)[..., None] * q.astype(F32)
    L = _requantize(xt, L, dj.reshape(rows, nb * SUB), 32)
    L = L.transpose(1, 2, 0).reshape(rows, nb, QK_K).astype(np.uint8)
    L[empty] = 0  # ggml zeroes the whole block
    return _pack_q6_k(L, q, d)


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


# ----------------------------------------------------------------------------------------------
# Q3_K


def _q3_k_chunk(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """Q3_K blocks for a chunk of rows: ``quantize_row_q3_K_ref``, or ``_impl`` when qw is given."""
    rows, n = x.shape
    nb = n // QK_K
    xt = _element_major(x)
    if qw is None:
        scale, L = _q3_greedy_search(xt)
        s, d = _q3_k_scales_ref(scale.reshape(rows, nb, SUB))
    else:
        scale, L, sw = _q3_k_subblocks_imatrix(x, xt, qw)
        s, d = _q3_k_scales_imatrix(scale.reshape(rows, nb, SUB), sw.reshape(rows, nb, SUB))
    dj = d.astype(F32)[..., None] * (s.astype(F32) - F32(32))
    L = _requantize(xt, L, dj.reshape(rows, nb * SUB), 4)
    L = L.transpose(1, 2, 0).reshape(rows, nb, QK_K).astype(np.uint8)
    return _pack_q3_k(L, s, d)


def _q3_k_scales_ref(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """6-bit sub-scales and fp16 d on the reference path: linear in the largest |scale|.

    A block whose largest scale is exactly zero keeps all-zero scale bytes and d = 0.
    """
    max_scale = _first_absmax(np.moveaxis(scales, 2, 0))
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
    rows, n = x.shape
    nb = n // QK_K
    x2 = (x * x).reshape(rows, nb, QK_K)
    sum_x2 = np.add.accumulate(x2, axis=2)[..., -1]  # sequential, as ggml sums
    sigma2 = F32(2) * sum_x2 / F32(QK_K)
    sigma2 = np.repeat(sigma2, QK_K // SUB, axis=1)[None]  # [1, rows, sub-blocks]
    w = qw * np.sqrt(sigma2 + xt * xt)
    sw = _seq_sum(w)
    scale, L = _symmetric_search(xt, w, 4)
    return scale, L, sw


def _q3_k_scales_imatrix(scales: np.ndarray, sw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """6-bit sub-scales and fp16 d with an imatrix: the 16 scales of a block are themselves
    quantized by the weighted symmetric search (nmax 32), weighted by each sub-block's weight sum.
    """
    st = np.ascontiguousarray(scales.transpose(2, 0, 1))
    swt = np.ascontiguousarray(sw.transpose(2, 0, 1))
    d_block, Ls = _symmetric_search(st, swt, 32)
    return Ls.transpose(1, 2, 0).astype(np.uint8), d_block.astype(np.float16)


def _pack_q3_k(L: np.ndarray, s: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Lay out ``hmask | qs | scales | d`` (§2) from quants 0..7 and 6-bit scales."""
    rows, nb = d.shape
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


# ----------------------------------------------------------------------------------------------
# Shared numerics


def _seq_sum(t: np.ndarray) -> np.ndarray:
    """Sum over axis 0 left to right from 0.0f, as ggml's loops do (np.sum would sum pairwise)."""
    acc = np.zeros(t.shape[1:], dtype=F32)
    for i in range(t.shape[0]):
        np.add(acc, t[i], out=acc)
    return acc


def _first_absmax(x: np.ndarray) -> np.ndarray:
    """Over axis 0: the signed value of the first element of largest magnitude.

    That is what ggml's strict ``>`` scan finds; only the sign needs the scan, done on booleans
    from the last element back so the first hit wins.
    """
    ax = np.abs(x)
    amax = ax.max(axis=0)
    negative = np.zeros(amax.shape, dtype=bool)
    for i in range(x.shape[0] - 1, -1, -1):
        hit = ax[i] == amax
        negative &= ~hit
        negative |= hit & np.signbit(x[i])
    return np.where(negative, -amax, amax)


def _symmetric_search(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``make_qx_quants(rmse_type=1)`` over every group: x ~ scale * l, l in [-nmax, nmax-1].

    ``x`` is ``[16, *groups]`` and ``w`` broadcasts to it. Tries iscale = -(nmax + 0.1 s)/max for
    s = 0, -9..9 and keeps the candidate maximising sumlx^2/suml2 (least weighted squared error).
    Only the winning iscale is kept; its quants are recomputed once at the end, as ggml does.
    Returns the scale per group and L = l + nmax, or 0 and L = 0 for an all-zero group.
    """
    amax_x = _first_absmax(x)
    zero = np.abs(amax_x) < _GROUP_MAX_EPS
    mx = np.where(zero, F32(1), amax_x)  # all-zero groups then round to l = 0: their scale is 0
    wx = w * x
    lo, hi = F32(-nmax), F32(nmax - 1)
    l = np.empty(mx.shape, dtype=F32)
    t = np.empty(mx.shape, dtype=F32)

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Element by element, so the working set is a few group-sized vectors that stay in cache.
        sumlx = np.zeros(mx.shape, dtype=F32)
        suml2 = np.zeros(mx.shape, dtype=F32)
        for i in range(SUB):
            np.multiply(iscale, x[i], out=l)
            np.rint(l, out=l)
            np.clip(l, lo, hi, out=l)
            np.multiply(w[i], l, out=t)
            np.multiply(t, l, out=t)
            np.add(suml2, t, out=suml2)
            np.multiply(wx[i], l, out=l)
            np.add(sumlx, l, out=sumlx)
        return sumlx, suml2

    best_iscale = F32(-nmax) / mx
    sumlx, suml2 = sums(best_iscale)
    scale = np.divide(sumlx, suml2, out=np.zeros_like(sumlx), where=suml2 != 0)
    best = scale * sumlx
    # Few groups improve at each step: update those through flat views of the (contiguous) state.
    scale_f, best_f, best_iscale_f = scale.reshape(-1), best.reshape(-1), best_iscale.reshape(-1)
    for s in range(-9, 10):
        if s == 0:
            continue
        iscale = -(F32(nmax) + F32(0.1) * F32(s)) / mx
        sumlx, suml2 = sums(iscale)
        better = np.flatnonzero((suml2 > 0) & (sumlx * sumlx > best * suml2))
        lx = sumlx.reshape(-1)[better]
        scale_f[better] = lx / suml2.reshape(-1)[better]
        best_f[better] = scale_f[better] * lx
        best_iscale_f[better] = iscale.reshape(-1)[better]

    L = np.rint(best_iscale * x)
    np.clip(L, lo, hi, out=L)
    L += F32(nmax)
    L[:, zero] = 0
    return scale, L


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
    amax_x = _first_absmax(xf)
    zero = np.abs(amax_x) < _GROUP_MAX_EPS
    mx = np.where(zero, F32(1), amax_x)  # all-zero groups then round to l = 0: their scale is 0
    w = xf * xf
    wx = w * xf
    L = np.rint((F32(-4) / mx) * xf)
    np.clip(L, F32(-4), F32(3), out=L)
    sumlx = _seq_sum(wx * L)
    suml2 = _seq_sum(w * L * L)

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
        nl = _nearest_int(x[i] * sl2 / slx)
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


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int`` bit for bit, as float32.

    It equals round-half-to-even only for |v| <= 4194303; the greedy step divides by a sum that
    can underflow towards zero for tiny inputs, so there the out-of-range result must match too.
    """
    bits = (v + _ROUND_MAGIC).view(np.int32)
    return ((bits & 0x007FFFFF) - 0x00400000).astype(F32)


def _requantize(xt: np.ndarray, L: np.ndarray, dj: np.ndarray, offset: int) -> np.ndarray:
    """Re-round every element against its stored sub-block step ``dj = fp16(d) * scale_j``.

    Sub-blocks whose step is zero keep the quants of the search, as ggml does.
    """
    q = np.rint(xt / dj)
    np.clip(q, F32(-offset), F32(offset - 1), out=q)
    q += F32(offset)
    return np.where(dj != 0, q, L)
