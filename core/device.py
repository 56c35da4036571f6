"""Where a variant's tensor work runs, decided in one place for every method.

The quantizers' tensor math (RTN's grids, GPTQ's Hessians, Cholesky factors and column loop,
AWQ's scale and clip searches, QAT's training) runs on CUDA when there is a GPU, one decoder layer
or one tensor at a time streamed to it and its results back to the CPU; on the CPU nothing moves.
The same float32 operations run on either device, so the codes agree but for the order of a few
reductions. GGUF encoding is numpy, so it stays on the CPU; with a GPU it and the file I/O overlap
the GPU's work (``overlap_workers``).
"""

from __future__ import annotations

import torch


def working_device() -> torch.device:
    """CUDA when torch sees a GPU, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# Tensors prepared ahead of the one being written when a GPU does the math: one quantized while
# another is read or encoded, so that neither the GPU nor the CPU's encoders wait on the disk.
_OVERLAP_WITH_GPU = 2


def overlap_workers() -> int:
    """How many tensors a variant's build reads and quantizes ahead, in threads, of the one it
    writes (formats' writers take them in order, so the bytes do not change): none on a CPU,
    whose cores the GGUF encoders' worker processes already keep busy, and a threaded pipeline
    would only reorder the same work."""
    return _OVERLAP_WITH_GPU if working_device().type == "cuda" else 0
