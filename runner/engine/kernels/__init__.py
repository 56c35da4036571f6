"""The engine's own kernels: on a GPU in Triton (which torch's CUDA wheels ship), and on a CPU in C
(``cpu_attention.c``, built on first use). Each module holds one kernel family with its host-side
packing and launch. The Triton kernels run on CUDA only, and under Triton's interpreter
(``TRITON_INTERPRET=1``) on a CPU for their tests; where a kernel cannot run, the torch paths do."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

# The caches the paged decode kernels read as stored: float values (on a GPU, fp8 too, widened in
# registers). q8_0/q4_0 caches are decoded by torch (kv_cache.py).
FUSED_CACHES = ("fp32", "fp16", "bf16", "fp8")
CPU_CACHES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
C_FLOATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C kernels' F32, BF16 and F16
TRITON = importlib.util.find_spec("triton") is not None


def fused_decode(device: torch.device, cache: str) -> bool:
    """Whether decode attention over a ``cache`` pool on ``device`` runs the fused Triton kernel."""
    return TRITON and device.type == "cuda" and cache in FUSED_CACHES


def decode_kernel(device: torch.device, cache: str, head_sizes: tuple[int, int]) -> Callable[..., torch.Tensor] | None:
    """The paged decode-attention kernel for a ``cache`` pool on ``device`` whose keys and values
    have ``head_sizes`` (one contract: paged_attention.paged_decode_attention's), or None where
    torch's gathered attention runs."""
    if fused_decode(device, cache):
        from runner.engine.kernels.paged_attention import paged_decode_attention

        return paged_decode_attention
    if device.type == "cpu" and cache in CPU_CACHES:
        from runner.engine.kernels import cpu_attention

        if cpu_attention.available(CPU_CACHES[cache], head_sizes):
            return cpu_attention.paged_decode_attention
    return None
