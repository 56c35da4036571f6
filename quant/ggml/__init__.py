"""Encoding weights in ggml types, as llama.cpp's quantizer does, for GGUF files.

The payloads made here are what the GGUF writer stores verbatim, and their dequantized values are
what the in-memory evaluation of the same variant uses, so the report and the file agree. The
K-quant encoders are byte-exact ports of llama.cpp's (see the kquant_* modules); the float types
and the legacy 32-blocks come from the `gguf` package, which is byte-exact for them.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from importlib import import_module

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from quant.ggml.rules import FILE_TYPES, tensor_types
from quant.types import GGMLTensor, InputError

__all__ = ["FILE_TYPES", "encode", "tensor_types"]

# ggml type -> (module, function) of our own encoders; everything else goes through gguf.quants.
_KQUANTS = {
    "Q2_K": ("quant.ggml.kquant_affine", "quantize_q2_k"),
    "Q4_K": ("quant.ggml.kquant_affine", "quantize_q4_k"),
    "Q5_K": ("quant.ggml.kquant_affine", "quantize_q5_k"),
    "Q3_K": ("quant.ggml.kquant_symmetric", "quantize_q3_k"),
    "Q6_K": ("quant.ggml.kquant_symmetric", "quantize_q6_k"),
}
# The legacy 32-blocks: gguf.quants is byte-exact without an importance matrix, ours with one.
_LEGACY_WITH_IMATRIX = {
    "Q4_0": ("quant.ggml.legacy", "quantize_q4_0"),
    "Q4_1": ("quant.ggml.legacy", "quantize_q4_1"),
    "Q5_0": ("quant.ggml.legacy", "quantize_q5_0"),
    "Q5_1": ("quant.ggml.legacy", "quantize_q5_1"),
}
_IGNORE_IMATRIX = ("F32", "F16", "BF16", "Q8_0")  # llama.cpp ignores the importance matrix for these


def encode(weight: torch.Tensor, ggml_type: str, name: str = "tensor", imatrix: np.ndarray | None = None) -> GGMLTensor:
    """Encode a float tensor in ``ggml_type`` (rows along the last dimension).

    ``imatrix`` holds one importance value per input column (mean squared activation), used by
    the types whose llama.cpp quantizer takes one.
    """
    data = np.ascontiguousarray(weight.to(torch.float32).numpy())
    if not np.isfinite(data).all():
        raise InputError(f"{name}: weights contain NaN or Inf")
    if ggml_type in _IGNORE_IMATRIX:
        imatrix = None
    encoder = _KQUANTS.get(ggml_type) or (_LEGACY_WITH_IMATRIX.get(ggml_type) if imatrix is not None else None)
    if encoder:
        module, function = encoder
        rows = data.reshape(-1, data.shape[-1])
        raw = _by_row_blocks(getattr(import_module(module), function), rows, imatrix)
    else:
        raw = quantize(data, GGMLQuantizationType[ggml_type])
    return GGMLTensor(ggml_type=ggml_type, raw=raw, shape=tuple(weight.shape))


# Below about 512 super-blocks per thread, numpy's per-call overhead and GIL hand-overs eat the gain.
_MIN_VALUES_PER_THREAD = 512 * 256


def _threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _by_row_blocks(encoder, rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    """Run an encoder on row blocks in parallel threads (numpy releases the GIL in its loops).

    Rows are encoded independently, so the bytes do not depend on the split.
    """
    threads = min(_threads(), max(1, rows.size // _MIN_VALUES_PER_THREAD))
    if threads == 1:
        return encoder(rows, imatrix)
    bounds = np.linspace(0, rows.shape[0], threads + 1).astype(int)
    with ThreadPoolExecutor(threads) as pool:
        parts = pool.map(lambda i: encoder(rows[bounds[i] : bounds[i + 1]], imatrix), range(threads))
        return np.concatenate(list(parts))
