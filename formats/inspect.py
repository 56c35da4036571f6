"""What is inside a model file: metadata, tensor names, types, shapes and bits per weight."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from formats.hf import read_safetensors_header
from quant.types import InputError


@dataclass
class TensorEntry:
    name: str
    type: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / max(1, int(np.prod(self.shape)))


@dataclass
class FileSummary:
    path: Path
    format: str
    metadata: dict[str, str]
    tensors: list[TensorEntry]

    @property
    def bits_per_weight(self) -> float:
        params = sum(int(np.prod(t.shape)) for t in self.tensors)
        return 8.0 * sum(t.nbytes for t in self.tensors) / max(1, params)


def inspect_file(path: Path) -> FileSummary:
    if not path.exists():
        raise InputError(f"{path}: file not found")
    if path.is_dir():
        raise InputError(f"{path}: is a folder; give one .gguf or .safetensors file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _inspect_gguf(path)
    if path.suffix == ".safetensors" or _looks_like_safetensors(path):
        return _inspect_safetensors(path)
    raise InputError(f"{path}: neither a GGUF nor a safetensors file")


def _looks_like_safetensors(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def _inspect_safetensors(path: Path) -> FileSummary:
    import json
    import struct

    header = read_safetensors_header(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n)).get("__metadata__") or {}
    tensors = [
        TensorEntry(name, info["dtype"], tuple(info["shape"]), info["data_offsets"][1] - info["data_offsets"][0])
        for name, info in header.items()
    ]
    return FileSummary(path, "safetensors", {k: str(v) for k, v in meta.items()}, tensors)


def _inspect_gguf(path: Path) -> FileSummary:
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on damaged files; all mean the same
        raise InputError(f"{path}: damaged or truncated GGUF file ({type(e).__name__}: {e})") from None
    metadata: dict[str, str] = {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            metadata[field.name] = f"[{len(field.data)} items]"
        else:
            value = field.contents()
            text = str(value)
            metadata[field.name] = text if len(text) <= 120 else text[:117] + "..."
    tensors = [
        TensorEntry(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), int(t.n_bytes))
        for t in reader.tensors
    ]
    return FileSummary(path, "gguf", metadata, tensors)
