"""Encoding weights in ggml types, as llama.cpp's quantizer does, for GGUF files.

The payloads made here are what the GGUF writer stores verbatim, and their dequantized values are
what the in-memory evaluation of the same variant uses, so the report and the file agree. Each ggml
type is one class in the registry of ``quant.ggml.types``: the K-quant encoders, the legacy
types' importance-matrix path, IQ4_NL/IQ4_XS and the IQ3/IQ2/IQ1 lattice types are byte-exact
ports of llama.cpp's (``kquant_affine``, ``kquant_symmetric``, ``legacy``, ``iquant_nl``,
``iquant_lattice``, ``iquant_iq1``); the float types, Q8_0, TQ1_0, TQ2_0, MXFP4 and the legacy
types without an importance matrix come from the ``gguf`` package, which is byte-exact for them.
"""

from __future__ import annotations

import numpy as np
import torch

from core.errors import InputError
from core.file_types import FILE_TYPES, tensor_types
from core.tensors import GGMLTensor
from quant.ggml import iquant_iq1, iquant_lattice, iquant_nl, kquant_affine, kquant_symmetric, legacy  # noqa: F401  (importing a family registers its types)
from quant.ggml.types import type_named, type_names
from quant.ggml.workers import by_row_blocks

__all__ = ["FILE_TYPES", "encode", "tensor_types", "type_named", "type_names"]


def encode(weight: torch.Tensor, ggml_type: str, name: str = "tensor", imatrix: np.ndarray | None = None) -> GGMLTensor:
    """Encode a float tensor in ``ggml_type`` (rows along the last dimension).

    ``imatrix`` holds one importance value per input column (mean squared activation), used by
    the types whose llama.cpp quantizer takes one. The rows are encoded ``_ENCODE_CHUNK`` weights
    at a time, each chunk in float32 only while it is encoded: every ggml type encodes its rows
    independently, so the bytes are those of the whole tensor at once, and an 8B model's
    128256x4096 embedding is never in float32 whole (2 GiB, beside its bytes and the encoders'
    intermediates).
    """
    kind = type_named(ggml_type)
    if not kind.takes_imatrix:
        imatrix = None
    rows = weight.reshape(-1, weight.shape[-1]) if weight.dim() > 1 else weight.reshape(1, -1)
    step = max(1, _ENCODE_CHUNK // max(1, rows.shape[1]))
    out = None
    for start in range(0, max(1, rows.shape[0]), step):
        chunk = _float32(rows[start : start + step], name)
        raw = by_row_blocks(kind.quantize, chunk, imatrix) if kind.parallel else kind.quantize(chunk, imatrix)
        if out is None:
            out = np.empty((rows.shape[0], *raw.shape[1:]), raw.dtype)
        out[start : start + step] = raw
    return GGMLTensor(ggml_type=kind.name, raw=out.reshape(*weight.shape[:-1], *out.shape[1:]), shape=tuple(weight.shape))


# Weights encoded at a time (64 MiB in float32): large enough that the worker processes split
# each chunk (``workers._MIN_VALUES_PER_WORKER``), small beside an embedding.
_ENCODE_CHUNK = 2**24


def _float32(rows: torch.Tensor, name: str) -> np.ndarray:
    """Rows of a weight as a contiguous float32 array, refused by name if any is NaN or Inf."""
    data = np.ascontiguousarray(rows.to(torch.float32).numpy())
    if not np.isfinite(data).all():
        raise InputError(f"{name}: weights contain NaN or Inf")
    return data
