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
from pathlib import Path

import torch

from core.schemes import ActivationSpec
from core.schemes import QuantSpec
from core.tensors import QuantizedTensor
from formats.hf import HFCheckpoint
from formats.packing import pack_codes
from formats.quantized_folder import Planned, QuantizedFolderWriter, unquantized_linears


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
                 activations: ActivationSpec | None = None, act_order: bool = False):
        self.format = self._accept(spec, lambda s: layout(s, activations))
        ignore = ["lm_head"] + unquantized_linears(source, quantized)
        self._open(dest, source, names, quantized, self._quantization_config(activations, act_order, ignore))

    def _scale_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        out, n_in = shape
        spec = self.spec
        if spec.granularity == "group":
            return (out, n_in // spec.group_size)
        if spec.granularity == "block":
            return (out // spec.group_size, n_in // spec.group_size)
        return (out, 1) if spec.granularity == "channel" else (1,)

    def stored(self, module: str, shape: tuple[int, int]) -> Planned:
        out, n_in = shape
        scales = self._scale_shape(shape)
        if self.format == "int-quantized":
            return [(f"{module}.weight", torch.int8, shape), (f"{module}.weight_scale", torch.float16, scales)]
        if self.format == "float-quantized":
            return [(f"{module}.weight", torch.float8_e4m3fn, shape), (f"{module}.weight_scale", torch.float32, scales)]
        bits = self.spec.bits
        plan = [(f"{module}.weight_packed", torch.int32, (out, math.ceil(n_in * bits / 32))),
                (f"{module}.weight_scale", torch.float16, scales)]
        if not self.spec.symmetric:
            plan.append((f"{module}.weight_zero_point", torch.int32, (math.ceil(out * bits / 32), scales[1])))
        plan.append((f"{module}.weight_shape", torch.int64, (2,)))
        return plan

    def encode(self, payload: QuantizedTensor) -> list[torch.Tensor]:
        scales = payload.scales
        scales = scales.reshape(-1)[:1] if self.spec.granularity == "tensor" else scales.reshape(self._scale_shape(payload.shape))
        if self.format == "int-quantized":
            return [(payload.codes.to(torch.int16) - 128).to(torch.int8), scales.to(torch.float16)]
        if self.format == "float-quantized":
            return [payload.codes.view(torch.float8_e4m3fn), scales.to(torch.float32)]
        bits = self.spec.bits
        tensors = [pack_codes(payload.codes, bits), scales.to(torch.float16)]
        if not self.spec.symmetric:
            zeros = payload.zeros.round().to(torch.uint8)
            tensors.append(pack_codes(zeros.T.contiguous(), bits).T.contiguous())
        return tensors + [torch.tensor(payload.shape, dtype=torch.int64)]

    def _quantization_config(self, activations: ActivationSpec | None, act_order: bool, ignore: list[str]) -> dict:
        spec = self.spec
        weights = {
            "num_bits": spec.bits, "type": "int" if spec.format == "int" else "float", "symmetric": spec.symmetric,
            "strategy": spec.granularity, "group_size": spec.group_size if spec.granularity == "group" else None,
            "block_structure": [spec.group_size] * 2 if spec.granularity == "block" else None,
            "dynamic": False, "actorder": "weight" if act_order else None, "observer": "minmax",
        }
        inputs = None
        if activations is not None:
            inputs = {"num_bits": 8, "type": "int" if activations.format == "int8" else "float", "symmetric": True,
                      "strategy": "token", "dynamic": True, "group_size": None, "block_structure": None, "actorder": None}
        return {
            "quant_method": "compressed-tensors",
            "format": self.format,
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": self.format}},
            "ignore": ignore,
            "kv_cache_scheme": None,
            "sparsity_config": {},
        }
