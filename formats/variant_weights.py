"""A variant's weights between its quantizer and its evaluation, kept on disk as the quantizer made
them (codes and scales, ggml blocks, float tensors), one safetensors file per tensor, and read back
as a source: scoring a variant then streams its layers as scoring the original does, and the
payloads of a calibrated pass wait for the export loop on disk rather than in memory (for an 8B
model at 4 bits, 7 GB of codes). The files are scratch: a job stages them and never commits them.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.architecture import Architecture
from core.schemes import QuantSpec
from core.tensors import GGMLTensor, MixedPrecisionTensor, QuantizedTensor, StoredGGMLTensor, TensorPayload
from formats.sources import Source


class VariantWeights:
    """The checkpoint ``base`` with the tensors put here in place of its own: the same names,
    shapes, architecture and config, as every reader of a source expects."""

    def __init__(self, folder: Path, base: Source):
        self.folder, self.base = folder, base
        self._index = {name: i for i, name in enumerate(base.names)}
        self._held: set[str] = set()

    def put(self, name: str, payload: TensorPayload) -> None:
        tensors, meta = _encode(payload)
        self.folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, self._file(name), metadata=meta)
        self._held.add(name)

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def payload(self, name: str) -> TensorPayload:
        """The tensor as its quantizer made it, or as the base stores it where none was put here."""
        if name not in self._held:
            return self.base.payload(name)
        with safe_open(self._file(name), "pt") as f:
            return _decode({k: f.get_tensor(k) for k in f.keys()}, f.metadata())

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._held:
            return self.base.tensor(name)
        payload = self.payload(name)
        return payload.to(torch.float32) if isinstance(payload, torch.Tensor) else payload.dequantize()

    @property
    def path(self) -> Path:
        return self.base.path

    @property
    def config(self) -> dict:
        return self.base.config

    @property
    def arch(self) -> Architecture:
        return self.base.arch

    @property
    def names(self) -> list[str]:
        return self.base.names

    @property
    def linear_modules(self) -> list[str]:
        return self.base.linear_modules

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def _file(self, name: str) -> Path:
        return self.folder / f"{self._index[name]:06d}.safetensors"


def _encode(payload: TensorPayload) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if isinstance(payload, torch.Tensor):
        return {"value": payload}, {"kind": "tensor"}
    if isinstance(payload, QuantizedTensor):
        return _quantized(payload, ""), {"kind": "quantized", "spec": json.dumps(asdict(payload.spec))}
    if isinstance(payload, MixedPrecisionTensor):
        tensors = _quantized(payload.base, "base.") | {"columns": payload.columns, "dense": payload.dense}
        return tensors, {"kind": "mixed", "spec": json.dumps(asdict(payload.base.spec))}
    if isinstance(payload, GGMLTensor):
        # copied where torch cannot take the array (read-only) or safetensors would refuse it (an
        # F32 source tensor's values share its bytes); else saved as it is (an 8B head: 430 MB)
        shared = isinstance(payload, StoredGGMLTensor) or not payload.raw.flags.writeable
        tensors = {"raw": torch.from_numpy(np.array(payload.raw) if shared else payload.raw)}
        if isinstance(payload, StoredGGMLTensor):
            tensors["values"] = payload.values
        return tensors, {"kind": "ggml", "ggml_type": payload.ggml_type, "shape": json.dumps(list(payload.shape))}
    raise TypeError(f"no stored form for a {type(payload).__name__}")


def _quantized(q: QuantizedTensor, prefix: str) -> dict[str, torch.Tensor]:
    tensors = {"codes": q.codes, "scales": q.scales, "zeros": q.zeros}
    if q.group_index is not None:
        tensors["group_index"] = q.group_index
    return {prefix + k: v for k, v in tensors.items()}


def _decode(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> TensorPayload:
    kind = meta["kind"]
    if kind == "tensor":
        return tensors["value"]
    if kind in ("quantized", "mixed"):
        prefix = "base." if kind == "mixed" else ""
        q = QuantizedTensor(QuantSpec(**json.loads(meta["spec"])), tensors[prefix + "codes"], tensors[prefix + "scales"],
                            tensors[prefix + "zeros"], tensors.get(prefix + "group_index"))
        return q if kind == "quantized" else MixedPrecisionTensor(q, tensors["columns"], tensors["dense"])
    shape = tuple(json.loads(meta["shape"]))
    raw = tensors["raw"].numpy()
    if "values" in tensors:
        return StoredGGMLTensor(meta["ggml_type"], raw, shape, tensors["values"])
    return GGMLTensor(meta["ggml_type"], raw, shape)
