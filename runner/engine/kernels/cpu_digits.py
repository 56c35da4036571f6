"""The digit rows of an int8 Linear's inputs on a CPU, and the sum of their products, each in one
pass by a small C kernel (``cpu_digits.c``, which says why), built on first use like
cpu_attention.c. Where it cannot be built, ``available()`` is False and Int8Linear's torch path
does both."""

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
    size, kind, pointer = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    return native.bind(SOURCE, ("-fopenmp", "-ffp-contract=off"), {
        "input_digits": [pointer, kind, size, size, kind, pointer, pointer, kind],
        "digit_sums": [pointer, kind, size, size, pointer, pointer, pointer, kind, size, pointer, pointer, pointer, kind, kind]})


def available() -> bool:
    return _library() is not None


def input_digits(x: torch.Tensor, digits: torch.Tensor, scales: torch.Tensor) -> None:
    """Write the digit rows of ``x`` [rows, n] (contiguous) into ``digits`` (uint8 [D, rows, n]) and
    each row's scale into ``scales`` ([rows, 1]: float32 for D = 2, float64 for D = 4, from float32 inputs)."""
    rows, n = x.shape
    _library().input_digits(x.data_ptr(), C_FLOATS[x.dtype], rows, n, digits.shape[0], digits.data_ptr(), scales.data_ptr(),
                            torch.get_num_threads())


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def digit_sums(out: torch.Tensor, digit_offset: torch.Tensor, scales: torch.Tensor, x: torch.Tensor,
               offset: torch.Tensor | None, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """Write into ``y`` [rows, m] (contiguous) ``(Σ_j 128^j out_j - digit_offset) · scales + Σ_k x_k ·
    offset + bias`` from the digits' products ``out`` (float32 [D, rows, m]), in float32 for D = 2
    and float64 for D = 4 (``digit_offset``, ``scales``, ``offset`` and ``bias`` in that type,
    contiguous; ``offset`` and ``bias`` may be None; ``x`` [rows, n] is read only for ``offset``)."""
    digits, rows, m = out.shape
    _library().digit_sums(out.data_ptr(), digits, rows, m, digit_offset.data_ptr(), scales.data_ptr(), x.data_ptr(),
                          C_FLOATS[x.dtype], x.shape[1], _address(offset), _address(bias), y.data_ptr(), C_FLOATS[y.dtype],
                          torch.get_num_threads())
