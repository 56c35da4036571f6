"""The KV cache's storage: every layer's keys and values, in one pool of fixed-size blocks.

Per layer, keys are ``[num_blocks, kv_heads, block_size, head_dim]`` (values: ``value_dim``),
head-major within a block, so the decode attention's matrix products read a gathered block as it
lies; a token's slot is ``block * block_size + offset``. The cache types are ``quantize fit``'s:

- ``fp32``, ``fp16``, ``bf16``: stored as they are;
- ``fp8``: vLLM's e4m3 cache without scales (each value saturated to ±448);
- ``int8``, ``int4``: llama.cpp's ``q8_0``/``q4_0`` blocks (32 values and an fp16 scale), encoded
  and decoded by torch on the pool's device (quant/ggml/device_blocks.py), byte for byte as the
  recipe's ``kv_cache`` simulation (quant/kv_cache.py) encodes them, with what goes with them
  there: keys and queries in llama.cpp's channel order for Llama heads, a Walsh-Hadamard rotation
  of keys (and queries) and values before encoding, and q8_0 queries. Attention runs in
  that rotated space (dot products are unchanged by it) and its output is rotated back, so the
  engine computes what the report scored, from codes it really stores.

One token costs ``bytes_per_token`` across the layers, the number ``quantize fit`` gives for the same
model and cache type, so a quantized cache really holds more tokens in the same memory.
"""

from __future__ import annotations

import torch

from core.architecture import Architecture
from core.errors import InputError
from core.rope import pairs_side_by_side
from quant.ggml.device_blocks import decode_q4_0, decode_q8_0, encode_q4_0, encode_q8_0
from quant.kv_cache import GGML_TYPES, rotate_blocks, rotations
from quant.kv_cache import KVCacheSpec

BITS = {"fp32": 32.0, "fp16": 16.0, "bf16": 16.0, "fp8": 8.0, "int8": 8.5, "int4": 4.5}  # per cached value
FLOAT_CACHES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def float_cache(dtype: torch.dtype) -> str:
    """The float cache that stores values as ``dtype`` computes them (the ``auto`` cache)."""
    return next(name for name, d in FLOAT_CACHES.items() if d == dtype)
_FP8_MAX = 448.0


def bytes_per_token(arch: Architecture, cache: str) -> float:
    return sum(arch.cache_values_per_token(layer) for layer in range(arch.layers)) * BITS[cache] / 8


class _Store:
    """One tensor kind (keys or values) of every layer, as the cache type stores it."""

    def __init__(self, cache: str, shape: tuple[int, ...], dim: int, compute: torch.dtype, device: torch.device):
        self.cache, self.compute = cache, compute
        if cache in FLOAT_CACHES:
            self.codes = torch.zeros(*shape, dim, dtype=FLOAT_CACHES[cache], device=device)
        elif cache == "fp8":
            self.codes = torch.zeros(*shape, dim, dtype=torch.float8_e4m3fn, device=device)
        else:
            if dim % 32:
                raise InputError(f"kv_cache_dtype {cache}: head size {dim} is not a multiple of 32 (llama.cpp's block)")
            width = dim if cache == "int8" else dim // 2
            self.codes = torch.zeros(*shape, width, dtype=torch.int8 if cache == "int8" else torch.uint8, device=device)
            self.scales = torch.zeros(*shape, dim // 32, dtype=torch.float16, device=device)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + (self.scales.nbytes if hasattr(self, "scales") else 0)

    def put(self, layer: int, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Store ``x`` [tokens, kv_heads, dim] at ``rows`` (``KVPool.where``) of the layer's store
        seen as one row per slot and head: one ``index_copy_``, several times as fast on a CPU as
        assigning through block and offset indices."""
        x = x.reshape(-1, x.shape[-1])
        if self.cache in FLOAT_CACHES:
            self._rows(self.codes, layer).index_copy_(0, rows, x.to(self.codes.dtype))
        elif self.cache == "fp8":
            codes = x.float().clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)  # copied as bytes: no fp8 index_copy_ on a CPU
            self._rows(self.codes, layer).view(torch.uint8).index_copy_(0, rows, codes.view(torch.uint8))
        else:
            codes, scales = (encode_q8_0 if self.cache == "int8" else encode_q4_0)(x)
            self._rows(self.codes, layer).index_copy_(0, rows, codes)
            self._rows(self.scales, layer).index_copy_(0, rows, scales)

    @staticmethod
    def _rows(store: torch.Tensor, layer: int) -> torch.Tensor:
        return store[layer].view(-1, store.shape[-1])

    def get(self, layer: int, blocks: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Dequantized entries of whole ``blocks`` (ids), or at ``rows`` (``KVPool.where``), each by
        index_select: several times as fast as advanced indexing on a CPU."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return torch.index_select(t[layer], 0, blocks) if rows is None else torch.index_select(self._rows(t, layer), 0, rows)

        codes = pick(self.codes)
        if self.cache in FLOAT_CACHES or self.cache == "fp8":
            return codes.to(self.compute)
        return (decode_q8_0 if self.cache == "int8" else decode_q4_0)(codes, pick(self.scales)).to(self.compute)


class KVPool:
    def __init__(self, arch: Architecture, num_blocks: int, block_size: int, cache: str, compute: torch.dtype,
                 device: torch.device):
        if arch.latent_cache is not None or len(set(arch.kv_heads)) != 1:
            raise InputError(f"model_type '{arch.model_type}': the engine runs layers with the same KV heads, "
                             "and no latent (MLA) cache yet")
        if cache not in BITS:
            raise InputError(f"kv_cache_dtype {cache}: one of auto, {', '.join(BITS)}")
        self.num_blocks, self.block_size, self.cache, self.device = num_blocks, block_size, cache, device
        self.kv_heads = arch.kv_heads[0]
        shape = (arch.layers, num_blocks, self.kv_heads, block_size)
        self.keys = _Store(cache, shape, arch.head_dim, compute, device)
        self.values = _Store(cache, shape, arch.value_dim, compute, device)
        quantized = cache in GGML_TYPES
        self.key_rotation, self.value_rotation = rotations(KVCacheSpec(cache), arch.head_dim) if quantized else (None, None)
        adjacent = quantized and arch.rope_pairs_adjacent_in_gguf
        self.order = pairs_side_by_side(arch.head_dim).to(device) if adjacent else None

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def where(self, slots: torch.Tensor) -> torch.Tensor:
        """Where cache slots lie in a layer's store seen as ``[blocks * kv_heads * block_size, dim]``,
        one row per slot and KV head, ``[slots * kv_heads]``: found once a step, used by every
        layer's ``write``."""
        block, offset = slots // self.block_size, slots % self.block_size
        heads = torch.arange(self.kv_heads, device=slots.device)
        return ((block[:, None] * self.kv_heads + heads) * self.block_size + offset[:, None]).flatten()

    def write(self, layer: int, where: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store each token's ``[kv_heads, dim]`` keys and values at its slot (``where``)."""
        self.keys.put(layer, where, self._key_space(keys))
        self.values.put(layer, where, self._rotated(values, self.value_rotation))

    def blocks(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks ``ids``: [len(ids), kv_heads, block_size, dim]."""
        return self.keys.get(layer, blocks=ids), self.values.get(layer, blocks=ids)

    def stored(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values as stored, [num_blocks, kv_heads, block_size, dim] (for a float
        or fp8 cache, the values themselves), for a kernel that reads blocks where they lie."""
        return self.keys.codes[layer], self.values.codes[layer]

    def slots(self, layer: int, rows: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at cache slots of ``shape``, found by ``where`` (of the slots flattened)
        once for every layer: [*shape, kv_heads, dim]."""
        shape = (*shape, self.kv_heads, -1)
        return self.keys.get(layer, rows=rows).view(shape), self.values.get(layer, rows=rows).view(shape)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries in the space the keys are stored in (for q8_0/q4_0 keys: reordered, rotated and
        q8_0-quantized, as llama.cpp's dot products take them)."""
        if self.cache not in GGML_TYPES:
            return q
        return decode_q8_0(*encode_q8_0(self._key_space(q))).to(self.keys.compute)

    def outputs(self, out: torch.Tensor) -> torch.Tensor:
        """Attention outputs back from the rotated space of stored values."""
        return self._rotated(out, self.value_rotation)

    def _key_space(self, x: torch.Tensor) -> torch.Tensor:
        if self.order is not None:
            x = x[..., self.order]
        return self._rotated(x, self.key_rotation)

    @staticmethod
    def _rotated(x: torch.Tensor, n: int | None) -> torch.Tensor:
        return x if n is None else rotate_blocks(x.float(), n).to(x.dtype)
