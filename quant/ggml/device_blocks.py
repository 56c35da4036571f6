"""Q8_0 and Q4_0 blocks encoded and decoded by torch, on whatever device the tensor is: the engine's
quantized KV cache (runner/engine/kv_cache.py) stores every new token's keys and values each step,
and a copy to the CPU and back per layer would cost more than the step's attention on a GPU (and
would stop a CUDA graph from capturing it).

The bytes are those of ``quant.ggml.encode`` for the two types (gguf-py's port of ggml's reference
``quantize_row_q8_0``/``quantize_row_q4_0``, which the recipe's KV-cache simulation uses), bit for
bit (tests/test_kv_cache.py), because every step is the same float32 operation:

- Q8_0: ``d = max|x| / 127``, ``q = round(x / d)`` rounding halves away from zero (ggml's
  ``roundf``, computed as gguf-py computes it), ``d`` stored as fp16;
- Q4_0: ``d = m / -8`` with ``m`` the block's value of largest magnitude (the first of equal ones,
  so its sign decides d's), ``q = min(15, trunc(x / d + 8.5))``, element ``j`` in the low nibble of
  byte ``j`` and element ``j + 16`` in its high one.

``x / d`` is ``x · (1 / d)`` in both, and the divisions by 127 and -8 divide by a tensor: torch's
CUDA division by a Python number multiplies by its reciprocal, one rounding more.
"""

from __future__ import annotations

import torch

QK = 32  # values per block


def encode_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., n]`` as int8 codes ``[..., n]`` and fp16 scales ``[..., n / 32]``."""
    blocks = x.float().unflatten(-1, (-1, QK))
    d = blocks.abs().amax(-1, keepdim=True) / blocks.new_full((), 127.0)
    codes = _round_half_away(blocks * _inverse(d)).to(torch.int8)
    return codes.flatten(-2), d[..., 0].to(torch.float16)


def encode_q4_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., n]`` as packed nibbles ``[..., n / 2]`` (uint8) and fp16 scales ``[..., n / 32]``."""
    blocks = x.float().unflatten(-1, (-1, QK))
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # argmax: the first of equal magnitudes
    d = peak / blocks.new_full((), -8.0)
    levels = torch.trunc(blocks * _inverse(d) + 8.5).clamp_(max=15).to(torch.uint8)
    return (levels[..., : QK // 2] | levels[..., QK // 2 :] << 4).flatten(-2), d[..., 0].to(torch.float16)


def decode_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of int8 ``codes [..., n]`` under fp16 ``scales [..., n / 32]``."""
    return (codes.float().unflatten(-1, (-1, QK)) * scales.float()[..., None]).flatten(-2)


def decode_q4_0(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of Q4_0 nibbles ``[..., n / 2]`` under fp16 ``scales [..., n / 32]``."""
    blocks = packed.unflatten(-1, (-1, QK // 2))
    levels = torch.cat([blocks & 15, blocks >> 4], -1).float() - 8
    return (levels * scales.float()[..., None]).flatten(-2)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``1 / d``, 0 where d is 0 (an all-zero block encodes as zeros)."""
    return torch.where(d == 0, 0.0, d.reciprocal())


def _round_half_away(y: torch.Tensor) -> torch.Tensor:
    """ggml's ``roundf`` as gguf-py's ``np_roundf`` computes it: the whole part, plus one where the
    fraction (exact in float32) doubled reaches 1."""
    a = y.abs()
    whole = a.floor()
    return torch.sign(y) * (whole + (2 * (a - whole)).floor())
