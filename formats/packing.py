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
    if 32 % bits == 0:
        return _pack_whole_codes(codes, bits)
    padded = math.ceil(n / 32) * 32
    levels = np.zeros((rows, padded), dtype=np.uint8)
    levels[:, :n] = codes.numpy()
    stream = (levels[..., None] >> np.arange(bits, dtype=np.uint8)) & 1  # [rows, padded, bits], low bit first
    words = np.packbits(stream.reshape(rows, -1), axis=-1, bitorder="little").view("<i4")
    return torch.from_numpy(np.ascontiguousarray(words[:, : math.ceil(n * bits / 32)]).astype(np.int32))


def _pack_whole_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_codes`` where no code straddles two words (1, 2, 4 or 8 bits): word ``w`` ORs
    codes ``w·k .. w·k + k - 1`` (``k = 32 / bits``) shifted into place, in torch's threads, as
    many passes as a word holds codes. The general bit stream's numpy takes 25x as long (4 s for
    an 8B model's 14336x4096 int4 weight on one thread here), on the writer's thread."""
    rows, n = codes.shape
    per = 32 // bits
    count = math.ceil(n / per)
    grouped = torch.nn.functional.pad(codes, (0, count * per - n)).reshape(rows, count, per)
    words = grouped[..., 0].to(torch.int32)
    for k in range(1, per):
        words |= grouped[..., k].to(torch.int32) << (k * bits)  # the top code's high bit is the sign bit
    return words


def unpack_codes(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of ``pack_codes``: int32 ``[rows, ceil(n·bits/32)]`` -> uint8 levels ``[rows, n]``."""
    rows = words.shape[0]
    stream = np.unpackbits(np.ascontiguousarray(words.numpy().astype("<i4")).view(np.uint8).reshape(rows, -1),
                           axis=-1, bitorder="little")[:, : n * bits]
    levels = (stream.reshape(rows, n, bits).astype(np.uint8) << np.arange(bits, dtype=np.uint8)).sum(-1, dtype=np.uint8)
    return torch.from_numpy(np.ascontiguousarray(levels))
