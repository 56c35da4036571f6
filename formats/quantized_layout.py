"""The part every quantized-checkpoint reader shares (formats/quantized_checkpoint.py): a layout
says which stored tensors one quantized Linear weight is, of which dtypes and shapes, and how they
read back as a ``QuantizedTensor``. Each format's module holds its layouts beside its writer, so a
format is read back by the code that knows how it was written."""

from __future__ import annotations

from collections.abc import Callable
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

    @property
    def label(self) -> str:
        """The grid, for a report: ``int4-g128-asym``."""
        return self.spec.label

    def for_weight(self, name: str) -> "QuantizedLayout":
        """The layout that holds the quantized weight ``name``: this one, unless the file mixes grids."""
        return self

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


class MixedLayout(QuantizedLayout):
    """Linears on several grids in one file (``bits: auto``: compressed-tensors' config groups,
    GPTQModel's ``dynamic``): each quantized weight read by the first layout whose rule matches its
    module's name. Every layout is of one format, so they share ``name`` and ``marker``."""

    def __init__(self, rules: list[tuple[Callable[[str], bool], QuantizedLayout]], where: str):
        first = rules[0][1]
        super().__init__(first.spec)
        self.name, self.marker, self._rules, self._where = first.name, first.marker, rules, where

    @property
    def label(self) -> str:
        grids = dict.fromkeys(layout.spec.label for _, layout in self._rules)
        return "mixed " + " + ".join(grids)

    def for_weight(self, name: str) -> QuantizedLayout:
        module = name.removesuffix(".weight")
        layout = next((layout for matches, layout in self._rules if matches(module)), None)
        if layout is None:
            raise InputError(f"{self._where}: the quantized weight '{name}' is in none of the file's grids")
        return layout
