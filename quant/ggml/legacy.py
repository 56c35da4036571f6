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

from collections.abc import Callable

import numpy as np

QK = 32  # elements per block
_F32 = np.float32
_ZERO = _F32(0.0)
_GROUP_MAX_EPS = _F32(1e-15)  # ggml's GROUP_MAX_EPS: a block whose absmax is below this is all zero
_ROUND_MAGIC = _F32(12582912.0)  # 1.5·2^23, the constant of ggml's nearest_int
_ROUND_SAFE = _F32(4.19e6)  # below ggml's 4194303 limit, with room for rounding in the bound
# Input values per chunk (1 MB per float32 work array): big enough that per-block bookkeeping is
# cheap next to the full-array passes, small enough that the work arrays stay near the CPU caches.
_CHUNK_ELEMENTS = 1 << 18

Encoder = Callable[[np.ndarray, np.ndarray], np.ndarray]


def quantize_q4_0(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Q4_0 bytes (18 per 32 values) of ``x [rows, n_per_row]`` with importance ``qw [n_per_row]``."""
    return _quantize(x, qw, 18, _encode_q4_0)


def quantize_q4_1(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Q4_1 bytes (20 per 32 values) of ``x [rows, n_per_row]`` with importance ``qw [n_per_row]``."""
    return _quantize(x, qw, 20, _encode_q4_1)


def quantize_q5_0(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Q5_0 bytes (22 per 32 values) of ``x [rows, n_per_row]`` with importance ``qw [n_per_row]``."""
    return _quantize(x, qw, 22, _encode_q5_0)


def quantize_q5_1(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Q5_1 bytes (24 per 32 values) of ``x [rows, n_per_row]`` with importance ``qw [n_per_row]``."""
    return _quantize(x, qw, 24, _encode_q5_1)


def q4_0_from_levels(levels: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q4_0 bytes of a grid chosen elsewhere (quantization-aware training): ``levels [rows, n]``
    in 0..15 with one scale ``d [rows, n/32]`` per block, the value of each ``(q − 8)·d``, stored as
    they are rather than searched again."""
    rows, n = levels.shape
    blocks = _element_major(levels.astype(np.uint8))
    return np.concatenate([_f16_bytes(np.asarray(d, dtype=_F32)), _nibbles(blocks)], axis=2).reshape(rows, -1)


# ------------------------------------------------------------------------------------------------
# Driver


def _quantize(x: np.ndarray, qw: np.ndarray, block_bytes: int, encode: Encoder) -> np.ndarray:
    """Validate, then encode chunks of rows; ``encode`` gets element-major data and weights."""
    x = np.ascontiguousarray(x, dtype=_F32)
    if x.ndim != 2 or x.shape[1] % QK:
        raise ValueError(f"expected [rows, n_per_row] with n_per_row a multiple of {QK}, got {x.shape}")
    rows, n = x.shape
    qw = np.ascontiguousarray(qw, dtype=_F32)
    if qw.shape != (n,):
        raise ValueError(f"importance weights must have shape ({n},), got {qw.shape}")
    if not (np.isfinite(x).all() and np.isfinite(qw).all()):
        raise ValueError("cannot quantize NaN or Inf (llama.cpp rejects the resulting blocks)")
    qw_e = _element_major(qw[None, :])  # [32, 1, blocks]: the weights of every row's blocks
    out = np.empty((rows, n // QK * block_bytes), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // n)
    # Division by zero, overflow and NaN happen in ggml too (flat or all-zero blocks, rejected
    # candidates, subnormal data); the encoders mask or reproduce their effect.
    with np.errstate(all="ignore"):
        for start in range(0, rows, step):
            chunk = x[start:start + step]
            xe = _element_major(chunk)
            out[start:start + step] = encode(xe, _weights(chunk, xe, qw_e)).reshape(len(chunk), -1)
    return out


def _element_major(x: np.ndarray) -> np.ndarray:
    """``[rows, n]`` -> ``[32, rows, n/32]``: element i of every block is one contiguous slice."""
    rows, n = x.shape
    return np.ascontiguousarray(x.reshape(rows, n // QK, QK).transpose(2, 0, 1))


def _weights(rows: np.ndarray, xe: np.ndarray, qw_e: np.ndarray) -> np.ndarray:
    """``qw·sqrt(sigma2 + x²)`` with ``sigma2 = Σx²/n_per_row`` over each whole row.

    ggml sums x² left to right along the row; ``np.cumsum`` accumulates sequentially in float32
    (unlike ``np.sum``, which is pairwise), so its last column is that sum.
    """
    n = rows.shape[1]
    sigma2 = np.cumsum(rows * rows, axis=1, dtype=_F32)[:, -1] / _F32(n)
    return qw_e * np.sqrt(sigma2[None, :, None] + xe * xe)


# ------------------------------------------------------------------------------------------------
# Encoders: search, then pack (§2 block layouts)


def _encode_q4_0(xe: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Q4_0 block: fp16 d, then nibbles (element j low, j + 16 high); value (q − 8)·d."""
    d, L = _symmetric_search(xe, w, 8)
    return np.concatenate([_f16_bytes(d), _nibbles(L)], axis=2)


def _encode_q5_0(xe: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Q5_0 block: fp16 d, uint32 of 5th bits, low nibbles; value (q − 16)·d."""
    d, L = _symmetric_search(xe, w, 16)
    return np.concatenate([_f16_bytes(d), _high_bits(L), _nibbles(L)], axis=2)


def _encode_q4_1(xe: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Q4_1 block: fp16 d, fp16 m, nibbles; value d·q + m."""
    d, m, L = _affine_search(xe, w, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(m), _nibbles(L)], axis=2)


def _encode_q5_1(xe: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Q5_1 block: fp16 d, fp16 m, uint32 of 5th bits, low nibbles; value d·q + m."""
    d, m, L = _affine_search(xe, w, 31)
    return np.concatenate([_f16_bytes(d), _f16_bytes(m), _high_bits(L), _nibbles(L)], axis=2)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """A float32 field ``[rows, blocks]`` as the 2 little-endian fp16 bytes ggml stores."""
    return v.astype("<f2").view(np.uint8).reshape(*v.shape, 2)


def _nibbles(L: np.ndarray) -> np.ndarray:
    """Quants ``[32, rows, blocks]`` as 16 bytes per block: low 4 bits of j and j + 16."""
    q = L.transpose(1, 2, 0)
    return (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)


def _high_bits(L: np.ndarray) -> np.ndarray:
    """The 5th bit of element j as bit j of a little-endian uint32 (4 bytes per block)."""
    bits = ((L.transpose(1, 2, 0) >> 4) & 1).astype(np.uint32)
    qh = np.bitwise_or.reduce(bits << np.arange(QK, dtype=np.uint32), axis=2)
    return qh.astype("<u4").view(np.uint8).reshape(*qh.shape, 4)


# ------------------------------------------------------------------------------------------------
# Numerics


def _seqsum(t: np.ndarray, from_zero: bool = True) -> np.ndarray:
    """Left-to-right float32 sum over axis 0, the order of ggml's loops (``np.sum`` is pairwise).

    ggml's accumulators mostly start at ``0.0f``, which turns an all-(−0.0) sum into +0.0; doing
    the same keeps the sign of every zero sum ggml's. ``from_zero=False`` is for the two sums
    (``sum_w``, ``sum_x`` of ``make_qkx3_quants``) that ggml starts at their first term.
    """
    acc = t[0] + _ZERO if from_zero else t[0].copy()
    for i in range(1, len(t)):
        acc += t[i]
    return acc


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int`` bit for bit, as float32: add 1.5·2^23 and read the mantissa.

    Equal to ``np.rint`` for |v| <= 4194303; beyond that, and for inf/NaN, it is the same garbage
    the C code computes, which the following clamp turns into ggml's bytes.
    """
    bits = (v + _ROUND_MAGIC).view(np.int32)
    return ((bits & 0x007FFFFF) - 0x00400000).astype(_F32)


def _first_absmax(x: np.ndarray) -> np.ndarray:
    """The first element of largest magnitude per block, with its sign (ggml's strict scan)."""
    amax = np.abs(x[0])
    mx = x[0].copy()
    for i in range(1, len(x)):
        ax = np.abs(x[i])
        bigger = ax > amax
        np.copyto(amax, ax, where=bigger)
        np.copyto(mx, x[i], where=bigger)
    return mx


def _symmetric_search(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qx_quants`` with weights: fit x ≈ scale·l, l in [−nmax, nmax − 1].

    Returns the scale ``[rows, blocks]`` and the quants ``L = l + nmax`` (uint8, [32, ...]). The
    first guess maps the largest-magnitude element to −nmax; 18 more candidate inverse scales
    ``−(nmax + 0.1·s)/max`` replace it when they raise ``sumlx²/suml2``. Only the winning inverse
    scale is remembered, and the quants are recomputed from it once at the end with the same float
    operations, which is cheaper than copying them at every step. A block whose absmax is below
    1e-15 is all zero: quants 0 (not nmax) and scale 0.
    """
    nmax_f = _F32(nmax)
    mx = _first_absmax(x)
    zero = np.abs(mx) < _GROUP_MAX_EPS
    wx = w * x  # ggml's w*x[i]*l is (w·x)·l
    l = np.empty_like(x)
    t = np.empty_like(x)

    def candidate(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _signed_levels(x, iscale, nmax_f, l)
        np.multiply(wx, l, out=t)
        sumlx = _seqsum(t)
        np.multiply(w, l, out=t)
        np.multiply(t, l, out=t)  # (w·l)·l
        return sumlx, _seqsum(t)

    win = -nmax_f / mx
    sumlx, suml2 = candidate(win)
    scale = np.where(suml2 != 0, sumlx / suml2, _ZERO)
    best = scale * sumlx
    for s in (-9, -8, -7, -6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9):
        iscale = -(nmax_f + _F32(0.1) * _F32(s)) / mx
        sumlx, suml2 = candidate(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
        win = np.where(better, iscale, win)
    _signed_levels(x, win, nmax_f, l)
    L = (l + nmax_f).astype(np.uint8)
    L[:, zero] = 0
    return np.where(zero, _ZERO, scale), L


def _signed_levels(x: np.ndarray, iscale: np.ndarray, nmax: np.float32, out: np.ndarray) -> None:
    """``clamp(nearest_int(iscale·x), −nmax, nmax − 1)`` into ``out``.

    |iscale·x| <= nmax + 0.9 wherever the block is not all zero (the largest |x| sets iscale), so
    ``np.rint`` is exactly ggml's nearest_int here; all-zero blocks are discarded by the caller.
    """
    np.multiply(x, iscale, out=out)
    np.rint(out, out=out)
    np.clip(out, -nmax, nmax - _F32(1), out=out)


def _strict_min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``if (x < min) min = x`` / ``if (x > max) max = x`` scans from x[0].

    Unlike ``np.min``, this keeps the first of equal values, so the sign of a zero minimum (which
    becomes the stored fp16 offset of a Q4_1/Q5_1 block) is ggml's.
    """
    mn = x[0].copy()
    mx = x[0].copy()
    for i in range(1, len(x)):
        np.copyto(mn, x[i], where=x[i] < mn)
        np.copyto(mx, x[i], where=x[i] > mx)
    return mn, mx


def _affine_search(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``make_qkx3_quants`` (rmin −0.9, rdelta 0.05, 37 steps, squared error).

    Fits x ≈ scale·L + min with L in [0, nmax] and min <= 0. Returns (scale, min, L uint8); the
    caller stores ``fp16(scale)`` and ``fp16(min)`` (ggml's ``-the_min``). Each candidate inverse
    scale ``(rmin + rdelta·s + nmax)/(max − min)`` is tried against the offset of the best fit so
    far, and kept only if its weighted squared error is strictly lower, so steps run in order.
    As in ``_symmetric_search``, only the winner's inverse scale and offset are remembered and its
    quants recomputed at the end. A block with max <= min (after min is raised to 0 if positive)
    is flat: quants 0, scale 0, offset its min.
    """
    nmax_f = _F32(nmax)
    mn, mx = _strict_min_max(x)
    mn = np.where(mn > 0, _ZERO, mn)
    flat = mx <= mn
    sum_w = _seqsum(w, from_zero=False)
    sum_x = _seqsum(w * x, from_zero=False)
    L = np.empty_like(x)
    v = np.empty_like(x)
    t = np.empty_like(x)

    iscale = nmax_f / (mx - mn)
    scale = _F32(1) / iscale
    _affine_levels(x, iscale, mn, mn, mx, nmax_f, v, L)
    best = _seqsum(_weighted_sq_error(L, scale, mn, x, w, t))
    win_iscale, win_shift = iscale, mn
    cur_min = mn
    for s in range(37):
        iscale = (_F32(-0.9) + _F32(0.05) * _F32(s) + nmax_f) / (mx - cur_min)
        _affine_levels(x, iscale, cur_min, mn, mx, nmax_f, v, L)
        np.multiply(w, L, out=v)  # w·l, reused for all three sums
        sum_l = _seqsum(v)
        np.multiply(v, L, out=t)
        sum_l2 = _seqsum(t)
        np.multiply(v, x, out=t)
        sum_xl = _seqsum(t)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        positive = this_min > 0
        this_min = np.where(positive, _ZERO, this_min)
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        err = _seqsum(_weighted_sq_error(L, this_scale, this_min, x, w, t))
        better = (D > 0) & (err < best) & ~flat
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        win_iscale = np.where(better, iscale, win_iscale)
        win_shift = np.where(better, cur_min, win_shift)
        cur_min = np.where(better, this_min, cur_min)
    _affine_levels(x, win_iscale, win_shift, mn, mx, nmax_f, v, L)
    L[:, flat] = 0
    return np.where(flat, _ZERO, scale), cur_min, L.astype(np.uint8)


def _affine_levels(
    x: np.ndarray,
    iscale: np.ndarray,
    shift: np.ndarray,
    mn: np.ndarray,
    mx: np.ndarray,
    nmax: np.float32,
    v: np.ndarray,
    out: np.ndarray,
) -> None:
    """Quants ``clamp(nearest_int(iscale·(x − shift)), 0, nmax)`` of one candidate, into ``out``.

    ``np.rint`` is ggml's nearest_int only while |v| <= 4194303, and |v| is bounded per block by
    |iscale|·(largest |x − shift|). The rare blocks past that (an iscale overflowing on subnormal
    data, or a best offset that landed next to the block's max, which sparse importance weights
    can cause) are redone bit for bit. The llama.cpp we are checked against rounds every step this
    way, with no ``v > 0 ? nearest_int(min(v, nmax)) : 0`` guard (tested with such blocks).
    """
    np.subtract(x, shift, out=v)
    v *= iscale
    np.rint(v, out=out)
    np.clip(out, _ZERO, nmax, out=out)
    reach = np.abs(iscale) * np.maximum(mx - shift, shift - mn)
    unsafe = ~(reach <= _ROUND_SAFE)
    if unsafe.any():
        np.copyto(out, np.clip(_nearest_int(v), _ZERO, nmax), where=unsafe)


def _weighted_sq_error(
    L: np.ndarray, scale: np.ndarray, mn: np.ndarray, x: np.ndarray, w: np.ndarray, out: np.ndarray
) -> np.ndarray:
    """Per-element ``w·((scale·L + mn) − x)²`` into ``out``, in ggml's operation order."""
    np.multiply(L, scale, out=out)
    out += mn
    out -= x
    out *= out
    out *= w
    return out
