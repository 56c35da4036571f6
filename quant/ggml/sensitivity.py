"""How much a tensor loses in one ggml type: the proxy ``type: auto`` ranks types by
(recipes/type_search.py).

The proxy is the importance-weighted squared rounding error, sum over the tensor of
``importance[column] * (w - dequant(quant(w)))**2``. With the importance matrix's mean squared
input per column it is, to first order, the squared error the tensor adds to its outputs per
token, summed over its rows: the quantity llama.cpp's own encoders minimise per block, here taken
over the whole tensor so that tensors and types compare. The encoding is our byte-exact one, so
the error is that of the bytes the file will hold. docs/formats.md reports how well it ranks
(tensor, type) pairs by the KL divergence they add alone (bench/auto_proxy.py).
"""

from __future__ import annotations

import numpy as np
import torch

from quant.error import weighted_rounding_error
from quant.ggml import encode


def weighted_error(weight: torch.Tensor, ggml_type: str, importance: np.ndarray | None, name: str = "tensor") -> float:
    """``sum importance[col] * (w - dequant(quant(w)))**2`` over ``weight`` encoded in
    ``ggml_type`` (with ``importance`` read by the encoder as llama.cpp's would); importance 1 for
    every column where there is none."""
    return weighted_rounding_error(weight, encode(weight, ggml_type, name, importance).dequantize(), importance)
