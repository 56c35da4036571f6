"""Importance-matrix files in llama.cpp's formats, so users can mix tools.

Two formats exist: the GGUF one that ``llama-imatrix`` writes today (per matrix, tensors
``<name>.in_sum2`` holding the sum of squared activations per input column and ``<name>.counts``
holding how many tokens were summed, plus ``imatrix.datasets``, ``imatrix.chunk_count`` and
``imatrix.chunk_size``), and the legacy ``.dat`` one (name, call count, values) that older
releases wrote and ``llama-quantize`` still reads. Names are GGUF tensor names
(``blk.0.attn_q.weight``); the values a quantizer uses are sums divided by counts.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from core.errors import InputError
from formats.gguf_file import is_gguf_file, read_gguf_header


def write_imatrix(path: Path, means: dict[str, np.ndarray], tokens: int, datasets: list[str], chunk_size: int) -> None:
    """Write llama.cpp's GGUF imatrix: ``means`` (GGUF name -> mean x^2 per column) over ``tokens``
    tokens, at ``path`` itself (a command stages it under a temporary name: formats/outputs.py)."""
    writer = GGUFWriter(path, arch="imatrix")
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", datasets)
    writer.add_uint32("imatrix.chunk_count", max(1, tokens // chunk_size))
    writer.add_uint32("imatrix.chunk_size", chunk_size)
    for name, mean in sorted(means.items()):
        writer.add_tensor(f"{name}.in_sum2", (mean.astype(np.float64) * tokens).astype(np.float32).reshape(1, -1))
        writer.add_tensor(f"{name}.counts", np.array([[tokens]], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_imatrix(path: Path) -> dict[str, np.ndarray]:
    """Mean squared activation per input column, by GGUF tensor name, from either format."""
    if not path.is_file():
        raise InputError(f"{path}: imatrix file not found")
    return _read_gguf(path) if is_gguf_file(path) else _read_legacy(path)


def _read_gguf(path: Path) -> dict[str, np.ndarray]:
    header = read_gguf_header(path)
    tensors = {}
    with open(path, "rb") as f:
        for t in header.tensors:
            if t.type != GGMLQuantizationType.F32:
                raise InputError(f"{path}: imatrix tensor '{t.name}' is {t.type.name}; llama.cpp writes F32")
            f.seek(t.offset)
            tensors[t.name] = np.frombuffer(f.read(t.n_bytes), dtype="<f4")
    means = {}
    for name, sums in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name.removesuffix(".in_sum2")
        if f"{base}.counts" not in tensors:
            raise InputError(f"{path}: '{base}' has sums but no counts")
        counts = tensors[f"{base}.counts"]
        if not counts.size or sums.size % counts.size:
            raise InputError(f"{path}: '{base}' has {sums.size} sums for {counts.size} counts")
        sums = sums.reshape(counts.size, -1)
        # A matrix that saw no tokens gets uniform importance, as llama-quantize does.
        means[base] = np.where(counts[:, None] > 0, sums / np.maximum(counts[:, None], 1), 1.0).astype(np.float32).reshape(-1)
    if not means:
        raise InputError(f"{path}: no importance-matrix entries (expected '<tensor>.in_sum2' tensors)")
    return means


def _read_legacy(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise InputError(f"{path}: truncated or not an imatrix file")
        values = struct.unpack_from(fmt, data, pos)
        pos += size
        return values

    (n_entries,) = take("<i")
    if not 0 < n_entries < 1_000_000:
        raise InputError(f"{path}: not an imatrix file (neither GGUF nor llama.cpp's legacy .dat)")
    means = {}
    for _ in range(n_entries):
        (length,) = take("<i")
        if not 0 < length < 4096:
            raise InputError(f"{path}: not an imatrix file (bad entry name length {length})")
        name = bytes(take(f"<{length}s")[0]).decode("utf-8", "replace")
        ncall, nval = take("<ii")
        if nval < 1:
            raise InputError(f"{path}: entry '{name}' has {nval} values")
        values = np.array(take(f"<{nval}f"), dtype=np.float32)
        means[name] = values / ncall if ncall > 0 else values
    return means
