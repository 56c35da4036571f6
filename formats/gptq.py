"""GPTQ checkpoints: the AutoGPTQ layout that GPTQModel, transformers (through GPTQModel), vLLM
and TGI load.

Per quantized Linear ``X`` with ``I`` inputs, ``O`` outputs, ``b`` bits and ``G`` groups:

- ``X.qweight`` int32 ``[ceil(I·b/32), O]``: each output column's codes packed along the input,
  a little-endian bit stream (AutoGPTQ's 3-bit layout is that stream too).
- ``X.qzeros`` int32 ``[G, ceil(O·b/32)]``: zero-points packed along the output.
- ``X.scales`` float16 ``[G, O]`` and ``X.g_idx`` int32 ``[I]``, the group of each input column
  (GPTQ's act-order permutation mapped to groups; ``i // group_size`` otherwise).

Symmetric files are checkpoint format ``gptq`` ("v1"), which stores each zero-point minus one: the
layout every loader reads. v1 cannot hold an asymmetric zero-point of 0 (it wraps, and loaders
that add the one back carry into the next field), so asymmetric files are ``gptq_v2``, with the
zero-points as they are, which GPTQModel reads; vLLM's GPTQ kernels take v1 only, and serve
asymmetric weights from a compressed-tensors export instead. Every float tensor is float16, like
the scales the codes were chosen for.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from formats.hf import HFCheckpoint, SafetensorsFolderWriter, export_config, float16_tensor, quantized_export_plan
from formats.packing import pack_codes
from quant.types import InputError, QuantizedTensor, QuantSpec, TensorPayload

BITS = (2, 3, 4, 8)


def check_spec(spec: QuantSpec) -> None:
    """ValueError saying why ``spec`` has no GPTQ layout."""
    if spec.format != "int" or spec.bits not in BITS:
        raise ValueError(f"{spec.label} weights (GPTQ holds int2, int3, int4 and int8)")
    if spec.granularity not in ("group", "channel"):
        raise ValueError(f"granularity '{spec.granularity}' (GPTQ takes group or channel)")


class GPTQWriter:
    """Streams one variant into a GPTQ folder: quantized Linear weights packed, every other tensor
    float16. ``act_order``: the weights carry GPTQ's act-order groups (``desc_act``)."""

    def __init__(self, dest: Path, source: HFCheckpoint, names: list[str], quantized: set[str], spec: QuantSpec,
                 act_order: bool = False, settings: dict | None = None):
        try:
            check_spec(spec)
        except ValueError as e:
            raise InputError(f"gptq export: no layout holds {e}") from None
        self.spec = spec
        self.quantized = quantized
        self.group_size = spec.group_size if spec.granularity == "group" else None
        plan = quantized_export_plan(source, names, quantized, self._packed_plan)
        quantization = {
            "quant_method": "gptq", "bits": spec.bits, "group_size": self.group_size or -1, "desc_act": act_order,
            "sym": spec.symmetric, "lm_head": False, "checkpoint_format": "gptq" if spec.symmetric else "gptq_v2",
            "pack_dtype": "int32", "meta": {"quantizer": ["quantbench"], **(settings or {})},
        }
        config = export_config(source, torch.float16)
        config["quantization_config"] = quantization
        self._folder = SafetensorsFolderWriter(dest, plan, config, source)
        (self._folder.tmp / "quantize_config.json").write_text(json.dumps(quantization, indent=2) + "\n")

    def _packed_plan(self, module: str, shape: tuple[int, int]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        out, n_in = shape
        bits = self.spec.bits
        groups = n_in // self.group_size if self.group_size else 1
        return [
            (f"{module}.qweight", torch.int32, (-(-n_in * bits // 32), out)),
            (f"{module}.qzeros", torch.int32, (groups, -(-out * bits // 32))),
            (f"{module}.scales", torch.float16, (groups, out)),
            (f"{module}.g_idx", torch.int32, (n_in,)),
        ]

    def add(self, name: str, payload: TensorPayload) -> None:
        if name not in self.quantized:
            self._folder.write(name, float16_tensor(name, payload, "gptq"))
            return
        if not isinstance(payload, QuantizedTensor):
            raise InputError(f"gptq export: tensor '{name}' ({type(payload).__name__}) has no GPTQ form")
        module = name.removesuffix(".weight")
        bits = self.spec.bits
        out, n_in = payload.shape
        zeros = payload.zeros.round().to(torch.int16)
        if self.spec.symmetric:
            zeros = (zeros - 1) % 2**bits  # v1 stores zero-points minus one
        index = payload.group_index
        if index is None:
            index = torch.arange(n_in, dtype=torch.int32) // (self.group_size or n_in)
        self._folder.write(f"{module}.qweight", pack_codes(payload.codes, bits).T.contiguous())
        self._folder.write(f"{module}.qzeros", pack_codes(zeros.T.to(torch.uint8).contiguous(), bits))
        self._folder.write(f"{module}.scales", payload.scales.T.to(torch.float16).contiguous())
        self._folder.write(f"{module}.g_idx", index.to(torch.int32))

    def finish(self) -> Path:
        return self._folder.finish()

    def abort(self) -> None:
        self._folder.abort()
