"""The part every quantized-checkpoint reader shares (formats/quantized_checkpoint.py): a layout
says which stored tensors one quantized Linear weight is, of which dtypes and shapes, and how they
read back as a ``QuantizedTensor``. Each format's module holds its layouts beside its writer, so a
format is read back by the code that knows how it was written."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from core.errors import InputError
from core.schemes import QuantSpec
from core.tensors import TensorPayload

if TYPE_CHECKING:
    from formats.hf import HFCheckpoint

Expected = dict[str, tuple[torch.dtype | None, tuple[int, ...]]]  # stored name -> dtype (None: any float), shape


class QuantizedLayout:
    """One layout of a quantized checkpoint format, for the weights' ``spec``. ``name`` is the
    layout's name in messages (compressed-tensors' ``format``; the method's otherwise), ``marker``
    the suffix of the stored tensor that marks a module's weight as quantized."""

    name: str
    marker: str

    def __init__(self, spec: QuantSpec):
        self.spec = spec

    def groups(self, n_in: int) -> int:
        return n_in // self.spec.group_size if self.spec.granularity == "group" else 1

    def expected(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> Expected:
        """The stored tensors of the quantized weight ``name`` of ``shape`` ``[out, in]``."""
        raise NotImplementedError

    def check_stored(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> set[str]:
        """The stored tensors of one quantized weight, checked to be of the shapes and dtypes this
        layout gives; returns their names."""
        tensors = self.expected(raw, name, shape)
        for stored, (dtype, expected) in tensors.items():
            if stored not in raw.names:
                raise InputError(f"{raw.path}: no tensor '{stored}' for the quantized weight '{name}'")
            if raw.shape(stored) != expected or (dtype is not None and raw.dtype(stored) != dtype) or \
                    (dtype is None and not raw.dtype(stored).is_floating_point):
                raise InputError(f"{raw.path}: tensor '{stored}' is {raw.dtype(stored)} {list(raw.shape(stored))}; "
                                 f"its {self.name} layout needs {dtype or 'a float'} {list(expected)}")
        return set(tensors)

    def shape(self, raw: HFCheckpoint, name: str) -> tuple[int, ...]:
        """The ``[out, in]`` shape of the quantized weight ``name``, from what is stored."""
        return raw.shape(name)

    def payload(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> TensorPayload:
        """The quantized weight ``name`` of ``shape``: its codes, scales and zero-points (or, for
        a layout our grids do not hold, its float32 values)."""
        raise NotImplementedError
