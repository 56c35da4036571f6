"""Quantized checkpoint folders read back: each quantized Linear as the codes, scales and zero-points
it holds (a ``QuantizedTensor``), every other tensor as it is.

The layouts our writers make, read back by the layouts each format's module holds beside its
writer (formats/compressed_tensors.py, gptq.py, awq.py, bitsandbytes.py), found through the
registry by the config's ``quant_method`` (formats/registry.py): compressed-tensors (``pack-quantized`` integer weights by group or channel,
``int-quantized`` int8 channels, ``float-quantized`` fp8 by tensor, channel or block), GPTQ (the
AutoGPTQ layout, v1 and v2, with ``g_idx``), AWQ (AutoAWQ's GEMM layout), and bitsandbytes as
transformers saves it (nf4/fp4, with or without double quantization, and LLM.int8). The folder is
checked as a float one is: its config's model must have every tensor, each quantized Linear
stored in its format's tensors of the shapes the config implies, and nothing else. So the engine
can run a variant on its real low-bit weights, and what it runs is exactly what was written; and
a customer's quantized checkpoint is a source like a float one (``tensor`` dequantizes it one
weight at a time), for a GGUF file or a report.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from core.errors import InputError
from core.tensors import QuantizedTensor, TensorPayload
from formats.architecture import expected_tensors, from_transformers, transformers_config
from formats.hf import HFCheckpoint, is_linear_weight, read_json, read_safetensors_header
from formats.quantized_layout import QuantizedLayout
from formats.registry import QUANT_METHODS


class QuantizedCheckpoint:
    """A checked quantized checkpoint folder. ``names`` are the model's tensors, as a float
    checkpoint of it would name them; ``payload(name)`` gives a quantized weight's codes, and
    ``tensor(name)`` any tensor in float32 (dequantized where quantized)."""

    def __init__(self, files: HFCheckpoint, method: str, layout: QuantizedLayout, stored: set[str], names: list[str],
                 fused: dict[str, list[str]] | None = None):
        self.path, self.config, self.arch = files.path, files.config, files.arch
        self.method, self.names = method, names
        self.layout = layout.name  # compressed-tensors' format (pack-quantized, ...); the method's name otherwise
        self._layout = layout
        self._fused = fused or {}  # a fused weight -> the stored parts it is made of, by rows
        self._stored_quantized = stored  # the quantized weights as stored (the parts, not the fused weight)
        self.quantized = stored - {p for parts in self._fused.values() for p in parts} | set(self._fused)
        self._files = files

    @property
    def architecture(self) -> str:
        return self._files.architecture

    @property
    def label(self) -> str:
        """What the checkpoint is, for a report: its method and weights, e.g. ``gptq int4-g128-asym``
        (``mixed int4-g64-sym + int4-g32-sym`` for Linears on several grids)."""
        return f"{self.method} {self._layout.label}"

    @property
    def bits_per_weight(self) -> float:
        """The bits the folder stores per weight, codes, scales, zero-points and indices included."""
        raw = self._files
        stored = sum(math.prod(raw.shape(n)) * raw.dtype(n).itemsize * 8 for n in raw.names)
        return stored / sum(math.prod(self.shape(n)) for n in self.names)

    # What a source checkpoint offers besides its tensors, as the float folder it was made from.
    @property
    def linear_modules(self) -> list[str]:
        return [n.removesuffix(".weight") for n in self.names if is_linear_weight(n, self.shape(n))]

    @property
    def tokenizer_dir(self) -> Path:
        return self._files.tokenizer_dir

    @property
    def tokenizer_config(self) -> dict:
        return self._files.tokenizer_config

    def side_file(self, name: str) -> dict:
        return self._files.side_file(name)

    def copy_side_files(self, dest: Path) -> None:
        self._files.copy_side_files(dest)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "QuantizedCheckpoint":
        path = Path(path)
        config = read_json(path / "config.json") if (path / "config.json").is_file() else None
        if not isinstance(config, dict) or not isinstance(config.get("quantization_config"), dict):
            raise InputError(f"{path}: not a quantized checkpoint (no quantization_config in config.json)")
        q = config["quantization_config"]
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise InputError(f"{path}: no *.safetensors weights in the checkpoint folder")
        headers = {f: read_safetensors_header(f).tensors for f in files}
        where = str(path / "config.json")
        hf = transformers_config(config, where)
        raw = HFCheckpoint(path, config, from_transformers(hf, config, where), headers)
        method = q.get("quant_method")
        layout = _layout(q, where, raw)
        expected, optional = expected_tensors(hf, where)
        stored = set(raw.names)
        quantized = {f"{n.removesuffix(layout.marker)}.weight" for n in stored if n.endswith(layout.marker)}
        needed, fused = set(), {}
        for name, shape in expected.items():
            parts = [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
            if name.endswith("mlp.gate_up_proj.weight") and name not in stored and set(parts) <= quantized:
                # Phi-3's GPTQ and AWQ folders split it as GPTQModel quantizes it: fused back here
                for part in parts:
                    needed |= _check_stored(raw, layout.for_weight(part), part, (shape[0] // 2, shape[1]))
                fused[name] = parts
            elif name in quantized:
                needed |= _check_stored(raw, layout.for_weight(name), name, shape)
            elif name in stored:
                if raw.shape(name) != shape:
                    raise InputError(f"{path}: tensor '{name}' has shape {list(raw.shape(name))}, the config gives {list(shape)}")
                needed.add(name)
            elif name not in optional:
                raise InputError(f"{path}: no tensor '{name}' in the checkpoint ({raw.architecture} needs it)")
        extra = sorted(stored - needed)
        if extra:
            raise InputError(f"{path}: tensor '{extra[0]}' is not part of the {method} checkpoint of the "
                             f"{raw.architecture} that config.json describes")
        return cls(raw, method, layout, quantized, [n for n in expected if n in quantized or n in stored or n in fused], fused)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._fused:
            shapes = [self.shape(p) for p in self._fused[name]]
            return sum(s[0] for s in shapes), shapes[0][1]
        if name in self._stored_quantized:
            return self._layout.for_weight(name).shape(self._files, name)
        return self._files.shape(name)

    def payload(self, name: str) -> TensorPayload:
        if name in self._fused:
            parts = [self.payload(p) for p in self._fused[name]]
            if any(p.group_index is not None or p.spec != parts[0].spec for p in parts):
                return torch.cat([p.dequantize() for p in parts])  # act-order parts keep their own column groups
            return QuantizedTensor(parts[0].spec, *(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "zeros")))
        if name not in self._stored_quantized:
            return self._files.tensor(name)
        return self._layout.for_weight(name).payload(self._files, name, self.shape(name))

    def tensor(self, name: str) -> torch.Tensor:
        payload = self.payload(name)
        return payload.dequantize() if isinstance(payload, QuantizedTensor) else payload.float()

    def dtype(self, name: str) -> torch.dtype:
        """float32 for a quantized weight (what ``tensor`` gives), the stored dtype otherwise."""
        return torch.float32 if name in self.quantized else self._files.dtype(name)


def _layout(q: dict, where: str, raw: HFCheckpoint) -> QuantizedLayout:
    """The weights' layout, from the quantization_config, by its format's reader."""
    method = q.get("quant_method")
    fmt = QUANT_METHODS.get(method) if isinstance(method, str) else None
    if fmt is None:
        readable = [f.readable for f in QUANT_METHODS.values()]
        raise InputError(f"{where}: quant_method {method!r}: the readable quantized checkpoints are "
                         f"{', '.join(readable[:-1])} and {readable[-1]}")
    try:
        return fmt.read(q, raw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(f"{where}: a {method} quantization_config this reader does not take ({e})") from None


def _check_stored(raw: HFCheckpoint, layout: QuantizedLayout, name: str, shape: tuple[int, ...]) -> set[str]:
    """The stored tensors of one quantized weight ``[out, in]``, checked by its layout; returns
    their names."""
    spec, (out, n_in) = layout.spec, shape
    if spec.granularity in ("group", "block") and (n_in % spec.group_size or (spec.granularity == "block" and out % spec.group_size)):
        raise InputError(f"{raw.path}: {spec.granularity} size {spec.group_size} does not divide the {list(shape)} "
                         f"weight of '{name.removesuffix('.weight')}'")
    return layout.check_stored(raw, name, shape)
