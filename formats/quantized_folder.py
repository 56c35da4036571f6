"""The part every quantized-checkpoint writer shares (GPTQ, AWQ, compressed-tensors, bitsandbytes):
a folder transformers can open, each quantized Linear weight stored as its format's tensors, every
other tensor in one float dtype, streamed in checkpoint order."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

import torch

from core.errors import InputError
from core.schemes import QuantSpec
from core.tensors import QuantizedTensor, TensorPayload
from formats.hf import HFCheckpoint, SafetensorsFolderWriter, export_config

Planned = list[tuple[str, torch.dtype, tuple[int, ...]]]
T = TypeVar("T")

# the Linears vLLM runs as one product (its Llama-family models' ``packed_modules_mapping``): it loads
# them with one kernel, so they must share a grid, and it names them by the product in its GPTQ configs
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_name(module: str) -> str:
    """The name vLLM gives the product ``module`` is part of; the module itself where it is fused with none."""
    parent, _, leaf = module.rpartition(".")
    return next((f"{parent}.{fused}" for fused, parts in FUSED.items() if leaf in parts), module)


def by_product(modules) -> dict[str, list[str]]:
    """The Linear ``modules`` grouped by the product vLLM runs them as (``fused_name``), in their order."""
    products: dict[str, list[str]] = {}
    for module in modules:
        products.setdefault(fused_name(module), []).append(module)
    return products


def unquantized_linears(source: HFCheckpoint, quantized: set[str]) -> list[str]:
    """The decoder Linear modules a variant leaves in 16 bits, which a config must name so that
    loaders do not look for codes there."""
    return [m for m in source.linear_modules if f"{m}.weight" not in quantized]


class QuantizedFolderWriter:
    """Subclasses set what ``stored`` and ``encode`` read, then call ``_open``.

    ``stored(module, shape)`` lists the tensors one quantized ``[out, in]`` weight becomes (name,
    dtype, shape); ``encode(payload)`` makes them, in the same order. The other tensors are
    ``float_dtype`` (float16 by default, the dtype of integer scales), and the config says so.
    """

    export = "quantized"  # the export's name in messages
    holds_group_index = False  # whether act-order groups (GPTQ's g_idx) have a form in this format
    float_dtype = torch.float16
    # GPTQ and AWQ: Phi-3's fused gate_up_proj is stored as gate_proj and up_proj, the modules
    # GPTQModel's Phi-3 definition quantizes (vLLM stacks them back into one product)
    splits_gate_up = False

    def _accept(self, spec: QuantSpec, check: Callable[[QuantSpec], T], source: HFCheckpoint | None = None,
                specs: dict[str, QuantSpec] | None = None) -> T:
        """Keep ``spec`` and the grids of the weights that have their own (``specs`` by weight name,
        from ``source``: ``bits: auto``) if ``check`` (which raises ValueError saying why not) accepts
        each; returns what ``check`` returns for ``spec``."""
        try:
            result = check(spec)
            for own in set((specs or {}).values()):
                check(own)
        except ValueError as e:
            raise InputError(f"{self.export} export: no layout holds {e}") from None
        self.spec = spec
        self.module_specs = {part.removesuffix(".weight"): own for name, own in (specs or {}).items()
                             for part, _ in self._parts(name, tuple(source.shape(name)))}
        return result

    def spec_of(self, module: str) -> QuantSpec:
        """The grid of the quantized Linear ``module`` (as stored: Phi-3's gate_proj, not gate_up_proj)."""
        return self.module_specs.get(module, self.spec)

    def _open(self, dest: Path, source: HFCheckpoint, names: list[str], quantized: set[str],
              quantization_config: dict) -> None:
        self.quantized = quantized
        plan: Planned = []
        for name in names:
            for part, rows in self._parts(name, tuple(source.shape(name))):
                shape = tuple(source.shape(name)) if rows is None else (rows.stop - rows.start, *source.shape(name)[1:])
                plan += self.stored(part.removesuffix(".weight"), shape) if name in quantized else [(part, self.float_dtype, shape)]
        config = export_config(source, self.float_dtype)
        config["quantization_config"] = quantization_config
        self._folder = SafetensorsFolderWriter(dest, plan, config, source)

    @property
    def folder(self) -> Path:
        """Where the files are being written (side files go here too)."""
        return self._folder.path

    def stored(self, module: str, shape: tuple[int, int]) -> Planned:
        raise NotImplementedError

    def encode(self, payload: QuantizedTensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def _parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, slice | None]]:
        """The tensors one checkpoint tensor is stored as, each with its rows (None: all of it)."""
        if self.splits_gate_up and name.endswith("mlp.gate_up_proj.weight"):
            half, base = shape[0] // 2, name.removesuffix("gate_up_proj.weight")
            return [(base + "gate_proj.weight", slice(0, half)), (base + "up_proj.weight", slice(half, shape[0]))]
        return [(name, None)]

    def add(self, name: str, payload: TensorPayload) -> None:
        if name in self.quantized:
            if not isinstance(payload, QuantizedTensor):
                raise InputError(f"{self.export} export: tensor '{name}' ({type(payload).__name__}) has no {self.export} form")
            if payload.group_index is not None and not self.holds_group_index:
                raise InputError(f"{self.export} export: tensor '{name}' has act-order groups (g_idx), which {self.export} cannot hold")
            for part, rows in self._parts(name, payload.shape):
                piece = payload if rows is None else payload.rows(rows)
                for (stored, _, _), tensor in zip(self.stored(part.removesuffix(".weight"), piece.shape), self.encode(piece), strict=True):
                    self._folder.write(stored, tensor)
            return
        if not isinstance(payload, torch.Tensor):
            raise InputError(f"{self.export} export: tensor '{name}' is quantized but not a Linear weight the variant targets")
        if payload.is_floating_point() and _magnitude(payload) > torch.finfo(self.float_dtype).max:
            raise InputError(f"{self.export} export: tensor '{name}' exceeds the {self.float_dtype} range")
        for part, rows in self._parts(name, tuple(payload.shape)):
            self._folder.write(part, payload if rows is None else payload[rows], cast=True)

    def finish(self) -> Path:
        return self._folder.finish()

    def abort(self) -> None:
        self._folder.abort()


def _magnitude(tensor: torch.Tensor) -> float:
    """The largest ``|value|``, without the copy ``tensor.abs()`` makes (an 8B embedding: 1 GiB)."""
    low, high = torch.aminmax(tensor)
    return max(-float(low), float(high))
