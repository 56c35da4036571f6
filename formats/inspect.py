"""What is inside a model file: metadata, tensor names, types, shapes and bits per weight."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from formats.hf import read_safetensors_header
from quant.types import InputError


# In a quantized checkpoint (GPTQ, AWQ, compressed-tensors, bitsandbytes), the tensors that describe
# a quantized weight (scales, zero-points, group maps, shapes, code tables) rather than hold weights.
_AUXILIARY = (".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx",
              ".weight.absmax", ".weight.quant_map", ".weight.quant_state.bitsandbytes__nf4",
              ".weight.quant_state.bitsandbytes__fp4")


@dataclass
class TensorEntry:
    name: str
    type: str
    shape: tuple[int, ...]
    nbytes: int
    weights: int | None = None  # the weights it holds: several per int32 word when packed; 0 for a scale

    def __post_init__(self) -> None:
        if self.weights is None:
            self.weights = int(np.prod(self.shape))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / max(1, self.weights or int(np.prod(self.shape)))


@dataclass
class FileSummary:
    path: Path
    format: str
    metadata: dict[str, str]
    tensors: list[TensorEntry]
    quantization: str | None = None  # a quantized checkpoint's scheme, from its folder's config.json

    @property
    def bits_per_weight(self) -> float:
        """Every byte of the file over the weights it holds (scales and zero-points count as cost)."""
        return 8.0 * sum(t.nbytes for t in self.tensors) / max(1, sum(t.weights for t in self.tensors))


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
    scheme, bits = _quantization(path)
    tensors = []
    for name, info in header.items():
        shape = tuple(info["shape"])
        weights = None
        if bits and name.endswith(_AUXILIARY):
            weights = 0
        elif bits and name.endswith((".qweight", ".weight_packed")):  # int32 words of packed codes
            weights = int(np.prod(shape)) * 32 // bits
        elif bits and info["dtype"] == "U8" and name.endswith(".weight"):  # bitsandbytes: two 4-bit codes a byte
            weights = int(np.prod(shape)) * 8 // bits
        tensors.append(TensorEntry(name, info["dtype"], shape, info["data_offsets"][1] - info["data_offsets"][0], weights))
    return FileSummary(path, "safetensors", {k: str(v) for k, v in meta.items()}, tensors, scheme)


def _quantization(path: Path) -> tuple[str | None, int | None]:
    """(scheme, code bits) of a quantized checkpoint, from the config.json beside the file."""
    import json

    try:
        config = json.loads((path.parent / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return None, None
    method = config.get("quant_method")
    if method in ("gptq", "awq"):
        group = config.get("group_size", -1)
        return f"{method} int{config.get('bits')} {'channel' if group == -1 else f'g{group}'}", config.get("bits")
    if method == "bitsandbytes" and config.get("load_in_4bit"):
        return f"bitsandbytes {config.get('bnb_4bit_quant_type')}", 4
    if method == "compressed-tensors":
        weights = next(iter(config.get("config_groups", {}).values()), {}).get("weights") or {}
        bits = weights.get("num_bits")
        return f"compressed-tensors {config.get('format')} {weights.get('type')}{bits} {weights.get('strategy')}", bits
    return None, None


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
