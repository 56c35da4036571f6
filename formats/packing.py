"""Integer codes packed into int32 words, the way GPTQ and compressed-tensors checkpoints store them."""

from __future__ import annotations

import math

import numpy as np
import torch


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 levels ``[rows, n]`` -> int32 ``[rows, ceil(n·bits/32)]``: each row one little-endian
    bit stream, element i at bits ``i·bits`` and up, low bits first, so a 3-bit code may straddle
    two words. This is compressed-tensors' packing along a row and AutoGPTQ's along a column
    (its 3-bit layout included); callers transpose for the latter."""
    rows, n = codes.shape
    padded = math.ceil(n / 32) * 32
    levels = np.zeros((rows, padded), dtype=np.uint8)
    levels[:, :n] = codes.numpy()
    stream = (levels[..., None] >> np.arange(bits, dtype=np.uint8)) & 1  # [rows, padded, bits], low bit first
    words = np.packbits(stream.reshape(rows, -1), axis=-1, bitorder="little").view("<i4")
    return torch.from_numpy(np.ascontiguousarray(words[:, : math.ceil(n * bits / 32)]).astype(np.int32))


def unpack_codes(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of ``pack_codes``: int32 ``[rows, ceil(n·bits/32)]`` -> uint8 levels ``[rows, n]``."""
    rows = words.shape[0]
    stream = np.unpackbits(np.ascontiguousarray(words.numpy().astype("<i4")).view(np.uint8).reshape(rows, -1),
                           axis=-1, bitorder="little")[:, : n * bits]
    levels = (stream.reshape(rows, n, bits).astype(np.uint8) << np.arange(bits, dtype=np.uint8)).sum(-1, dtype=np.uint8)
    return torch.from_numpy(np.ascontiguousarray(levels))
