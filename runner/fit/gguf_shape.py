"""A GGUF file as the memory-fit calculator sees it: its tensors' exact sizes and its metadata.

Only the header is read (formats.gguf_file checks it against the file's size; tensor data is never
touched), so a 70B file is described in a moment; formats.architecture reads the hyper-parameters,
each checked to be a whole number in range.
"""

from __future__ import annotations

from pathlib import Path

from core.errors import InputError
from formats.architecture import from_gguf
from formats.gguf_file import read_gguf_header
from runner.fit.model_shape import ModelShape


def gguf_model_shape(path: Path) -> ModelShape:
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    header = read_gguf_header(path)
    if not header.tensors:
        raise InputError(f"{path}: the GGUF file holds no tensors (a vocabulary-only file?), so no model to size")
    tensors = [(t.name, t.shape) for t in header.tensors]
    return ModelShape(
        name=path.name,
        arch=from_gguf(header.fields, dict(tensors), str(path)),
        tensors=tensors,
        stored_bytes={t.name: t.n_bytes for t in header.tensors},
        stored_as="gguf file",
    )
