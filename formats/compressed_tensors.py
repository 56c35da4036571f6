"""compressed-tensors checkpoints: llm-compressor's format, which vLLM serves natively and
transformers loads (with the ``compressed-tensors`` package).

A quantized Linear ``X`` ("pack-quantized", integer weights of 2-8 bits) is stored as:

- ``X.weight_packed`` int32 ``[out, ceil(in·bits/32)]``: the codes of each row packed densely
  along the input, element i at bits ``i·bits`` and up, low bits first (a 3-bit code may straddle
  two words). compressed-tensors calls a code ``level - 2**(bits-1)`` and packs it with that offset
  added back, so the stored bits are our unsigned levels as they are.
- ``X.weight_scale`` ``[out, n_groups]``.
- ``X.weight_zero_point`` int32 ``[ceil(out·bits/32), n_groups]`` when asymmetric: the zero-points
  packed the same way along the output dimension.
- ``X.weight_shape`` int64 ``[2]``.

GPTQ's act-order with groups formed in the order it visits columns (``g_idx``) has no form here:
compressed-tensors 0.20 removed it ("actorder: group"). Act-order with static groups keeps groups
of consecutive columns and is written as ``actorder: weight``.

Every float tensor is float16, the config's dtype: our integer scales are fp16 values (every
integer checkpoint format stores fp16 scales, so the codes are chosen for them), and a model
served in bfloat16 would round them. The Linear modules left in 16 bits are listed in ``ignore``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from formats.hf import HFCheckpoint, SafetensorsFolderWriter, export_config, is_linear_weight
from quant.types import InputError, QuantizedTensor, QuantSpec, TensorPayload

_FP16_MAX = torch.finfo(torch.float16).max


def supports(spec: QuantSpec) -> str | None:
    """Why ``spec`` has no pack-quantized form, or None when it has one."""
    if spec.format != "int":
        return f"{spec.format} weights are not integer codes (pack-quantized holds int2-int8)"
    if spec.granularity not in ("group", "channel"):
        return f"granularity '{spec.granularity}' (pack-quantized takes group or channel)"
    return None


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 levels ``[rows, n]`` -> int32 ``[rows, ceil(n·bits/32)]``, element i at bit i·bits."""
    rows, n = codes.shape
    padded = math.ceil(n / 32) * 32
    levels = np.zeros((rows, padded), dtype=np.uint8)
    levels[:, :n] = codes.numpy()
    stream = (levels[..., None] >> np.arange(bits, dtype=np.uint8)) & 1  # [rows, padded, bits], low bit first
    words = np.packbits(stream.reshape(rows, -1), axis=-1, bitorder="little").view("<i4")
    return torch.from_numpy(np.ascontiguousarray(words[:, : math.ceil(n * bits / 32)]).astype(np.int32))


class CompressedTensorsWriter:
    """Streams one variant into a compressed-tensors folder: quantized Linear weights packed, every
    other tensor in float16. ``act_order``: fitted by GPTQ with act-order and static groups."""

    def __init__(self, dest: Path, source: HFCheckpoint, names: list[str], quantized: set[str], spec: QuantSpec,
                 act_order: bool = False):
        reason = supports(spec)
        if reason:
            raise InputError(f"compressed-tensors export: {reason}")
        self.spec = spec
        self.act_order = act_order
        self.quantized = quantized
        plan = []
        for name in names:
            shape = tuple(source.shape(name))
            if name in quantized:
                plan += self._packed_plan(name.removesuffix(".weight"), shape)
            else:
                plan.append((name, torch.float16, shape))
        config = export_config(source, torch.float16)
        linears = [n.removesuffix(".weight") for n in names if is_linear_weight(n, tuple(source.shape(n)))]
        ignore = ["lm_head"] + [m for m in linears if f"{m}.weight" not in quantized]
        config["quantization_config"] = self._quantization_config(ignore)
        self._folder = SafetensorsFolderWriter(dest, plan, config, source)

    def _packed_plan(self, module: str, shape: tuple[int, int]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        out, n_in = shape
        bits = self.spec.bits
        groups = n_in // self.spec.group_size if self.spec.granularity == "group" else 1
        plan = [(f"{module}.weight_packed", torch.int32, (out, math.ceil(n_in * bits / 32))),
                (f"{module}.weight_scale", torch.float16, (out, groups))]
        if not self.spec.symmetric:
            plan.append((f"{module}.weight_zero_point", torch.int32, (math.ceil(out * bits / 32), groups)))
        plan.append((f"{module}.weight_shape", torch.int64, (2,)))
        return plan

    def _quantization_config(self, ignore: list[str]) -> dict:
        spec = self.spec
        weights = {
            "num_bits": spec.bits, "type": "int", "symmetric": spec.symmetric, "strategy": spec.granularity,
            "group_size": spec.group_size if spec.granularity == "group" else None, "dynamic": False,
            "actorder": "weight" if self.act_order else None, "block_structure": None, "observer": "minmax",
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ignore,
            "kv_cache_scheme": None,
            "sparsity_config": {},
        }

    def add(self, name: str, payload: TensorPayload) -> None:
        if name not in self.quantized:
            if not isinstance(payload, torch.Tensor):
                raise InputError(f"compressed-tensors export: tensor '{name}' is quantized but not a Linear weight the variant targets")
            if payload.is_floating_point() and payload.abs().max() > _FP16_MAX:
                raise InputError(f"compressed-tensors export: tensor '{name}' exceeds the float16 range")
            self._folder.write(name, payload.to(torch.float16))
            return
        if not isinstance(payload, QuantizedTensor) or payload.group_index is not None:
            kind = "act-order groups (g_idx)" if isinstance(payload, QuantizedTensor) else type(payload).__name__
            raise InputError(f"compressed-tensors export: tensor '{name}' ({kind}) has no pack-quantized form")
        module = name.removesuffix(".weight")
        bits = self.spec.bits
        self._folder.write(f"{module}.weight_packed", pack_codes(payload.codes, bits))
        self._folder.write(f"{module}.weight_scale", payload.scales.to(torch.float16))
        if not self.spec.symmetric:
            zeros = payload.zeros.round().to(torch.uint8)
            self._folder.write(f"{module}.weight_zero_point", pack_codes(zeros.T.contiguous(), bits).T.contiguous())
        self._folder.write(f"{module}.weight_shape", torch.tensor(payload.shape, dtype=torch.int64))

    def finish(self) -> Path:
        return self._folder.finish()

    def abort(self) -> None:
        self._folder.abort()
