"""The part every quantized-checkpoint writer shares (GPTQ, AWQ, compressed-tensors): a folder
transformers can open, each quantized Linear weight stored as its format's tensors, every other
tensor as float16, streamed in checkpoint order."""

from __future__ import annotations

from pathlib import Path

import torch

from formats.hf import HFCheckpoint, SafetensorsFolderWriter, export_config
from quant.types import InputError, QuantizedTensor, TensorPayload

Planned = list[tuple[str, torch.dtype, tuple[int, ...]]]


class QuantizedFolderWriter:
    """Subclasses set what ``stored`` and ``encode`` read, then call ``_open``.

    ``stored(module, shape)`` lists the tensors one quantized ``[out, in]`` weight becomes (name,
    dtype, shape); ``encode(payload)`` makes them, in the same order. Float tensors are float16,
    the dtype of the integer scales, and the config says so.
    """

    export = "quantized"  # the export's name in messages
    holds_group_index = False  # whether act-order groups (GPTQ's g_idx) have a form in this format

    def _open(self, dest: Path, source: HFCheckpoint, names: list[str], quantized: set[str],
              quantization_config: dict) -> None:
        self.quantized = quantized
        plan: Planned = []
        for name in names:
            shape = tuple(source.shape(name))
            plan += self.stored(name.removesuffix(".weight"), shape) if name in quantized else [(name, torch.float16, shape)]
        config = export_config(source, torch.float16)
        config["quantization_config"] = quantization_config
        self._folder = SafetensorsFolderWriter(dest, plan, config, source)

    @property
    def folder(self) -> Path:
        """Where the files are being written (side files go here too)."""
        return self._folder.tmp

    def stored(self, module: str, shape: tuple[int, int]) -> Planned:
        raise NotImplementedError

    def encode(self, payload: QuantizedTensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def add(self, name: str, payload: TensorPayload) -> None:
        if name in self.quantized:
            if not isinstance(payload, QuantizedTensor):
                raise InputError(f"{self.export} export: tensor '{name}' ({type(payload).__name__}) has no {self.export} form")
            if payload.group_index is not None and not self.holds_group_index:
                raise InputError(f"{self.export} export: tensor '{name}' has act-order groups (g_idx), which {self.export} cannot hold")
            module = name.removesuffix(".weight")
            for (stored, _, _), tensor in zip(self.stored(module, payload.shape), self.encode(payload), strict=True):
                self._folder.write(stored, tensor)
            return
        if not isinstance(payload, torch.Tensor):
            raise InputError(f"{self.export} export: tensor '{name}' is quantized but not a Linear weight the variant targets")
        if payload.is_floating_point() and payload.abs().max() > torch.finfo(torch.float16).max:
            raise InputError(f"{self.export} export: tensor '{name}' exceeds the float16 range")
        self._folder.write(name, payload.to(torch.float16))

    def finish(self) -> Path:
        return self._folder.finish()

    def abort(self) -> None:
        self._folder.abort()
