"""What a QAT run has finished, kept on disk so that a killed run resumes where it stopped.

Training is the long part of a QAT variant (minutes a layer on a large model), and a job killed
an hour in should not start over. The folder holds one safetensors file per finished decoder
layer (its tensors as trained and its Linears' output errors) and the end-to-end phase's state
(the trained parameters, AdamW's moments, the step, the order of the windows still to come), each
written under a temporary name and renamed, so a kill mid-write leaves the previous file. Training
is deterministic, so a resumed run writes the same bytes as one that was never stopped.

Only safetensors and JSON are read back: nothing in the folder is unpickled. Whoever owns the
folder decides when it is stale (recipes/resume.py keys it by the variant's inputs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from core.errors import InputError
from core.schemes import QuantSpec
from core.tensors import GGMLTensor, LayerResult, QuantizedTensor

_PARTS = ("codes", "scales", "zeros")


class QATCheckpoint:
    """The progress of one run on the integer grid ``spec``, or on Q4_K (``spec`` None)."""

    def __init__(self, folder: Path, spec: QuantSpec | None):
        self.folder, self.spec = folder, spec

    def layer(self, index: int) -> LayerResult | None:
        """Layer ``index``'s result as saved, or None if the run did not finish it."""
        loaded = self._read(self._layer_path(index))
        if loaded is None:
            return None
        flat, meta = loaded
        tensors: dict = {}
        for key, tensor in flat.items():
            name, _, part = key.partition(":")
            if not part:
                tensors[name] = tensor
            elif part == "codes":
                tensors[name] = QuantizedTensor(self.spec, tensor, *(flat[f"{name}:{p}"] for p in _PARTS[1:]))
            elif part == "Q4_K":
                rows, row_bytes = tensor.shape
                tensors[name] = GGMLTensor("Q4_K", tensor.numpy(), (rows, row_bytes // 144 * 256))
        return LayerResult(tensors, {}, json.loads(meta["errors"]))

    def save_layer(self, index: int, result: LayerResult) -> None:
        flat = {}
        for name, t in result.tensors.items():
            if isinstance(t, QuantizedTensor):
                flat.update({f"{name}:{p}": getattr(t, p) for p in _PARTS})
            elif isinstance(t, GGMLTensor):
                flat[f"{name}:{t.ggml_type}"] = torch.from_numpy(t.raw)
            else:
                flat[name] = t
        self._write(self._layer_path(index), flat, {"errors": json.dumps(result.errors)})

    def end_to_end(self) -> tuple[dict[str, torch.Tensor], int] | None:
        """The end-to-end phase's saved tensors and the number of steps they follow, if any."""
        loaded = self._read(self.folder / "end-to-end.safetensors")
        return None if loaded is None else (loaded[0], int(loaded[1]["step"]))

    def save_end_to_end(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        self._write(self.folder / "end-to-end.safetensors", tensors, {"step": str(step)})

    def _layer_path(self, index: int) -> Path:
        return self.folder / f"layer-{index:04d}.safetensors"

    def _write(self, path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
        os.replace(tmp, path)

    def _read(self, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        if not path.exists():
            return None
        try:
            with safe_open(path, "pt") as f:  # the tensors and the metadata in one read
                return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
        except (SafetensorError, OSError, ValueError) as e:
            raise InputError(f"{path}: a damaged QAT checkpoint ({e}); delete it to train that part again") from None
