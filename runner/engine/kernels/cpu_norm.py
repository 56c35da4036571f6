"""The residual add and RMSNorm between a layer's blocks on a CPU, by a small C kernel
(``cpu_norm.c``, which says why), built on first use like cpu_attention.c. Where it cannot be
built, ``available()`` is False and the engine's torch path runs."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from core import native
from runner.engine.kernels import C_FLOATS

SOURCE = Path(__file__).with_suffix(".c")


@cache
def _library() -> ctypes.CDLL | None:
    return native.bind(SOURCE, ("-fopenmp",), {"add_rms_norm": [ctypes.c_void_p] * 4 + [
        ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int]})


def available(dtype: torch.dtype) -> bool:
    """Whether the kernel runs for activations of ``dtype`` on this machine."""
    return dtype in C_FLOATS and _library() is not None


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(hidden)``, after ``hidden += delta`` in place where there is a delta, as
    torch computes ``hidden + delta`` and then the norm in the storage type: hidden and delta
    ``[rows, n]``, weight ``[n]``, one dtype, on the CPU."""
    if not (hidden.is_contiguous() and weight.is_contiguous() and (delta is None or delta.is_contiguous())):
        raise ValueError("add_rms_norm: contiguous tensors")
    if delta is not None and (delta.shape != hidden.shape or delta.dtype != hidden.dtype):
        raise ValueError("add_rms_norm: hidden and delta of one shape and dtype")
    out = torch.empty_like(hidden)
    rows, n = hidden.shape
    _library().add_rms_norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                            out.data_ptr(), C_FLOATS[hidden.dtype], rows, n, eps, torch.get_num_threads())
    return out
