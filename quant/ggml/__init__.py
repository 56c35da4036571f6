"""Encoding weights in ggml types, with llama.cpp's choice of type per tensor for a GGUF file type.

The payloads made here are what the GGUF writer stores verbatim, and their dequantized values are
what the in-memory evaluation of the same variant uses, so the report and the file agree.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
from gguf.quants import quantize

from quant.types import GGMLTensor, InputError

# GGUF file types this module can write, with their `general.file_type` id and base tensor type.
FILE_TYPES: dict[str, tuple[int, str]] = {
    "F32": (0, "F32"),
    "F16": (1, "F16"),
    "Q8_0": (7, "Q8_0"),
}


def tensor_type(file_type: str, name: str, shape: tuple[int, ...]) -> str:
    """The ggml type llama.cpp's quantizer gives tensor ``name`` (HF name) in a ``file_type`` file.

    Norms, biases and other 1-D tensors stay F32. A matrix whose row does not split into whole
    blocks falls back to F16, as llama-quantize does.
    """
    base = FILE_TYPES[file_type][1]
    if len(shape) < 2 or not name.endswith(".weight") or "norm" in name:
        return "F32"
    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[base]]
    return base if shape[-1] % block == 0 else "F16"


def encode(weight: torch.Tensor, ggml_type: str, name: str = "tensor") -> GGMLTensor:
    """Encode a float tensor in ``ggml_type`` (rows along the last dimension)."""
    data = weight.to(torch.float32).numpy()
    if not np.isfinite(data).all():
        raise InputError(f"{name}: weights contain NaN or Inf")
    raw = quantize(np.ascontiguousarray(data), GGMLQuantizationType[ggml_type])
    return GGMLTensor(ggml_type=ggml_type, raw=raw, shape=tuple(weight.shape))
