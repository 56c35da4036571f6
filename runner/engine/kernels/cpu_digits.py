"""The digit rows of an int8 Linear's inputs on a CPU in one pass, by a small C kernel
(``cpu_digits.c``, which says why), built on first use like cpu_attention.c. Where it cannot be
built, ``available()`` is False and Int8Linear's torch path makes them."""

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
    return native.bind(SOURCE, ("-fopenmp",), {"input_digits": [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int]})


def available() -> bool:
    return _library() is not None


def input_digits(x: torch.Tensor, digits: torch.Tensor, scales: torch.Tensor) -> None:
    """Write the digit rows of ``x`` [rows, n] (contiguous) into ``digits`` (uint8 [D, rows, n]) and
    each row's scale into ``scales`` ([rows, 1]: float32 for D = 2, float64 for D = 4, from float32 inputs)."""
    rows, n = x.shape
    _library().input_digits(x.data_ptr(), C_FLOATS[x.dtype], rows, n, digits.shape[0], digits.data_ptr(), scales.data_ptr(),
                            torch.get_num_threads())
