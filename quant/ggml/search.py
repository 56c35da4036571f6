"""ggml's weighted scale searches, vectorised over every group of a chunk at once.

Each encoder fits its groups (sub-blocks, or the legacy 32-blocks) with one of these: the symmetric
search ``make_qx_quants`` (x ≈ scale·l), the affine searches ``make_qkx2_quants`` /
``make_qkx3_quants`` (x ≈ scale·L − offset) and ``make_qp_quants`` for quantizing non-negative
sub-block scales. They are written once here, with the few differences between ggml's variants as
arguments. Arrays are element-major: ``x [n, *groups]``, so a sequential sum over a group is one
``seqsum`` over axis 0; Python loops only over search steps (and elements, where a pass element by
element keeps the working set in cache).
"""

from __future__ import annotations

import numpy as np

from quant.ggml.numerics import (
    F32,
    GROUP_MAX_EPS,
    REACH_LIMIT,
    ZERO,
    first_absmax,
    first_min_max,
    nearest_int,
    seqsum,
    seqsum_from_first,
    wrap_u8,
)

_MIN_GAP = 1e-30  # a group range below which iscale = num/range might overflow float32


def signed_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What a symmetric search divides by: each group's first largest-magnitude value, with its
    sign, and which groups are all zero (largest |x| below 1e-15). Those get 1, so that they round
    to l = 0 and a scale of 0 instead of dividing by zero."""
    amax_x = first_absmax(x)
    zero = np.abs(amax_x) < GROUP_MAX_EPS
    return np.where(zero, F32(1), amax_x), zero


def symmetric_search(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qx_quants`` (rmse_type 1) over every group: x ≈ scale·l, l in [−nmax, nmax − 1].

    ``x`` is ``[n, *groups]`` and ``w`` broadcasts to it. The first guess maps the largest-magnitude
    element to −nmax; 18 more candidate inverse scales ``−(nmax + 0.1·s)/max`` replace it when they
    raise ``sumlx²/suml2`` (least weighted squared error). Only the winning inverse scale is kept
    and its quants recomputed once at the end with the same float operations, which is cheaper than
    copying them at every step. Returns the scale per group and ``L = l + nmax`` (float32), or 0
    and L = 0 for a group whose largest |x| is below 1e-15 (all zero).
    """
    mx, zero = signed_max(x)
    wx = w * x  # ggml's w*x[i]*l is (w·x)·l
    lo, hi = F32(-nmax), F32(nmax - 1)
    l = np.empty(mx.shape, dtype=F32)
    t = np.empty(mx.shape, dtype=F32)

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Element by element, so the working set is a few group-sized vectors that stay in cache.
        # |iscale·x| <= nmax + 0.9 (the largest |x| sets iscale), so np.rint is nearest_int here.
        sumlx = np.zeros(mx.shape, dtype=F32)
        suml2 = np.zeros(mx.shape, dtype=F32)
        for i in range(len(x)):
            np.multiply(iscale, x[i], out=l)
            np.rint(l, out=l)
            np.clip(l, lo, hi, out=l)
            np.multiply(w[i], l, out=t)
            np.multiply(t, l, out=t)  # (w·l)·l
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


def affine_search(
    x: np.ndarray,
    w: np.ndarray,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
    guarded: bool,
    signed_zeros: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``make_qkx2_quants`` / ``make_qkx3_quants``: fit x ≈ scale·L − off, L in [0, nmax].

    ``x``, ``w`` are [n, *groups]; returns (scale, off, L). Each candidate ``iscale`` is tried with
    the offset of the best fit so far, and a candidate is kept only if its weighted error is
    strictly lower, so the steps must run in order. ``guarded`` selects qkx3's candidate rounding
    (``v > 0 ? nearest_int(min(v, nmax)) : 0``) over qkx2's clamp-after-rounding; they differ only
    where the best offset sits at or near the group's max and ``v`` leaves nearest_int's range.
    ``signed_zeros`` keeps the sign of every zero ggml's where it can reach a stored field: the
    first of equal extremes, and ``sum_w``, ``sum_x`` started at their first term as ggml does.
    The legacy types need it, as they store the offset itself; the K-quants quantize it again.

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
    nmax_f = F32(nmax)
    if signed_zeros:
        mn, mx = first_min_max(x)
        sum_w, sum_x = seqsum_from_first(w), seqsum_from_first(w * x)
    else:
        mn, mx = x.min(axis=0), x.max(axis=0)
        sum_w, sum_x = seqsum(w), seqsum(w * x)
    mn[mn > 0] = 0
    flat = mx == mn
    gap = mx - mn  # mx − offset, the divisor of every iscale
    gap[flat] = np.inf
    bound = _ReachBound(float(np.min(gap)))

    L = np.empty_like(x)
    wl = np.empty_like(x)
    t = np.empty_like(x)
    fit = np.empty((4, len(mn)), dtype=F32)
    best, scale, win_iscale, win_shift = fit
    cand = np.empty_like(fit)
    err, this_scale, iscale, cur_min = cand
    np.divide(nmax_f, gap, out=win_iscale)
    np.divide(F32(1), win_iscale, out=scale)
    win_shift[:] = mn
    _levels(x, win_iscale, mn, nmax_f, False, L, bound.spans(nmax_f, mn, mn, mx, flat))
    _weighted_error(L, scale, mn, x, w, use_mad, t, out=best)
    won = np.zeros(len(mn), dtype=bool)
    cur_min[:] = mn
    for step in range(nstep + 1):
        num = F32(rmin) + F32(rdelta) * F32(step) + nmax_f
        np.divide(num, gap, out=iscale)
        _levels(x, iscale, cur_min, nmax_f, guarded, L, bound.spans(num, cur_min, mn, mx, flat))
        np.multiply(w, L, out=wl)
        sum_l = seqsum(wl)
        sum_l2 = seqsum(np.multiply(wl, L, out=t))
        wl *= x
        sum_xl = seqsum(wl)
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
    (to a few float32 roundings, which the margin of ``REACH_LIMIT`` covers) as long as num/gap
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
        if float(num) * self.ratio <= REACH_LIMIT and self.min_gap >= _MIN_GAP:
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
    np.clip(out, ZERO, nmax, out=out)
    np.rint(out, out=out)
    if span is None:
        return
    unsafe = ~(np.abs(iscale) * span <= REACH_LIMIT)
    if unsafe.any():
        v = (x[:, unsafe] - shift[unsafe]) * iscale[unsafe]
        plain = np.clip(nearest_int(v), 0, nmax)
        guard = np.where(v > 0, nearest_int(np.minimum(v, nmax)), ZERO)
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
    return seqsum(work, out)


def qp_quants(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qp_quants``: quantize non-negative values [n, B] to [0, nmax] without offset.

    Used on the sub-block scales and mins of the importance-matrix paths, weighted by the sub-block
    weight sums. Returns (scale [B], L [n, B]); L holds what C's ``uint8_t`` array holds, wrapped
    where a negative value was stored, and the greedy passes read it back that way.
    """
    nmax_f = F32(nmax)
    mx = x.max(axis=0)
    mx = np.where(mx > 0, mx, ZERO)
    zero = mx < GROUP_MAX_EPS
    iscale = nmax_f / mx
    scale0 = F32(1) / iscale
    diff = x - scale0 * wrap_u8(nearest_int(iscale * x))
    best = seqsum(w * diff * diff)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_s = (F32(0.1) * F32(step) + nmax_f) / mx
        scale_s = F32(1) / iscale_s
        diff = x - scale_s * np.minimum(nearest_int(iscale_s * x), nmax_f)
        mse = seqsum(w * diff * diff)
        better = mse < best
        best = np.where(better, mse, best)
        iscale = np.where(better, iscale_s, iscale)
    l = np.minimum(nearest_int(iscale * x), nmax_f)
    L = wrap_u8(l)
    wx = w * x
    sumlx = seqsum(wx * l)
    suml2 = seqsum(w * l * l)
    for _ in range(5):
        changed = np.zeros(mx.shape, dtype=bool)
        for i in range(len(x)):
            slx = sumlx - wx[i] * L[i]
            sl2 = suml2 - w[i] * L[i] * L[i]
            new_l = np.minimum(nearest_int(x[i] * sl2 / slx), nmax_f)
            slx_new = slx + wx[i] * new_l
            sl2_new = sl2 + w[i] * new_l * new_l
            accept = (slx > 0) & (sl2 > 0) & (new_l != L[i])
            accept &= slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new
            L[i] = np.where(accept, wrap_u8(new_l), L[i])
            sumlx = np.where(accept, slx_new, sumlx)
            suml2 = np.where(accept, sl2_new, suml2)
            changed |= accept
        if not changed.any():
            break
    result = np.where(suml2 > 0, sumlx / suml2, ZERO)
    result = np.where(zero, ZERO, result)
    L[:, zero] = 0
    return result, L
