"""What every encoder of this package does with its input before and around the block maths.

The encoders take float32 rows ``x [rows, n_per_row]`` and an optional importance per column, as
``ggml_quantize_chunk`` does; they refuse what llama.cpp would reject or misread (rows that do not
split into blocks, importance of the wrong length, NaN or Inf) instead of writing garbage bytes,
and encode a bounded number of values at a time so that their float32 intermediates stay a small
multiple of a chunk. Blocks are independent, so the bytes never depend on the chunking.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from quant.ggml.numerics import F32


def checked_rows(x: np.ndarray, qw: np.ndarray | None, block: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``x`` as contiguous float32 rows of whole blocks and ``qw`` as float32 ``[n_per_row]``;
    ValueError for anything else, or for NaN or Inf in either."""
    x = np.ascontiguousarray(x, dtype=F32)
    if x.ndim != 2 or x.shape[1] % block:
        raise ValueError(f"expected [rows, n_per_row] with n_per_row a multiple of {block}, got {x.shape}")
    if qw is not None:
        qw = np.ascontiguousarray(qw, dtype=F32)
        if qw.shape != (x.shape[1],):
            raise ValueError(f"importance weights must have shape ({x.shape[1]},), got {qw.shape}")
        if not np.isfinite(qw).all():
            raise ValueError("importance weights contain NaN or Inf")
    if not np.isfinite(x).all():
        raise ValueError("cannot quantize NaN or Inf (llama.cpp rejects the resulting blocks)")
    return x, qw


def encode_by_rows(
    x: np.ndarray, row_bytes: int, chunk_values: int, encode_chunk: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """``encode_chunk`` over chunks of whole rows of about ``chunk_values`` values; uint8 ``[rows, row_bytes]``.

    Division by zero, overflow and NaN happen in ggml too (flat or all-zero blocks, rejected
    candidates, subnormal data); the encoders mask or reproduce their effect instead of avoiding
    them, so numpy's warnings are silenced here.
    """
    out = np.empty((len(x), row_bytes), dtype=np.uint8)
    step = max(1, chunk_values // x.shape[1])
    with np.errstate(all="ignore"):
        for start in range(0, len(x), step):
            chunk = x[start : start + step]
            out[start : start + step] = encode_chunk(chunk).reshape(len(chunk), -1)
    return out
