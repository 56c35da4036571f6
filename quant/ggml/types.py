"""The ggml types we encode, one class each, registered by their ggml name.

As in gguf-py's ``gguf/quants.py``: a base class whose ``__init_subclass__`` registers every
subclass given a ``qtype``, and one class per type saying how its rows are encoded and what
llama.cpp's quantizer takes for it. ``quant.ggml.encode`` looks types up here and nowhere else, so
adding a type is one class (docs/extending.md). The float types, Q8_0, TQ1_0, TQ2_0 and MXFP4 come
from gguf-py, which is byte-exact for them (tests/test_iquants.py pins the last three); the
families we port ourselves define their classes beside their encoders (``kquant_affine``,
``kquant_symmetric``, ``legacy``, ``iquant_nl``, ``iquant_lattice``), and importing ``quant.ggml`` registers them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from core.errors import InputError
from quant.ggml.rows import checked_rows

_TYPES: dict[str, type[GGMLType]] = {}


class GGMLType:
    """One ggml type: its block shape and how rows ``[n, width]`` become its bytes.

    ``quantize`` returns ``[n, row bytes]`` uint8 (float arrays for F32, F16 and BF16, which GGUF
    stores as such). The default is gguf-py's quantizer, which is llama.cpp's reference encoder.
    """

    qtype: ClassVar[GGMLQuantizationType]
    name: ClassVar[str]
    block_size: ClassVar[int]  # values per block
    type_size: ClassVar[int]  # bytes per block
    # Whether llama.cpp's quantizer reads an importance matrix for this type; where it does not,
    # ``encode`` drops one, so that it never changes the bytes.
    takes_imatrix: ClassVar[bool] = False
    # Whether ``quantize`` is slow enough to be worth splitting across worker processes.
    parallel: ClassVar[bool] = False

    def __init_subclass__(cls, qtype: GGMLQuantizationType | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if qtype is None:  # a family's base class
            return
        if qtype.name in _TYPES:
            raise TypeError(f"ggml type {qtype.name} is registered twice ({_TYPES[qtype.name].__qualname__}, {cls.__qualname__})")
        cls.qtype, cls.name = qtype, qtype.name
        cls.block_size, cls.type_size = GGML_QUANT_SIZES[qtype]
        _TYPES[qtype.name] = cls

    @classmethod
    def quantize(cls, rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """The encoding of float32 ``rows [n, width]`` (gguf-py's; it takes no importance matrix)."""
        return gguf_quantize(rows, cls.qtype)


def type_named(name: str) -> type[GGMLType]:
    """The registered class of a ggml type name ("Q4_K"); InputError for a type we do not encode."""
    try:
        return _TYPES[name]
    except KeyError:
        raise InputError(f"ggml type {name!r} cannot be encoded; known: {', '.join(_TYPES)}") from None


def type_names() -> tuple[str, ...]:
    """The names of every registered ggml type, in registration order."""
    return tuple(_TYPES)


class PortedType(GGMLType):
    """A type whose encoder is our byte-exact port of llama.cpp's: it reads an importance matrix,
    and it is slow enough (a weighted search per group) to be worth worker processes.

    Every ported family takes its input the same way, so ``quantize`` checks it here, once; the
    family's ``encode_rows`` then encodes the checked rows chunk by chunk in its own layout.
    """

    takes_imatrix = True
    parallel = True
    # float32 rows [n, width] of whole blocks and importance [width] or None -> [n, row bytes]
    encode_rows: ClassVar[Callable[[np.ndarray, np.ndarray | None], np.ndarray]]

    @classmethod
    def quantize(cls, rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """``[n, row bytes]`` of float32 ``rows [n, width]``, as ``ggml_quantize_chunk`` writes them,
        weighted by ``imatrix [width]`` if given; ValueError for what llama.cpp would reject."""
        x, qw = checked_rows(rows, imatrix, cls.block_size)
        return cls.encode_rows(x, qw)


class F32(GGMLType, qtype=GGMLQuantizationType.F32):
    """Stored as is."""


class F16(GGMLType, qtype=GGMLQuantizationType.F16):
    """Rounded to half precision."""


class BF16(GGMLType, qtype=GGMLQuantizationType.BF16):
    """The upper half of each float32, rounded to nearest even."""


class Q8_0(GGMLType, qtype=GGMLQuantizationType.Q8_0):
    """32 int8 values and an fp16 scale per block; llama.cpp ignores an importance matrix for it."""


class TQ1_0(GGMLType, qtype=GGMLQuantizationType.TQ1_0):
    """Ternary (−1, 0, 1 times the super-block's largest |x|, fp16): five trits a byte, 1.69 bits
    per weight; llama.cpp ignores an importance matrix for it."""


class TQ2_0(GGMLType, qtype=GGMLQuantizationType.TQ2_0):
    """Ternary as TQ1_0, two bits a value (2.06 bits per weight), faster to unpack."""


class MXFP4(GGMLType, qtype=GGMLQuantizationType.MXFP4):
    """OCP microscaling FP4: blocks of 32 E2M1 values under a power-of-two (E8M0) scale; llama.cpp
    ignores an importance matrix for it."""
