"""The engine's own GPU kernels, in Triton (which torch's CUDA wheels ship); each module holds one
kernel family with its host-side packing and launch. They run on CUDA only (a CPU, or a machine
without Triton, keeps the torch paths), and under Triton's interpreter (``TRITON_INTERPRET=1``) on
a CPU for their tests."""

from __future__ import annotations

import importlib.util

import torch

# The caches the paged decode kernel reads as stored: float values (fp8 widened in registers).
# q8_0/q4_0 caches are decoded by torch (kv_cache.py).
FUSED_CACHES = ("fp32", "fp16", "bf16", "fp8")
TRITON = importlib.util.find_spec("triton") is not None


def fused_decode(device: torch.device, cache: str) -> bool:
    """Whether decode attention over a ``cache`` pool on ``device`` runs the fused Triton kernel."""
    return TRITON and device.type == "cuda" and cache in FUSED_CACHES
