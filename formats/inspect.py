"""What is inside a model file: metadata, tensor names, types, shapes and bits per weight."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType

from core.errors import InputError
from formats.gguf_file import MAGIC, read_gguf_header
from formats.hf import read_json, read_safetensors_header


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
            self.weights = math.prod(self.shape)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / max(1, self.weights or math.prod(self.shape))


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
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    if head[:4] == MAGIC:
        return _inspect_gguf(path)
    if path.suffix == ".safetensors" or head[8:9] == b"{":
        return _inspect_safetensors(path)
    raise InputError(f"{path}: neither a GGUF nor a safetensors file")


def _inspect_safetensors(path: Path) -> FileSummary:
    header = read_safetensors_header(path)
    scheme, bits = _quantization(path)
    tensors = []
    for name, info in header.tensors.items():
        shape = tuple(info["shape"])
        weights = None
        if bits and name.endswith(_AUXILIARY):
            weights = 0
        elif bits and name.endswith((".qweight", ".weight_packed")):  # int32 words of packed codes
            weights = math.prod(shape) * 32 // bits
        elif bits and info["dtype"] == "U8" and name.endswith(".weight"):  # bitsandbytes: two 4-bit codes a byte
            weights = math.prod(shape) * 8 // bits
        tensors.append(TensorEntry(name, info["dtype"], shape, info["data_offsets"][1] - info["data_offsets"][0], weights))
    return FileSummary(path, "safetensors", header.metadata, tensors, scheme)


def _quantization(path: Path) -> tuple[str | None, int | None]:
    """(scheme, code bits) of a quantized checkpoint, from the config.json beside the file; (None,
    None) where there is none, or it does not describe a scheme this knows."""
    try:
        config = read_json(path.parent / "config.json")
    except InputError:
        return None, None
    config = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(config, dict):
        return None, None
    method, bits = config.get("quant_method"), config.get("bits")
    if method in ("gptq", "awq") and bits in (2, 3, 4, 8):
        group = config.get("group_size", -1)
        return f"{method} int{bits} {'channel' if group == -1 else f'g{group}'}", bits
    if method == "bitsandbytes" and config.get("load_in_4bit"):
        return f"bitsandbytes {config.get('bnb_4bit_quant_type')}", 4
    groups = config.get("config_groups")
    group = next(iter(groups.values()), None) if isinstance(groups, dict) and groups else None
    weights = group.get("weights") if isinstance(group, dict) else None
    if method == "compressed-tensors" and isinstance(weights, dict) and weights.get("num_bits") in range(1, 33):
        bits = weights["num_bits"]
        return f"compressed-tensors {config.get('format')} {weights.get('type')}{bits} {weights.get('strategy')}", bits
    return None, None


def _inspect_gguf(path: Path) -> FileSummary:
    header = read_gguf_header(path)
    if not header.tensors:
        raise InputError(f"{path}: the GGUF file holds no tensors (a vocabulary-only file?), so no model to inspect")
    metadata: dict[str, str] = {}
    for key, value in header.fields.items():
        if header.types[key][0] == GGUFValueType.ARRAY:
            metadata[key] = f"[{len(value)} items]"
        else:
            text = str(value)
            metadata[key] = text if len(text) <= 120 else text[:117] + "..."
    tensors = [TensorEntry(t.name, t.type.name, t.shape, t.n_bytes) for t in header.tensors]
    return FileSummary(path, "gguf", metadata, tensors)
