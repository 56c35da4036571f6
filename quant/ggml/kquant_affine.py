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
search keeps both few (see ``_affine_search``). Blocks are independent: the bytes do not depend on
chunking.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

QK_K = 256
_F32 = np.float32
_ZERO = _F32(0.0)
# Super-blocks per chunk (128K values, 512 KB per float32 work array). Smaller chunks keep the
# passes in L2 but pay the per-call cost of the per-group operations more often, and in the
# row-block threads of quant.ggml every numpy call hands the GIL over, which favours fewer, larger
# calls. Measured on 2 cores: 512 fastest single-threaded and as fast as 1024-2048 in two threads.
_CHUNK_BLOCKS = 512
_GROUP_MAX_EPS = _F32(1e-15)
# |v| up to which np.rint is ggml's nearest_int (4194303), less a margin for the rounding of the
# bounds that are checked against it.
_REACH_LIMIT = 4.19e6
_MIN_GAP = 1e-30  # a group range below which iscale = num/range might overflow float32

Encoder = Callable[[np.ndarray, np.ndarray | None], np.ndarray]


def quantize_q4_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Q4_K bytes of ``x [rows, n_per_row]`` (144 per 256 values), as ``ggml_quantize_chunk`` writes."""
    return _quantize(x, qw, 144, _encode_q4_k)


def quantize_q5_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Q5_K bytes of ``x [rows, n_per_row]`` (176 per 256 values), as ``ggml_quantize_chunk`` writes."""
    return _quantize(x, qw, 176, _encode_q5_k)


def quantize_q2_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Q2_K bytes of ``x [rows, n_per_row]`` (84 per 256 values), as ``ggml_quantize_chunk`` writes."""
    return _quantize(x, qw, 84, _encode_q2_k)


def q4_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The grid Q4_K bytes store, per super-block of 256: ``d``, ``dmin`` [B] (float32, from fp16),
    the 6-bit scales and mins of its 8 sub-blocks ``sc``, ``m`` [B, 8] and the 4-bit levels ``q``
    [B, 256] (uint8), each value ``d·sc_j·q − dmin·m_j``."""
    b = raw.reshape(-1, 144)
    d = np.ascontiguousarray(b[:, 0:2]).view(np.float16).astype(_F32).ravel()
    dmin = np.ascontiguousarray(b[:, 2:4]).view(np.float16).astype(_F32).ravel()
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
    return np.concatenate([_f16_bytes(np.asarray(d, _F32)), _f16_bytes(np.asarray(dmin, _F32)), scales,
                           qs.reshape(-1, 128)], axis=1)


# ------------------------------------------------------------------------------------------------
# Driver


def _quantize(x: np.ndarray, qw: np.ndarray | None, block_bytes: int, encode: Encoder) -> np.ndarray:
    """Split the rows into super-blocks and encode them chunk by chunk.

    ggml gives every super-block the importance weights of its own columns, so each chunk gets the
    matching slice of ``qw`` however the chunk boundaries fall across rows.
    """
    x = np.ascontiguousarray(x, dtype=_F32)
    if x.ndim != 2 or x.shape[1] % QK_K:
        raise ValueError(f"expected [rows, n_per_row] with n_per_row a multiple of {QK_K}, got {x.shape}")
    rows, n_per_row = x.shape
    per_row = n_per_row // QK_K
    blocks = x.reshape(-1, QK_K)
    qw_blocks = None
    if qw is not None:
        qw = np.ascontiguousarray(qw, dtype=_F32)
        if qw.shape != (n_per_row,):
            raise ValueError(f"importance weights must have shape ({n_per_row},), got {qw.shape}")
        if not np.isfinite(qw).all():
            raise ValueError("importance weights contain NaN or Inf")
        qw_blocks = qw.reshape(per_row, QK_K)
    out = np.empty((len(blocks), block_bytes), dtype=np.uint8)
    # Division by zero, overflow and NaN happen in ggml too (flat groups, subnormal data, rejected
    # candidates); the encoders mask or reproduce their effect instead of avoiding them.
    with np.errstate(all="ignore"):
        for start in range(0, len(blocks), _CHUNK_BLOCKS):
            stop = min(start + _CHUNK_BLOCKS, len(blocks))
            if not np.isfinite(blocks[start:stop]).all():
                raise ValueError("cannot quantize NaN or Inf (llama.cpp rejects the resulting blocks)")
            qwb = None if qw_blocks is None else qw_blocks[np.arange(start, stop) % per_row]
            out[start:stop] = encode(blocks[start:stop], qwb)
    return out.reshape(rows, per_row * block_bytes)


def _encode_q4_k(xb: np.ndarray, qwb: np.ndarray | None) -> np.ndarray:
    """Q4_K: nibble pairs hold elements l and l + 32 of each 64, so two sub-blocks share 32 bytes."""
    d, dmin, scales, L = _encode_k4(xb, qwb, nmax=15, ref_search=(-1.0, 0.1, 20), clamp_imatrix_scales=False)
    Lb = _block_order(L)
    qs = Lb.reshape(-1, 4, 2, 32)
    qs = qs[:, :, 0] | (qs[:, :, 1] << 4)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs.reshape(-1, 128)], axis=1)


def _encode_q5_k(xb: np.ndarray, qwb: np.ndarray | None) -> np.ndarray:
    """Q5_K: Q4_K's nibbles for the low 4 bits, plus one byte of 5th bits per lane l of 32."""
    d, dmin, scales, L = _encode_k4(xb, qwb, nmax=31, ref_search=(-0.5, 0.1, 15), clamp_imatrix_scales=True)
    Lb = _block_order(L)
    low = (Lb & 15).reshape(-1, 4, 2, 32)
    qs = low[:, :, 0] | (low[:, :, 1] << 4)
    high = (Lb >> 4).reshape(-1, 8, 32)  # bit j of qh[l] is the 5th bit of element 32j + l
    qh = np.zeros((len(Lb), 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, qs.reshape(-1, 128)], axis=1)


def _encode_q2_k(xb: np.ndarray, qwb: np.ndarray | None) -> np.ndarray:
    """Q2_K: 16 sub-blocks of 16, each with a 4-bit scale and min sharing a byte (a_j | b_j << 4)."""
    xs = _groups(xb, 16)
    if qwb is None:
        # Reference path: weights |x|, absolute-error search, sub-scales "max then /15".
        scale, off, L = _affine_search(xs, np.abs(xs), 3, -0.5, 0.1, 15, use_mad=True, guarded=False)
        a, d = _max_quantize(scale, 15)
        b, dmin = _max_quantize(off, 15)
        byte = a | ((b << 4) & 0xFF)
    else:
        w = _imatrix_weights(xs, _groups(qwb, 16), _F32(1.0))
        sw = _seqsum(w)
        scale, off, L = _affine_search(xs, w, 3, -0.9, 0.05, 36, use_mad=False, guarded=True)
        d, Ls = _qp_quants(scale, sw, 15)
        dmin, Lm = _qp_quants(off, sw, 15)
        byte = (Ls.astype(np.int64) | (Lm.astype(np.int64) << 4)) & 0xFF
    d, dmin = _fp16r(d), _fp16r(dmin)
    L = _requantize(xs, L, d * (byte & 15).astype(_F32), dmin * (byte >> 4).astype(_F32), 3)
    Lb = _block_order(L).reshape(-1, 2, 4, 32)
    qs = Lb[:, :, 0] | (Lb[:, :, 1] << 2) | (Lb[:, :, 2] << 4) | (Lb[:, :, 3] << 6)
    return np.concatenate(
        [byte.T.astype(np.uint8), qs.reshape(-1, 64), _f16_bytes(d), _f16_bytes(dmin)], axis=1
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
        av = np.sqrt(_seqsum(xs * xs) / _F32(32))
        rmin, rdelta, nstep = ref_search
        w = av + np.abs(xs)
        scale, off, L = _affine_search(xs, w, nmax, rmin, rdelta, nstep, use_mad=False, guarded=False)
        ls, d = _max_quantize(scale, 63, clamp=True)
        lm, dmin = _max_quantize(off, 63, clamp=True)
    else:
        w = _imatrix_weights(xs, _groups(qwb, 32), _F32(2.0))
        sw = _seqsum(w)
        scale, off, L = _affine_search(xs, w, nmax, -0.9, 0.05, 36, use_mad=False, guarded=True)
        d, ls = _qp_quants(scale, sw, 63)
        dmin, lm = _qp_quants(off, sw, 63)
        ls, lm = ls.astype(np.int64), lm.astype(np.int64)
        if clamp_imatrix_scales:  # Q5_K clamps to 63 again; Q4_K packs Ls as they are.
            ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    scales = _pack_k4(ls, lm)
    sc, m = _unpack_k4(scales)
    d, dmin = _fp16r(d), _fp16r(dmin)
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


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(len(v), 2)


def _fp16r(v: np.ndarray) -> np.ndarray:
    """The value a stored fp16 field reads back as (ggml requantizes against the stored scale)."""
    return v.astype(np.float16).astype(_F32)


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
    return sc.astype(_F32), m.astype(_F32)


# ------------------------------------------------------------------------------------------------
# Numerics shared by the encoders


def _seqsum(t: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Left-to-right float32 sum over axis 0, the order of ggml's loops (np.sum is pairwise).

    ``np.add.reduce`` over the outer axis of a C-contiguous array adds whole rows into the
    accumulator one after another, so every group's sum is sequential, in one call. numpy drops a
    length-1 axis, though, and would then reduce along memory, pairwise: one group per row (a chunk
    of a single super-block) takes ``accumulate``, sequential by definition.
    """
    t = np.ascontiguousarray(t)
    if t.size > len(t):
        return np.add.reduce(t, axis=0, out=out)
    total = np.add.accumulate(t, axis=0)[-1]
    if out is None:
        return total
    out[...] = total
    return out


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``, bit for bit, as float32: round half to even by adding 1.5·2^23.

    Equal to ``np.rint`` for |v| <= 4194303; beyond that (and for inf/NaN, which ggml meets when a
    scale overflows on subnormal data) it returns the same garbage the C code does, which later
    clamps and uint8 stores then turn into the bytes ggml writes.
    """
    bits = (v + _F32(12582912.0)).view(np.int32)
    return ((bits & 0x007FFFFF) - 0x00400000).astype(_F32)


def _wrap_u8(v: np.ndarray) -> np.ndarray:
    """An integer-valued float array as C stores it in a ``uint8_t`` (modulo 256)."""
    return np.mod(v, _F32(256))


def _imatrix_weights(xs: np.ndarray, qws: np.ndarray, factor: np.float32) -> np.ndarray:
    """``qw·sqrt(sigma2 + x²)`` with ``sigma2 = factor·Σx²/256`` over the whole super-block.

    Σx² runs over the 256 values in element order (sub-block by sub-block).
    """
    sq = xs * xs
    sum_x2 = _seqsum(sq.transpose(1, 0, 2).reshape(QK_K, -1))
    sigma2 = factor * sum_x2 / _F32(QK_K)
    return qws * np.sqrt(sigma2 + sq)


def _max_quantize(v: np.ndarray, levels: int, clamp: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Reference-path sub-scale quantization: ``rint(levels/max·v)`` against ``max/levels``.

    ``max`` is the largest positive value of the super-block (0 when there is none, and then all
    quants are 0). The result is what ggml's ``uint8_t`` store keeps, optionally then clamped to
    ``levels`` (Q4_K/Q5_K clamp after the wrap, Q2_K does not clamp). Returns (quants int64 [n, B],
    unrounded super-scale [B]).
    """
    top = v.max(axis=0)
    top = np.where(top > 0, top, _ZERO)
    inv = np.where(top > 0, _F32(levels) / top, _ZERO)
    q = _nearest_int(inv * v).astype(np.int64) & 0xFF
    if clamp:
        q = np.minimum(q, levels)
    return q, top / _F32(levels)


def _requantize(xs: np.ndarray, L: np.ndarray, d: np.ndarray, dm: np.ndarray, nmax: int) -> np.ndarray:
    """Refit the quants to the stored (fp16, 4/6-bit) scale and min: ``rint((x + dm)/d)``.

    A sub-block whose stored scale is 0 keeps the quants of its search, as ggml's ``continue`` does.
    """
    q = _nearest_int((xs + dm) / d)
    np.clip(q, 0, nmax, out=q)
    return np.where(d != 0, q, L)


def _affine_search(
    x: np.ndarray,
    w: np.ndarray,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
    guarded: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``make_qkx2_quants`` / ``make_qkx3_quants``: fit x ≈ scale·L − off, L in [0, nmax].

    ``x``, ``w`` are [n, *groups]; returns (scale, off, L). Each candidate ``iscale`` is tried with
    the offset of the best fit so far, and a candidate is kept only if its weighted error is
    strictly lower, so the steps must run in order. ``guarded`` selects qkx3's candidate rounding
    (``v > 0 ? nearest_int(min(v, nmax)) : 0``) over qkx2's clamp-after-rounding; they differ only
    where the best offset sits at or near the group's max and ``v`` leaves nearest_int's range.

    A step is sixteen passes over [n, groups] arrays (three work arrays reused throughout) and
    about twenty operations on per-group vectors, which cost as much as the passes on small chunks,
    so they are kept few:

    - Only a small share of the groups improves at each step. Each group's best fit so far (error,
      scale, iscale, offset) is one column of ``fit`` and the candidate's one column of ``cand``, so
      the groups that improve are updated with one indexed copy (masked copies such as
      ``np.where`` would cost several times more).
    - The range check of ``_levels`` runs per group only when a bound over the whole chunk
      (``_ReachBound``) fails, which real weights almost never make it do.
    - Flat groups (max == min, which ggml returns from before searching) get an infinite gap,
      hence ``iscale`` 0: their candidates are all-zero quants with D = 0, which never win and
      bring no NaN into the range check. Their outputs are set as ggml's at the end.

    Copying the winner's quants would cost a whole pass, so only its ``iscale`` and offset are
    kept and its quants recomputed once at the end, with the same float operations.
    """
    shape = x.shape
    x = x.reshape(len(x), -1)
    w = w.reshape(len(w), -1)
    nmax_f = _F32(nmax)
    mn = x.min(axis=0)
    mx = x.max(axis=0)
    mn[mn > 0] = 0
    sum_w = _seqsum(w)
    sum_x = _seqsum(w * x)
    flat = mx == mn
    gap = mx - mn  # mx − offset, the divisor of every iscale
    gap[flat] = np.inf
    bound = _ReachBound(float(np.min(gap)))

    L = np.empty_like(x)
    wl = np.empty_like(x)
    t = np.empty_like(x)
    fit = np.empty((4, len(mn)), dtype=_F32)
    best, scale, win_iscale, win_shift = fit
    cand = np.empty_like(fit)
    err, this_scale, iscale, cur_min = cand
    np.divide(nmax_f, gap, out=win_iscale)
    np.divide(_F32(1), win_iscale, out=scale)
    win_shift[:] = mn
    _levels(x, win_iscale, mn, nmax_f, False, L, bound.spans(nmax_f, mn, mn, mx, flat))
    _weighted_error(L, scale, mn, x, w, use_mad, t, out=best)
    won = np.zeros(len(mn), dtype=bool)
    cur_min[:] = mn
    for step in range(nstep + 1):
        num = _F32(rmin) + _F32(rdelta) * _F32(step) + nmax_f
        np.divide(num, gap, out=iscale)
        _levels(x, iscale, cur_min, nmax_f, guarded, L, bound.spans(num, cur_min, mn, mx, flat))
        np.multiply(w, L, out=wl)
        sum_l = _seqsum(wl)
        sum_l2 = _seqsum(np.multiply(wl, L, out=t))
        wl *= x
        sum_xl = _seqsum(wl)
        D = sum_w * sum_l2 - sum_l * sum_l
        np.divide(sum_w * sum_xl - sum_x * sum_l, D, out=this_scale)
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        positive = np.flatnonzero(this_min > 0)
        if positive.size:
            this_min[positive] = 0
            this_scale[positive] = sum_xl[positive] / sum_l2[positive]
        _weighted_error(L, this_scale, this_min, x, w, use_mad, t, out=err)
        better = np.flatnonzero((D > 0) & (err < best))
        if better.size:
            fit[:, better] = cand[:, better]
            won[better] = True
            new_min = cur_min[better] = this_min[better]
            new_gap = gap[better] = mx[better] - new_min
            bound.update(_span(new_min, mn[better], mx[better], False), new_gap)
    _levels(x, win_iscale, win_shift, nmax_f, won if guarded else False, L, _span(win_shift, mn, mx, flat))
    scale[flat] = 0
    return scale.reshape(shape[1:]), -cur_min.reshape(shape[1:]), L.reshape(shape)


class _ReachBound:
    """A bound on |iscale·(x − offset)| over a whole chunk, so that ``_levels`` checks each group's
    range only when it might be needed.

    With iscale = num/gap and span the largest |x − offset| of a group, |v| <= num·span/|gap|
    (to a few float32 roundings, which the margin of ``_REACH_LIMIT`` covers) as long as num/gap
    does not overflow, which a gap of at least ``_MIN_GAP`` rules out. ``ratio`` is the largest
    span/|gap| of any offset a group has had, 1 at the start (offset = min, span = gap); it only
    grows, so it stays an upper bound, and a NaN from an overflowing span makes every check run.
    """

    def __init__(self, min_gap: float) -> None:
        self.ratio = 1.0
        self.min_gap = min_gap

    def update(self, spans: np.ndarray, gaps: np.ndarray) -> None:
        """Account for the groups that moved their offset (their new spans and gaps)."""
        gaps = np.abs(gaps)
        self.ratio = float(np.max(spans / gaps, initial=self.ratio))
        self.min_gap = min(self.min_gap, float(np.min(gaps)))

    def spans(self, num: np.float32, shift: np.ndarray, mn: np.ndarray, mx: np.ndarray, flat: np.ndarray) -> np.ndarray | None:
        """None when every group is in range for ``num``, else each group's span for ``_levels``."""
        if float(num) * self.ratio <= _REACH_LIMIT and self.min_gap >= _MIN_GAP:
            return None
        return _span(shift, mn, mx, flat)


def _span(shift: np.ndarray, mn: np.ndarray, mx: np.ndarray, flat: np.ndarray | bool) -> np.ndarray:
    """Largest |x − shift| of each group (0 for flat groups, whose ``iscale`` is 0)."""
    span = np.maximum(mx - shift, shift - mn)
    span[flat] = 0
    return span


def _levels(
    x: np.ndarray,
    iscale: np.ndarray,
    shift: np.ndarray,
    nmax: np.float32,
    guarded: bool | np.ndarray,
    out: np.ndarray,
    span: np.ndarray | None = None,
) -> None:
    """Quants ``L = clamp(nearest_int(iscale·(x − shift)), 0, nmax)`` of one candidate, into ``out``.

    Clamping before rounding gives the same integers for finite values and saves a pass over the
    rounded ones. ``np.rint`` is ggml's nearest_int only while |v| <= 4194303. Given ``span``, the
    largest |x − shift| of each group, the groups where |iscale|·span may pass that (an
    overflowing iscale on subnormal data, or a best offset next to the max) are redone bit for bit,
    with qkx3's guard (``v > 0 ? nearest_int(min(v, nmax)) : 0``) where ``guarded`` says so (per
    group or for all). Without ``span`` the caller has shown that no group gets there.
    """
    np.subtract(x, shift, out=out)
    out *= iscale
    np.clip(out, _ZERO, nmax, out=out)
    np.rint(out, out=out)
    if span is None:
        return
    unsafe = ~(np.abs(iscale) * span <= _REACH_LIMIT)
    if unsafe.any():
        v = (x[:, unsafe] - shift[unsafe]) * iscale[unsafe]
        plain = np.clip(_nearest_int(v), 0, nmax)
        guard = np.where(v > 0, _nearest_int(np.minimum(v, nmax)), _ZERO)
        out[:, unsafe] = np.where(guarded if np.ndim(guarded) == 0 else guarded[unsafe], guard, plain)


def _weighted_error(
    L: np.ndarray,
    scale: np.ndarray,
    mn: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    use_mad: bool,
    work: np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Per-group sequential sum of ``w·e((scale·L + mn) − x)``, e = |·| or square (``work`` is scratch)."""
    np.multiply(L, scale, out=work)
    work += mn
    work -= x
    if use_mad:
        np.abs(work, out=work)
    else:
        np.square(work, out=work)
    work *= w
    return _seqsum(work, out)


def _qp_quants(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qp_quants``: quantize non-negative values [n, B] to [0, nmax] without offset.

    Used on the sub-block scales and mins of the importance-matrix paths, weighted by the sub-block
    weight sums. Returns (scale [B], L [n, B]); L holds what C's ``uint8_t`` array holds, wrapped
    where a negative value was stored, and the greedy passes read it back that way.
    """
    nmax_f = _F32(nmax)
    mx = x.max(axis=0)
    mx = np.where(mx > 0, mx, _ZERO)
    zero = mx < _GROUP_MAX_EPS
    iscale = nmax_f / mx
    scale0 = _F32(1) / iscale
    diff = x - scale0 * _wrap_u8(_nearest_int(iscale * x))
    best = _seqsum(w * diff * diff)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_s = (_F32(0.1) * _F32(step) + nmax_f) / mx
        scale_s = _F32(1) / iscale_s
        diff = x - scale_s * np.minimum(_nearest_int(iscale_s * x), nmax_f)
        mse = _seqsum(w * diff * diff)
        better = mse < best
        best = np.where(better, mse, best)
        iscale = np.where(better, iscale_s, iscale)
    l = np.minimum(_nearest_int(iscale * x), nmax_f)
    L = _wrap_u8(l)
    wx = w * x
    sumlx = _seqsum(wx * l)
    suml2 = _seqsum(w * l * l)
    for _ in range(5):
        changed = np.zeros(mx.shape, dtype=bool)
        for i in range(len(x)):
            slx = sumlx - wx[i] * L[i]
            sl2 = suml2 - w[i] * L[i] * L[i]
            new_l = np.minimum(_nearest_int(x[i] * sl2 / slx), nmax_f)
            slx_new = slx + wx[i] * new_l
            sl2_new = sl2 + w[i] * new_l * new_l
            accept = (slx > 0) & (sl2 > 0) & (new_l != L[i])
            accept &= slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new
            L[i] = np.where(accept, _wrap_u8(new_l), L[i])
            sumlx = np.where(accept, slx_new, sumlx)
            suml2 = np.where(accept, sl2_new, suml2)
            changed |= accept
        if not changed.any():
            break
    result = np.where(suml2 > 0, sumlx / suml2, _ZERO)
    result = np.where(zero, _ZERO, result)
    L[:, zero] = 0
    return result, L
