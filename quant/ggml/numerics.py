"""ggml's float32 arithmetic as numpy reproduces it, for every encoder of this package.

Byte-exact encoders must round, sum and store exactly as ggml's C code does (docs:
gguf-kquants.md §1): every intermediate is float32 (constants are wrapped in ``F32``), each sum ggml
computes in a loop is accumulated in that order, rounding is ggml's ``nearest_int`` (``np.rint``
where that is provably the same), and fp16 fields are stored rounded to nearest even. The helpers
here are those rules, written once.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
ZERO = F32(0.0)
GROUP_MAX_EPS = F32(1e-15)  # ggml's GROUP_MAX_EPS: a group whose largest |x| is below this is all zero
# |v| up to which np.rint is ggml's nearest_int (4194303), less a margin for the rounding of the
# bounds that are checked against it.
REACH_LIMIT = 4.19e6
_ROUND_MAGIC = F32(12582912.0)  # 1.5·2^23, the constant of ggml's nearest_int


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``, bit for bit, as float32: round half to even by adding 1.5·2^23.

    Equal to ``np.rint`` for |v| <= 4194303; beyond that (and for inf/NaN, which ggml meets when a
    scale overflows on subnormal data or a greedy step divides by a sum that underflowed) it
    returns the same garbage the C code does, which later clamps and stores turn into ggml's bytes.
    """
    bits = (v + _ROUND_MAGIC).view(np.int32)
    return ((bits & 0x007FFFFF) - 0x00400000).astype(F32)


def seqsum(t: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Left-to-right float32 sum over axis 0 from ``0.0f``, the order of ggml's loops.

    ``np.sum`` is pairwise, but ``np.add.reduce`` over the outer axis of a C-contiguous array adds
    whole rows into an accumulator that starts at +0 one after another, so every group's sum is
    sequential, in one call. numpy drops a length-1 axis, though, and would then reduce along
    memory, pairwise: a single group takes ``accumulate``, sequential by definition, plus the
    ``0.0f`` it starts from (which turns an all-(−0.0) sum into +0.0, as in C).
    """
    t = np.ascontiguousarray(t)
    if t.size > len(t):
        return np.add.reduce(t, axis=0, out=out)
    total = np.add.accumulate(t, axis=0)[-1] + ZERO
    if out is None:
        return total
    out[...] = total
    return out


def seqsum_from_first(t: np.ndarray) -> np.ndarray:
    """Left-to-right float32 sum over axis 0 that starts at the first term, for the sums ggml
    initialises with it (``sum_w = weights[0]``): an all-(−0.0) sum stays −0.0."""
    acc = t[0].copy()
    for term in t[1:]:
        acc += term
    return acc


def first_absmax(x: np.ndarray) -> np.ndarray:
    """Over axis 0: the first element of largest magnitude, with its sign (ggml's strict ``>`` scan)."""
    amax = np.abs(x[0])
    mx = x[0].copy()
    for xi in x[1:]:
        ax = np.abs(xi)
        bigger = ax > amax
        np.copyto(amax, ax, where=bigger)
        np.copyto(mx, xi, where=bigger)
    return mx


def first_min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``if (x < min) min = x`` / ``if (x > max) max = x`` scans over axis 0 from x[0].

    Unlike ``np.min``, this keeps the first of equal values, so the sign of a zero minimum (which
    becomes the stored fp16 offset of a Q4_1/Q5_1 block) is ggml's.
    """
    mn = x[0].copy()
    mx = x[0].copy()
    for xi in x[1:]:
        np.copyto(mn, xi, where=xi < mn)
        np.copyto(mx, xi, where=xi > mx)
    return mn, mx


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """A float32 field ``[...]`` as the 2 little-endian fp16 bytes ggml stores, ``[..., 2]``."""
    return v.astype("<f2").view(np.uint8).reshape(*v.shape, 2)


def fp16r(v: np.ndarray) -> np.ndarray:
    """The value a stored fp16 field reads back as (ggml requantizes against the stored scale)."""
    return v.astype(np.float16).astype(F32)


def wrap_u8(v: np.ndarray) -> np.ndarray:
    """An integer-valued float array as C stores it in a ``uint8_t`` (modulo 256)."""
    return np.mod(v, F32(256))


def element_major(x: np.ndarray, group: int) -> np.ndarray:
    """``[rows, n]`` -> ``[group, rows, n/group]``: element i of every group is one contiguous
    slice, so a sequential sum over a group is a loop over slices, vectorised across all groups."""
    rows, n = x.shape
    return np.ascontiguousarray(x.reshape(rows, n // group, group).transpose(2, 0, 1))


def importance(qw: np.ndarray, x: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """llama.cpp's search weights with an importance matrix: ``qw·sqrt(sigma2 + x²)``.

    ``sigma2`` (a mean square of the data around x) keeps a little weight on every element, so a
    column the importance matrix calls unimportant still counts where its value is large.
    """
    return qw * np.sqrt(sigma2 + x * x)
