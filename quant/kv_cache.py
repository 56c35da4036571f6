"""KV-cache quantization, simulated: the keys and values attention reads back from a quantized cache.

Serving engines store each token's keys (after rotary embedding) and values in the cache in a
smaller type and read them back for every later token. Simulating it means giving attention the
quantize-dequantize image of its keys and values and running the float model. The formats are the
ones ``quantize fit --kv-cache`` sizes:

- ``int8`` / ``int4``: llama.cpp's ``q8_0`` / ``q4_0`` cache types (``-ctk``/``-ctv``): blocks of
  32 values along the head dimension, each with an fp16 scale, encoded by the same code as our
  GGUF files (byte-identical to ggml's). Since April 2026 llama.cpp rotates what it stores in a
  quantized cache by an orthonormal Walsh-Hadamard matrix (and the queries and the attention
  output to match), which spreads outlier channels over the block: keys in blocks of the largest
  power of two dividing the head size, values in blocks of 64, when the head size is a multiple
  of 64. Attention is unchanged by the rotation itself, so the simulation quantizes in the rotated
  space and rotates back. llama.cpp also quantizes the queries to q8_0 for its dot products with
  quantized keys, and for Llama models keeps each head's channels in another order than
  transformers (rotary pairs side by side), which decides what shares a block.
- ``fp8``: vLLM's ``fp8_e4m3`` cache as it runs without calibrated scales: each value saturated to
  ±448 and rounded to e4m3 (scale 1), so a model whose keys exceed 448 shows it.

Every token is quantized as if it had been cached, including the one attending to itself, which
engines may still read in full precision: a bound on the damage, which is what a report is for.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal

import torch

from core.errors import InputError
from core.rope import pairs_side_by_side
from quant.ggml import encode

_FP8_E4M3_MAX = 448.0
GGML_TYPES = {"int8": "Q8_0", "int4": "Q4_0"}


@dataclass(frozen=True)
class KVCacheSpec:
    format: Literal["fp8", "int8", "int4"]

    def __post_init__(self) -> None:
        if self.format not in ("fp8", "int8", "int4"):
            raise ValueError(f"KV-cache format must be fp8, int8 or int4, got {self.format!r}")

    @property
    def label(self) -> str:
        """Short human name, e.g. ``kv-q8_0``."""
        return {"fp8": "kv-fp8e4m3", "int8": "kv-q8_0", "int4": "kv-q4_0"}[self.format]


def fake_quantize_kv(x: torch.Tensor, spec: KVCacheSpec, rotation: int | None = None) -> torch.Tensor:
    """Keys or values ``[..., head_dim]`` as the cache gives them back; ``rotation``: the size of
    the Hadamard blocks they are stored rotated by (None: stored as they are)."""
    v = x.to(torch.float32)
    if spec.format == "fp8":
        return v.clamp(-_FP8_E4M3_MAX, _FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    if v.shape[-1] % 32:
        raise InputError(f"KV cache {spec.format}: head size {v.shape[-1]} is not a multiple of 32 (llama.cpp's block)")
    if rotation:
        v = rotate_blocks(v, rotation)
    q = encode(v.reshape(-1, v.shape[-1]), GGML_TYPES[spec.format], "KV cache").dequantize().reshape(v.shape)
    if rotation:
        q = rotate_blocks(q, rotation)  # the matrix is its own inverse
    return q.to(x.dtype)


def rotations(spec: KVCacheSpec, head_dim: int) -> tuple[int | None, int | None]:
    """llama.cpp's Hadamard block sizes for (keys, values) of a quantized cache; None: no rotation."""
    if spec.format == "fp8" or head_dim % 64:
        return None, None
    keys = 64
    while head_dim % (2 * keys) == 0:
        keys *= 2
    return keys, 64


def _in_order(x: torch.Tensor, order: torch.Tensor | None, spec: KVCacheSpec, rotation: int | None) -> torch.Tensor:
    """``fake_quantize_kv`` with the head's channels in ``order`` (None: as they are)."""
    if order is None:
        return fake_quantize_kv(x, spec, rotation)
    return fake_quantize_kv(x[..., order], spec, rotation)[..., torch.argsort(order)]


@functools.cache
def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of size ``n`` (a power of two), Sylvester's order, as
    llama.cpp builds it: symmetric, and its own inverse."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotate_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` [..., d] times the Hadamard matrix of size ``n`` on each block of ``n`` channels."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // n, n)
    return (blocks @ hadamard(n).to(x.device, x.dtype)).reshape(x.shape)


@contextmanager
def simulated_kv_cache(model: torch.nn.Module, spec: KVCacheSpec, interleaved: bool = False) -> Iterator[None]:
    """Inside the block, every attention layer of ``model`` (a transformers model) reads its keys and
    values through the quantized cache; other models are untouched (transformers dispatches
    attention through one shared table, so the wrapper checks which model's layer calls it), and
    the table is restored afterwards.

    ``interleaved``: the engine keeps each head's query/key channels with rotary pairs side by side
    (llama.cpp for Llama models; transformers keeps the halves apart). The blocks a cache quantizes
    then hold other channels, which changes the error: keys and queries are quantized in that
    order."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = model.config._attn_implementation
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise InputError(f"KV-cache quantization: attention implementation '{implementation}' cannot be wrapped")
    attention = ALL_ATTENTION_FUNCTIONS[implementation]
    layers = {id(m) for m in model.modules()}

    def quantized_attention(module, query, key, value, *args, **kwargs):
        if id(module) in layers:
            # contiguous first: a model run with a cache hands over keys and values concatenated
            # (contiguous), the recipe's layer walk runs without one and hands over transposed
            # views; on an Intel Xeon (AVX-512, 2026-12-05) the same keys then quantized to values
            # one int4 step apart in places, and the walk's scores left the whole model's
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
            k_rotation, v_rotation = rotations(spec, key.shape[-1])
            order = pairs_side_by_side(key.shape[-1]) if interleaved else None
            key, value = _in_order(key, order, spec, k_rotation), fake_quantize_kv(value, spec, v_rotation)
            if spec.format != "fp8":  # llama.cpp's dot products with q8_0/q4_0 keys take q8_0 queries
                query = _in_order(query, order, KVCacheSpec("int8"), k_rotation)
        return attention(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[implementation] = quantized_attention
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[implementation] = attention
