"""compressed-tensors checkpoints: llm-compressor's format, which vLLM serves natively and
transformers loads (with the ``compressed-tensors`` package).

Three layouts, by what the variant quantizes:

- ``pack-quantized`` (integer weights of 2-8 bits by group or channel; vLLM's W4A16/W8A16):
  ``X.weight_packed`` int32 ``[out, ceil(in·bits/32)]`` holds each row's codes packed densely along
  the input, element i at bits ``i·bits`` and up, low bits first (a 3-bit code may straddle two
  words). compressed-tensors calls a code ``level - 2**(bits-1)`` and packs it with that offset
  added back, so the stored bits are our unsigned levels as they are. ``X.weight_scale``
  ``[out, n_groups]``; when asymmetric ``X.weight_zero_point`` int32 ``[ceil(out·bits/32),
  n_groups]``, the zero-points packed the same way along the output dimension; ``X.weight_shape``.
- ``int-quantized`` (int8 weights by channel with int8 per-token dynamic activations: W8A8):
  ``X.weight`` int8, the level minus 128, and ``X.weight_scale`` ``[out, 1]``.
- ``float-quantized`` (fp8 e4m3 weights per tensor, channel or block, alone or with fp8 per-token
  dynamic activations: FP8_DYNAMIC, FP8_BLOCK): ``X.weight`` float8_e4m3fn and float32
  ``X.weight_scale``, as vLLM keeps fp8 scales.

Every other float tensor is float16, the config's dtype: our integer scales are fp16 values (every
integer checkpoint format stores fp16 scales, so the codes are chosen for them), and a model served
in bfloat16 would round them. The Linear modules left in 16 bits are listed in ``ignore``.

GPTQ's act-order with groups formed in the order it visits columns (``g_idx``) has no form here:
compressed-tensors 0.20 removed it ("actorder: group"). Act-order with static groups keeps groups
of consecutive columns and is written as ``actorder: weight``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import torch

from core.errors import InputError
from core.schemes import ActivationSpec, QuantSpec
from core.tensors import QuantizedTensor
from formats.checkpoint_format import CheckpointFormat, ExportContents
from formats.hf import HFCheckpoint
from formats.packing import pack_codes, unpack_codes
from formats.quantized_folder import Planned, QuantizedFolderWriter, unquantized_linears
from formats.quantized_layout import Expected, MixedLayout, QuantizedLayout


def layout(spec: QuantSpec, activations: ActivationSpec | None = None) -> str:
    """The compressed-tensors format that holds ``spec`` (with ``activations``); ValueError saying
    why when none does."""
    if spec.format == "int":
        if activations is None:
            if spec.granularity not in ("group", "channel"):
                raise ValueError(f"granularity '{spec.granularity}' integer weights (pack-quantized takes group or channel)")
            return "pack-quantized"
        if activations.format == "int8" and spec.bits == 8 and spec.symmetric and spec.granularity == "channel":
            return "int-quantized"
        raise ValueError(f"{activations.format} activations with {spec.label} weights (W8A8 int8 takes int8 channel "
                         "symmetric weights; fp8 activations take fp8_e4m3 weights)")
    if spec.format == "fp8_e4m3":
        if spec.granularity == "group":
            raise ValueError("fp8 weights by group (float-quantized takes tensor, channel or block)")
        if activations is not None and activations.format != "fp8":
            raise ValueError(f"{activations.format} activations with fp8 weights (FP8 takes fp8 activations)")
        return "float-quantized"
    raise ValueError(f"{spec.format} weights (compressed-tensors holds integer and fp8_e4m3 codes)")


class CompressedTensorsWriter(QuantizedFolderWriter):
    """One variant as a compressed-tensors folder, quantized Linear weights in the layout their spec
    (and ``activations``) call for. ``act_order``: fitted by GPTQ with act-order and static groups."""

    export = "compressed-tensors"

    def __init__(self, dest: Path, source: HFCheckpoint, names: list[str], quantized: set[str], spec: QuantSpec,
                 activations: ActivationSpec | None = None, act_order: bool = False,
                 specs: dict[str, QuantSpec] | None = None):
        self.format = self._accept(spec, lambda s: layout(s, activations), source, specs)
        ignore = ["lm_head"] + unquantized_linears(source, quantized)
        self._open(dest, source, names, quantized, self._quantization_config(activations, act_order, ignore))

    def _scale_shape(self, shape: tuple[int, int], spec: QuantSpec) -> tuple[int, ...]:
        out, n_in = shape
        if spec.granularity == "group":
            return (out, n_in // spec.group_size)
        if spec.granularity == "block":
            return (out // spec.group_size, n_in // spec.group_size)
        return (out, 1) if spec.granularity == "channel" else (1,)

    def stored(self, module: str, shape: tuple[int, int]) -> Planned:
        out, n_in = shape
        spec = self.spec_of(module)
        scales = self._scale_shape(shape, spec)
        if self.format == "int-quantized":
            return [(f"{module}.weight", torch.int8, shape), (f"{module}.weight_scale", torch.float16, scales)]
        if self.format == "float-quantized":
            return [(f"{module}.weight", torch.float8_e4m3fn, shape), (f"{module}.weight_scale", torch.float32, scales)]
        bits = spec.bits
        plan = [(f"{module}.weight_packed", torch.int32, (out, math.ceil(n_in * bits / 32))),
                (f"{module}.weight_scale", torch.float16, scales)]
        if not spec.symmetric:
            plan.append((f"{module}.weight_zero_point", torch.int32, (math.ceil(out * bits / 32), scales[1])))
        plan.append((f"{module}.weight_shape", torch.int64, (2,)))
        return plan

    def encode(self, payload: QuantizedTensor) -> list[torch.Tensor]:
        spec, scales = payload.spec, payload.scales
        scales = scales.reshape(-1)[:1] if spec.granularity == "tensor" else scales.reshape(self._scale_shape(payload.shape, spec))
        if self.format == "int-quantized":
            return [(payload.codes.to(torch.int16) - 128).to(torch.int8), scales.to(torch.float16)]
        if self.format == "float-quantized":
            return [payload.codes.view(torch.float8_e4m3fn), scales.to(torch.float32)]
        bits = spec.bits
        tensors = [pack_codes(payload.codes, bits), scales.to(torch.float16)]
        if not spec.symmetric:
            zeros = payload.zeros.round().to(torch.uint8)
            tensors.append(pack_codes(zeros.T.contiguous(), bits).T.contiguous())
        return tensors + [torch.tensor(payload.shape, dtype=torch.int64)]

    def _quantization_config(self, activations: ActivationSpec | None, act_order: bool, ignore: list[str]) -> dict:
        """One config group for one grid, targeting every Linear not ignored; with Linears on
        several grids (``bits: auto``), a group per grid, each targeting its Linears by name."""
        by_grid: dict[QuantSpec, list[str]] = {}
        for module, spec in self.module_specs.items():
            by_grid.setdefault(spec, []).append(module)
        targets = by_grid or {self.spec: ["Linear"]}
        inputs = None
        if activations is not None:
            inputs = {"num_bits": 8, "type": "int" if activations.format == "int8" else "float", "symmetric": True,
                      "strategy": "token", "dynamic": True, "group_size": None, "block_structure": None, "actorder": None}
        return {
            "quant_method": "compressed-tensors",
            "format": self.format,
            "quantization_status": "compressed",
            "config_groups": {f"group_{i}": {"targets": modules, "weights": _weights_config(spec, act_order),
                                             "input_activations": inputs, "output_activations": None, "format": self.format}
                              for i, (spec, modules) in enumerate(targets.items())},
            "ignore": ignore,
            "kv_cache_scheme": None,
            "sparsity_config": {},
        }


def _weights_config(spec: QuantSpec, act_order: bool) -> dict:
    """A config group's ``weights``: the grid of its Linears."""
    return {
        "num_bits": spec.bits, "type": "int" if spec.format == "int" else "float", "symmetric": spec.symmetric,
        "strategy": spec.granularity, "group_size": spec.group_size if spec.granularity == "group" else None,
        "block_structure": [spec.group_size] * 2 if spec.granularity == "block" else None,
        "dynamic": False, "actorder": "weight" if act_order else None, "observer": "minmax",
    }


class PackQuantized(QuantizedLayout):
    """``pack-quantized`` read back: integer codes by group or channel, packed along the input."""

    name = "pack-quantized"
    marker = ".weight_packed"

    def expected(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> Expected:
        module, (out, n_in), bits = name.removesuffix(".weight"), shape, self.spec.bits
        groups = self.groups(n_in)
        tensors = {f"{module}.weight_packed": (torch.int32, (out, math.ceil(n_in * bits / 32))),
                   f"{module}.weight_scale": (None, (out, groups)), f"{module}.weight_shape": (torch.int64, (2,))}
        if not self.spec.symmetric:
            tensors[f"{module}.weight_zero_point"] = (torch.int32, (math.ceil(out * bits / 32), groups))
        return tensors

    def check_stored(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> set[str]:
        stored = super().check_stored(raw, name, shape)
        said = raw.tensor(f"{name.removesuffix('.weight')}.weight_shape").tolist()
        if tuple(said) != shape:
            raise InputError(f"{raw.path}: tensor '{name.removesuffix('.weight')}.weight_shape' says {said}, "
                             f"the config gives {list(shape)}")
        return stored

    def shape(self, raw: HFCheckpoint, name: str) -> tuple[int, ...]:
        return tuple(raw.tensor(f"{name.removesuffix('.weight')}.weight_shape").tolist())

    def payload(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> QuantizedTensor:
        module, read, bits, (out, n_in) = name.removesuffix(".weight"), raw.tensor, self.spec.bits, shape
        codes = unpack_codes(read(f"{module}.weight_packed"), bits, n_in)
        scales = read(f"{module}.weight_scale").float()
        zeros = torch.full_like(scales, 2 ** (bits - 1)) if self.spec.symmetric else \
            unpack_codes(read(f"{module}.weight_zero_point").T.contiguous(), bits, out).T.float()
        return QuantizedTensor(self.spec, codes, scales, zeros)


class _Unpacked(QuantizedLayout):
    """The layouts that store ``X.weight`` itself in 8 bits, with ``X.weight_scale``."""

    marker = ".weight_scale"
    dtype: torch.dtype

    def expected(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> Expected:
        module, (out, n_in), size = name.removesuffix(".weight"), shape, self.spec.group_size or 1
        scales = {"tensor": None, "channel": (out, 1), "block": (out // size, n_in // size)}[self.spec.granularity]
        tensors = {name: (self.dtype, shape)}
        if scales is not None:
            tensors[f"{module}.weight_scale"] = (None, scales)
        elif f"{module}.weight_scale" not in raw.names or math.prod(raw.shape(f"{module}.weight_scale")) != 1:
            raise InputError(f"{raw.path}: no one-value tensor '{module}.weight_scale' for the per-tensor fp8 weight '{name}'")
        else:
            tensors[f"{module}.weight_scale"] = (None, raw.shape(f"{module}.weight_scale"))
        return tensors


class IntQuantized(_Unpacked):
    """``int-quantized`` read back: int8 levels minus 128, one scale per row."""

    name = "int-quantized"
    dtype = torch.int8

    def payload(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> QuantizedTensor:
        codes = (raw.tensor(name).to(torch.int16) + 128).to(torch.uint8)
        scales = raw.tensor(f"{name.removesuffix('.weight')}.weight_scale").float().reshape(shape[0], 1)
        return QuantizedTensor(self.spec, codes, scales, torch.full_like(scales, 128.0))


class FloatQuantized(_Unpacked):
    """``float-quantized`` read back: fp8 bit patterns, a scale per tensor, row or block."""

    name = "float-quantized"
    dtype = torch.float8_e4m3fn

    def payload(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> QuantizedTensor:
        scales = raw.tensor(f"{name.removesuffix('.weight')}.weight_scale").float()
        scales = scales.reshape(1, 1).expand(shape[0], 1).contiguous() if self.spec.granularity == "tensor" \
            else scales.reshape(-1, scales.shape[-1])
        return QuantizedTensor(self.spec, raw.tensor(name).view(torch.uint8), scales, torch.zeros_like(scales))


class CompressedTensorsFormat(CheckpointFormat):
    name = "compressed-tensors"
    codes = True
    holds_group_index = CompressedTensorsWriter.holds_group_index
    mixes_grids = True
    readable = "compressed-tensors (pack-quantized, int-quantized, float-quantized)"

    def check(self, spec: QuantSpec, activations: ActivationSpec | None) -> None:
        layout(spec, activations)

    def writer(self, dest: Path, contents: ExportContents) -> CompressedTensorsWriter:
        c = contents
        return CompressedTensorsWriter(dest, c.source, c.names, c.quantized, c.spec, c.activations, c.act_order, c.specs)

    def read(self, config: dict, raw: HFCheckpoint) -> QuantizedLayout:
        """Its weights' layout, as this module writes them (and llm-compressor): one config group,
        or a group per grid (``bits: auto``), each Linear read by the group that targets it."""
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("no config groups")
        fmt = config.get("format")  # compressed-tensors' "mixed-precision": each group names its own
        layouts = []
        for group in groups.values():
            layout = _group_layout(group.get("format") if fmt in (None, "mixed-precision") else fmt, group["weights"])
            layouts.append((targets_matcher(group.get("targets", ["Linear"])), layout))
        if len(layouts) == 1:
            return layouts[0][1]
        if len({layout.name for _, layout in layouts}) > 1:
            raise ValueError("config groups in different formats")
        return MixedLayout(layouts, f"{raw.path / 'config.json'}")


def targets_matcher(targets: list[str]) -> Callable[[str], bool]:
    """Whether a module is one of a config group's ``targets``, as compressed-tensors matches them:
    its class (``Linear``: every Linear the file quantizes), a ``re:`` regex, or its name."""
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"targets {targets!r}")
    if "Linear" in targets:
        return lambda module: True
    names = {t for t in targets if not t.startswith("re:")}
    try:
        patterns = [re.compile(t.removeprefix("re:")) for t in targets if t.startswith("re:")]
    except re.error as e:
        raise ValueError(f"targets {targets!r}: {e}") from None
    return lambda module: module in names or any(p.match(module) for p in patterns)


def _group_layout(fmt: str | None, w: dict) -> QuantizedLayout:
    """One config group's layout, from its format and its ``weights``."""
    strategy = w.get("strategy")
    if fmt == "pack-quantized" and w.get("type") == "int" and strategy in ("group", "channel"):
        return PackQuantized(QuantSpec(w["num_bits"], bool(w.get("symmetric", True)), strategy, w.get("group_size")))
    if fmt == "int-quantized" and w.get("type") == "int" and w.get("num_bits") == 8 and strategy == "channel" \
            and w.get("symmetric", True):
        return IntQuantized(QuantSpec(8, True, "channel"))
    if fmt == "float-quantized" and w.get("type") == "float" and w.get("num_bits") == 8 \
            and strategy in ("tensor", "channel", "block"):
        block = w.get("block_structure") if strategy == "block" else None
        if block is not None and (len(block) != 2 or block[0] != block[1]):
            raise ValueError(f"block_structure {block} (square blocks only)")
        return FloatQuantized(QuantSpec(8, True, strategy, block[0] if block else None, format="fp8_e4m3"))
    raise ValueError(f"format {fmt!r} with {w.get('num_bits')}-bit {w.get('type')} weights by {strategy}")


FORMAT = CompressedTensorsFormat()
