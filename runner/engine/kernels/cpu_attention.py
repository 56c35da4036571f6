"""Decode attention over the paged KV cache on a CPU, by a small C kernel (``cpu_attention.c``).

torch's path (``model.py``) gathers every decoding sequence's blocks into one batch each layer and
scores them with many small matrix products; on a CPU that was about half of a step at 16
sequences (the issue 35 profile). The C kernel reads each key and value where it lies, through the
block table, as the GPU's Triton kernel does.

It is compiled on first use for the machine it runs on and loaded with ctypes (core/native.py).
OpenMP comes from the libgomp torch has already loaded (the same soname), so the kernel's threads
are torch's. Where no compiler works, ``available()`` is False and the torch path runs.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from core import native
from runner.engine.kernels import C_FLOATS

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-fopenmp",)  # beside core.native.BASE_FLAGS
_i64, _f32 = ctypes.c_int64, ctypes.c_float
_ARGS = [ctypes.c_void_p] * 3 + [ctypes.c_int] + [_i64] * 6 + [ctypes.c_void_p, _i64, ctypes.c_void_p, ctypes.c_void_p] \
    + [ctypes.c_int] * 7 + [_f32, ctypes.c_int, _f32, ctypes.c_int]


@cache
def _library() -> ctypes.CDLL | None:
    return native.bind(SOURCE, FLAGS, {"paged_decode_attention": _ARGS})


def available(cache_dtype: torch.dtype, head_sizes: tuple[int, int] = (64, 64)) -> bool:
    """Whether the kernel runs over a cache stored as ``cache_dtype`` with keys and values of
    ``head_sizes`` on this machine (it computes on vectors of 16 floats)."""
    return cache_dtype in C_FLOATS and all(size % 16 == 0 for size in head_sizes) and _library() is not None


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Attention outputs, float32 ``[seqs, m, heads, value_dim]``, of ``q`` ``[seqs, m, heads, dim]``
    over one layer's ``keys`` ``[blocks, kv_heads, block_size, dim]`` and ``values`` (``value_dim``):
    sequence ``s`` reads blocks ``table[s, :]`` and its row ``r`` sees its first ``lengths[s, r]``
    positions (the last ``window`` of them where there is a window). The GPU kernel's contract."""
    seqs, m, heads, dim = q.shape
    _, kv, block, _ = keys.shape
    vdim = values.shape[-1]
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or keys.dtype != values.dtype or dim % 16 or vdim % 16:
        raise ValueError("keys and values: one float dtype, each row contiguous, head sizes multiples of 16")
    q = q.to(torch.float32).contiguous()
    table, lengths = table.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    out = torch.empty(seqs, m, heads, vdim, dtype=torch.float32)
    _library().paged_decode_attention(
        q.data_ptr(), keys.data_ptr(), values.data_ptr(), C_FLOATS[keys.dtype], *keys.stride()[:3], *values.stride()[:3],
        table.data_ptr(), table.shape[1], lengths.data_ptr(), out.data_ptr(),
        seqs, m, heads, kv, dim, vdim, block, scale, window or 0, softcap or 0.0, torch.get_num_threads())
    return out
