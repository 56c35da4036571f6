"""Which checkpoint a model path names: a float model folder, a quantized checkpoint, a GGUF file
(run on its dequantized weights), or a recipe's variant folder (its compressed-tensors export, else
its GPTQ export, else its dense one)."""

from __future__ import annotations

from pathlib import Path

from core.errors import InputError
from formats.registry import ENGINE_EXPORTS
from formats.sources import Source, open_checkpoint


def open_model(path: Path) -> Source:
    """A float model folder, a quantized checkpoint folder, a GGUF file, or a recipe's variant
    folder (its compressed-tensors export, else its GPTQ export, else its dense one)."""
    if not (path / "config.json").is_file() and path.is_dir():
        export = next((path / e for e in ENGINE_EXPORTS if (path / e / "config.json").is_file()), None)
        if export is None:
            raise InputError(f"{path}: neither a model folder nor a recipe variant with a "
                             f"{', '.join(ENGINE_EXPORTS)} export")
        path = export
    return open_checkpoint(path)
