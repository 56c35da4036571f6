"""Which reader a model path needs: a float checkpoint folder, a quantized one, or a GGUF file (a
Hugging Face id stands for its folder in the local cache, formats/hub.py). Every reader offers the
same: ``names``, ``shape``, ``tensor`` (float32), ``payload``, ``arch``, ``config``, the
tokenizer's files, a ``label`` and ``bits_per_weight`` for a report."""

from __future__ import annotations

import os
from typing import Union

from formats.gguf_file import is_gguf_file
from formats.gguf_source import GGUFCheckpoint
from formats.hf import HFCheckpoint, read_json
from formats.hub import local_model
from formats.quantized_checkpoint import QuantizedCheckpoint

Source = Union[HFCheckpoint, QuantizedCheckpoint, GGUFCheckpoint]


def open_checkpoint(path: str | os.PathLike) -> Source:
    """A model as a source: a float checkpoint folder, a quantized one (``quantization_config`` in
    its config.json) or a GGUF file, whose weights are dequantized one tensor at a time as they are
    read; any of them named by a path, or the folder by its Hugging Face id."""
    path = local_model(path)
    if path.is_file() and is_gguf_file(path):
        return GGUFCheckpoint.open(path)
    if (path / "config.json").is_file():
        config = read_json(path / "config.json")
        if isinstance(config, dict) and config.get("quantization_config") is not None:
            return QuantizedCheckpoint.open(path)
    return HFCheckpoint.open(path)
