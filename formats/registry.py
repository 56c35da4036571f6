"""Every export format by its recipe name, each the ``FORMAT`` of its own module (the base is in
formats/checkpoint_format.py). A new format is a module with its writer, its ``FORMAT``, and, if
it is a quantized folder, its layouts read back; then one line in ``FORMATS`` and, if readable,
one in ``QUANT_METHODS``. The orders below are what users see, so they are written out."""

from __future__ import annotations

from formats import awq, bitsandbytes, compressed_tensors, gguf, gptq, hf
from formats.checkpoint_format import CheckpointFormat

# in the order a recipe's ``exports`` error lists them
FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (
    hf.FORMAT, gguf.FORMAT, compressed_tensors.FORMAT, gptq.FORMAT, awq.FORMAT, bitsandbytes.FORMAT)}

# the quantized folders read back, by their config's ``quant_method``, in the order an unreadable
# config's message lists them
QUANT_METHODS: dict[str, CheckpointFormat] = {f.name: f for f in (
    gptq.FORMAT, awq.FORMAT, compressed_tensors.FORMAT, bitsandbytes.FORMAT)}

# what the engine runs from a recipe's variant folder, in the order it takes them: the low-bit
# formats it has kernels for, then the dense weights
ENGINE_EXPORTS: tuple[str, ...] = (compressed_tensors.FORMAT.name, gptq.FORMAT.name, hf.FORMAT.name)


def in_writing_order(exports: list[str]) -> list[CheckpointFormat]:
    """The formats of ``exports``: the folders, then the files, each in registry order."""
    chosen = [f for f in FORMATS.values() if f.name in exports]
    return [f for f in chosen if f.folder] + [f for f in chosen if not f.folder]


def is_folder(output: str) -> bool:
    """Whether the output ``output`` of a variant (a format's name, or a side file such as the GGUF
    file's ``modelfile``) is a folder."""
    return output in FORMATS and FORMATS[output].folder
