"""The KV cache's storage: every layer's keys and values, in one pool of fixed-size blocks.

Per layer, keys are ``[num_blocks, kv_heads, block_size, head_dim]`` (values: ``value_dim``),
head-major within a block, so the decode attention's matrix products read a gathered block as it
lies; a token's slot is ``block * block_size + offset``. One token costs ``bytes_per_token``
across the layers, the number ``quantize fit`` gives for the same model and cache type, so the pool
a memory budget buys is the one the calculator promised.
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
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        kv = arch.kv_heads[0]
        self.keys = torch.zeros(arch.layers, num_blocks, kv, block_size, arch.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(arch.layers, num_blocks, kv, block_size, arch.value_dim, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store each token's ``[kv_heads, dim]`` keys and values at its slot."""
        block, offset = slots // self.block_size, slots % self.block_size
        self.keys[layer][block, :, offset] = keys.to(self.dtype)
        self.values[layer][block, :, offset] = values.to(self.dtype)

    def blocks(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks ``ids``: [len(ids), kv_heads, block_size, dim]."""
        return self.keys[layer][ids], self.values[layer][ids]

    def slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (any shape): [*slots.shape, kv_heads, dim]."""
        block, offset = slots // self.block_size, slots % self.block_size
        return self.keys[layer][block, :, offset], self.values[layer][block, :, offset]
