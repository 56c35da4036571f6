"""The KV cache's storage: every layer's keys and values, in one pool of fixed-size blocks.

Per layer, keys and values are ``[num_blocks * block_size, kv_heads, head_dim]`` (values:
``value_dim``); a token's slot is ``block * block_size + offset``. One token costs
``bytes_per_token`` across the layers, the number ``quantize fit`` gives for the same model and
cache type, so the pool a memory budget buys is the one the calculator promised.
"""

from __future__ import annotations

import torch

from quant.types import Architecture, InputError

CACHE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def bytes_per_token(arch: Architecture, dtype: torch.dtype) -> int:
    return sum(arch.cache_values_per_token(layer) for layer in range(arch.layers)) * dtype.itemsize


class KVPool:
    def __init__(self, arch: Architecture, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        if arch.latent_cache is not None or len(set(arch.kv_heads)) != 1:
            raise InputError(f"model_type '{arch.model_type}': the engine runs layers with the same KV heads, "
                             "and no latent (MLA) cache yet")
        slots = num_blocks * block_size
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.keys = torch.zeros(arch.layers, slots, arch.kv_heads[0], arch.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(arch.layers, slots, arch.kv_heads[0], arch.value_dim, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[layer].index_copy_(0, slots, keys.to(self.dtype))
        self.values[layer].index_copy_(0, slots, values.to(self.dtype))

    def blocks(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks ``ids``: [len(ids), block_size, kv_heads, dim]."""
        shape = (self.num_blocks, self.block_size)
        k, v = self.keys[layer], self.values[layer]
        return k.view(*shape, *k.shape[1:])[ids], v.view(*shape, *v.shape[1:])[ids]

    def slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots``: [len(slots), kv_heads, dim]."""
        return self.keys[layer][slots], self.values[layer][slots]
