"""What is inside a model file: metadata, tensor names, types, shapes and bits per weight."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType

from core.errors import InputError
from formats.compressed_tensors import targets_matcher
from formats.gguf_file import MAGIC, read_gguf_header
from formats.gptq import read_dynamic
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
    scheme, bits_of = _quantization(path)
    tensors = []
    for name, info in header.tensors.items():
        shape = tuple(info["shape"])
        weights = None
        bits = bits_of(name.rpartition(".weight")[0] or name.rpartition(".")[0]) if bits_of else None
        if bits and name.endswith(_AUXILIARY):
            weights = 0
        elif bits and name.endswith((".qweight", ".weight_packed")):  # int32 words of packed codes
            weights = math.prod(shape) * 32 // bits
        elif bits and info["dtype"] == "U8" and name.endswith(".weight"):  # bitsandbytes: two 4-bit codes a byte
            weights = math.prod(shape) * 8 // bits
        tensors.append(TensorEntry(name, info["dtype"], shape, info["data_offsets"][1] - info["data_offsets"][0], weights))
    return FileSummary(path, "safetensors", header.metadata, tensors, scheme)


def _quantization(path: Path) -> tuple[str | None, Callable[[str], int] | None]:
    """(scheme, a module's code bits) of a quantized checkpoint, from the config.json beside the
    file; (None, None) where there is none, or it does not describe a scheme this knows. A file of
    several grids (GPTQModel's ``dynamic``, compressed-tensors' config groups) gives each module its
    grid's bits."""
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
        try:
            overrides = [(matches, v.get("bits", bits)) for matches, v in read_dynamic(config)]
        except ValueError:  # overrides this does not read
            return None, None
        mixed = f" (+ {len(overrides)} overrides: {', '.join(sorted({f'int{b}' for _, b in overrides}))})" if overrides else ""
        return f"{method} int{bits} {'channel' if group == -1 else f'g{group}'}{mixed}", \
            lambda module: next((b for matches, b in overrides if matches(module)), bits)
    if method == "bitsandbytes" and config.get("load_in_4bit"):
        return f"bitsandbytes {config.get('bnb_4bit_quant_type')}", lambda module: 4
    groups = config.get("config_groups")
    if method != "compressed-tensors" or not isinstance(groups, dict) or not groups:
        return None, None
    try:
        grids = [(targets_matcher(g.get("targets")), g["weights"]) for g in groups.values()
                 if isinstance(g, dict) and isinstance(g.get("weights"), dict) and g["weights"].get("num_bits") in range(1, 33)]
    except ValueError:  # targets this does not read
        return None, None
    if len(grids) != len(groups):
        return None, None
    names = [f"{w.get('type')}{w['num_bits']} " + (f"g{w['group_size']}" if w.get("group_size") else str(w.get("strategy")))
             for _, w in grids]
    return f"compressed-tensors {config.get('format')} {' + '.join(dict.fromkeys(names))}", \
        lambda module: next((w["num_bits"] for matches, w in grids if matches(module)), None)


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
