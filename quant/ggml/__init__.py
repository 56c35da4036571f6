"""Encoding weights in ggml types, as llama.cpp's quantizer does, for GGUF files.

The payloads made here are what the GGUF writer stores verbatim, and their dequantized values are
what the in-memory evaluation of the same variant uses, so the report and the file agree. The
K-quant encoders are byte-exact ports of llama.cpp's (see the kquant_* modules); the float types
and the legacy 32-blocks come from the `gguf` package, which is byte-exact for them.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from importlib import import_module

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from core.errors import InputError
from core.file_types import FILE_TYPES, tensor_types
from core.tensors import GGMLTensor

__all__ = ["FILE_TYPES", "encode", "tensor_types"]

# ggml type -> (module, function) of our own encoders; everything else goes through gguf.quants.
_KQUANTS = {
    "Q2_K": ("quant.ggml.kquant_affine", "quantize_q2_k"),
    "Q4_K": ("quant.ggml.kquant_affine", "quantize_q4_k"),
    "Q5_K": ("quant.ggml.kquant_affine", "quantize_q5_k"),
    "Q3_K": ("quant.ggml.kquant_symmetric", "quantize_q3_k"),
    "Q6_K": ("quant.ggml.kquant_symmetric", "quantize_q6_k"),
}
# The legacy 32-blocks: gguf.quants is byte-exact without an importance matrix, ours with one.
_LEGACY_WITH_IMATRIX = {
    "Q4_0": ("quant.ggml.legacy", "quantize_q4_0"),
    "Q4_1": ("quant.ggml.legacy", "quantize_q4_1"),
    "Q5_0": ("quant.ggml.legacy", "quantize_q5_0"),
    "Q5_1": ("quant.ggml.legacy", "quantize_q5_1"),
}
_IGNORE_IMATRIX = ("F32", "F16", "BF16", "Q8_0")  # llama.cpp ignores the importance matrix for these


def encode(weight: torch.Tensor, ggml_type: str, name: str = "tensor", imatrix: np.ndarray | None = None) -> GGMLTensor:
    """Encode a float tensor in ``ggml_type`` (rows along the last dimension).

    ``imatrix`` holds one importance value per input column (mean squared activation), used by
    the types whose llama.cpp quantizer takes one. The rows are encoded ``_ENCODE_CHUNK`` weights
    at a time, each chunk in float32 only while it is encoded: every ggml type encodes its rows
    independently, so the bytes are those of the whole tensor at once, and an 8B model's
    128256x4096 embedding is never in float32 whole (2 GiB, beside its bytes and the encoders'
    intermediates).
    """
    if ggml_type in _IGNORE_IMATRIX:
        imatrix = None
    encoder = _KQUANTS.get(ggml_type) or (_LEGACY_WITH_IMATRIX.get(ggml_type) if imatrix is not None else None)
    rows = weight.reshape(-1, weight.shape[-1]) if weight.dim() > 1 else weight.reshape(1, -1)
    step = max(1, _ENCODE_CHUNK // max(1, rows.shape[1]))
    out = None
    for start in range(0, max(1, rows.shape[0]), step):
        raw = _encode_rows(_float32(rows[start : start + step], name), ggml_type, encoder, imatrix)
        if out is None:
            out = np.empty((rows.shape[0], *raw.shape[1:]), raw.dtype)
        out[start : start + step] = raw
    raw = out if encoder else out.reshape(*weight.shape[:-1], *out.shape[1:])
    return GGMLTensor(ggml_type=ggml_type, raw=raw, shape=tuple(weight.shape))


# Weights encoded at a time (64 MiB in float32): large enough that the worker processes split
# each chunk (``_MIN_VALUES_PER_WORKER``), small beside an embedding.
_ENCODE_CHUNK = 2**24


def _float32(rows: torch.Tensor, name: str) -> np.ndarray:
    """Rows of a weight as a contiguous float32 array, refused by name if any is NaN or Inf."""
    data = np.ascontiguousarray(rows.to(torch.float32).numpy())
    if not np.isfinite(data).all():
        raise InputError(f"{name}: weights contain NaN or Inf")
    return data


def _encode_rows(rows: np.ndarray, ggml_type: str, encoder: tuple[str, str] | None, imatrix: np.ndarray | None) -> np.ndarray:
    """The ggml bytes (or floats) of ``rows [n, width]``: ``[n, row bytes]`` (``[n, width]``)."""
    if encoder:
        module, function = encoder
        return _by_row_blocks(getattr(import_module(module), function), rows, imatrix)
    return quantize(rows, GGMLQuantizationType[ggml_type])


# Below this many super-blocks per worker, the cost of shipping the rows to a worker process
# outweighs the gain.
_MIN_VALUES_PER_WORKER = 128 * 256


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _by_row_blocks(encoder, rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    """Run an encoder on row blocks in parallel, this process taking the first block.

    Rows are encoded independently, so the bytes do not depend on the split.
    """
    parts = min(_cores(), max(1, rows.size // _MIN_VALUES_PER_WORKER))
    if parts == 1:
        return encoder(rows, imatrix)
    bounds = np.linspace(0, rows.shape[0], parts + 1).astype(int)
    pool = _worker_pool()
    futures = [pool.submit(encoder, rows[bounds[i] : bounds[i + 1]], imatrix) for i in range(1, parts)]
    head = encoder(rows[: bounds[1]], imatrix)
    return np.concatenate([head, *(f.result() for f in futures)])


@functools.cache
def _worker_pool() -> Executor:
    """Workers for the encoders, kept for the life of the process.

    The encoders make hundreds of small numpy calls per chunk, and threads lose much of their time
    handing the GIL over between those calls: on 2 cores, Q4_K runs 1.5x as fast as on one with
    threads and 1.6-1.7x with processes, and the ref model converts to Q4_K_M in 3.4 s instead of
    4.25 s. Forked processes start in milliseconds with the encoders already imported; they run
    numpy only, never torch, so the parent's thread pools do not matter to them. Where fork is not
    the platform's safe choice (macOS, Windows) threads do the work.
    """
    workers = max(1, _cores() - 1)
    if sys.platform.startswith("linux"):
        fork = multiprocessing.get_context("fork")
        return ProcessPoolExecutor(workers, mp_context=fork, initializer=_start_worker, initargs=(os.getpid(),))
    return ThreadPoolExecutor(workers)


def _start_worker(parent: int) -> None:
    """Set up a forked worker.

    It gets its own stdout/stderr: the inherited stream objects may carry a lock a parent thread (a
    progress bar) held at the fork, and a worker flushes its streams on exit. And it dies with its
    parent: a worker waits on a pipe whose other end it holds itself (fork copies it), so when the
    parent is killed nothing would ever wake it. A watchdog thread checks twice a second whether
    the worker has been handed to another parent (the parent is gone) and ends it then. (Linux's
    parent-death signal would follow the thread that forked, not the process, and the pool may be
    started by a short-lived thread.)
    """
    sys.stdout = sys.stderr = open(os.devnull, "w")
    threading.Thread(target=_exit_with, args=(parent,), daemon=True, name="exit-with-parent").start()


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
