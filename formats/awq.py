"""AWQ checkpoints: AutoAWQ's GEMM layout, which transformers, vLLM and GPTQModel load.

Per quantized Linear ``X`` with ``I`` inputs, ``O`` outputs and ``G`` groups of consecutive inputs:

- ``X.qweight`` int32 ``[I, O/8]``: each input row's 4-bit codes packed along the output, eight
  to a word in AutoAWQ's interleaved order: nibble i of word k holds output ``8k + [0, 2, 4, 6,
  1, 3, 5, 7][i]`` (the order its GEMM kernel unpacks fastest).
- ``X.qzeros`` int32 ``[G, O/8]``: the zero-points, packed the same way.
- ``X.scales`` float16 ``[G, O]``.

4-bit by group only, and no ``g_idx``: AWQ's kernels know neither channel scales nor act-order.
Zero-points are always stored (``zero_point: true``); a symmetric spec stores its fixed mid-level.
AWQ's folded scales are already in the float tensors (the norms and Linears before each group of
inputs), which are written as they are, in float16.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.errors import InputError
from core.schemes import ActivationSpec, QuantSpec
from core.tensors import QuantizedTensor
from formats.checkpoint_format import CheckpointFormat, ExportContents, weight_only
from formats.hf import HFCheckpoint
from formats.packing import pack_codes, unpack_codes
from formats.quantized_folder import Planned, QuantizedFolderWriter, unquantized_linears
from formats.quantized_layout import Expected, QuantizedLayout

_ORDER = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])


def check_spec(spec: QuantSpec) -> None:
    """ValueError saying why ``spec`` has no AWQ layout."""
    if spec.format != "int" or spec.bits != 4:
        raise ValueError(f"{spec.label} weights (AWQ holds int4)")
    if spec.granularity != "group":
        raise ValueError(f"granularity '{spec.granularity}' (AWQ takes groups)")


def _interleaved(t: torch.Tensor) -> torch.Tensor:
    """Columns of ``[rows, O]`` in AutoAWQ's packing order, eight at a time."""
    rows, out = t.shape
    return t.reshape(rows, out // 8, 8)[:, :, _ORDER].reshape(rows, out)


def deinterleaved(t: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_interleaved``: columns back in output order."""
    rows, out = t.shape
    return t.reshape(rows, out // 8, 8)[:, :, torch.argsort(_ORDER)].reshape(rows, out)


class AWQWriter(QuantizedFolderWriter):
    """One variant as an AWQ (GEMM) folder."""

    export = "awq"
    splits_gate_up = True

    def __init__(self, dest: Path, source: HFCheckpoint, names: list[str], quantized: set[str], spec: QuantSpec):
        self._accept(spec, check_spec)
        unconverted = unquantized_linears(source, quantized)
        quantization = {"quant_method": "awq", "bits": 4, "group_size": spec.group_size, "zero_point": True,
                        "version": "gemm", "modules_to_not_convert": unconverted or None}
        self._open(dest, source, names, quantized, quantization)

    def stored(self, module: str, shape: tuple[int, int]) -> Planned:
        out, n_in = shape
        if out % 8:
            raise InputError(f"awq export: tensor '{module}.weight' has {out} outputs, not a multiple of 8")
        groups = n_in // self.spec.group_size
        return [
            (f"{module}.qweight", torch.int32, (n_in, out // 8)),
            (f"{module}.qzeros", torch.int32, (groups, out // 8)),
            (f"{module}.scales", torch.float16, (groups, out)),
        ]

    def encode(self, payload: QuantizedTensor) -> list[torch.Tensor]:
        zeros = payload.zeros.round().to(torch.uint8)
        return [
            pack_codes(_interleaved(payload.codes.T.contiguous()), 4),
            pack_codes(_interleaved(zeros.T.contiguous()), 4),
            payload.scales.T.to(torch.float16).contiguous(),
        ]


class AWQLayout(QuantizedLayout):
    """An AWQ (GEMM) folder read back: int4 by group, zero-points always stored."""

    name = "awq"
    marker = ".qweight"

    def expected(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> Expected:
        module, (out, n_in) = name.removesuffix(".weight"), shape
        if out % 8:
            raise InputError(f"{raw.path}: '{module}' has {out} outputs; AWQ packs them eight to a word")
        groups = self.groups(n_in)
        return {f"{module}.qweight": (torch.int32, (n_in, out // 8)), f"{module}.qzeros": (torch.int32, (groups, out // 8)),
                f"{module}.scales": (None, (groups, out))}

    def shape(self, raw: HFCheckpoint, name: str) -> tuple[int, ...]:
        module = name.removesuffix(".weight")
        return raw.shape(f"{module}.scales")[1], raw.shape(f"{module}.qweight")[0]

    def payload(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> QuantizedTensor:
        module, read, out = name.removesuffix(".weight"), raw.tensor, shape[0]
        codes = deinterleaved(unpack_codes(read(f"{module}.qweight"), 4, out)).T.contiguous()
        zeros = deinterleaved(unpack_codes(read(f"{module}.qzeros"), 4, out)).T.float().contiguous()
        return QuantizedTensor(self.spec, codes, read(f"{module}.scales").T.float().contiguous(), zeros)


class AWQFormat(CheckpointFormat):
    name = "awq"
    codes = True
    holds_group_index = AWQWriter.holds_group_index
    readable = "awq (gemm)"

    def check(self, spec: QuantSpec, activations: ActivationSpec | None) -> None:
        weight_only(check_spec, spec, activations)

    def writer(self, dest: Path, contents: ExportContents) -> AWQWriter:
        return AWQWriter(dest, contents.source, contents.names, contents.quantized, contents.spec)

    def read(self, config: dict, raw: HFCheckpoint) -> AWQLayout:
        if str(config.get("version", "gemm")).lower() != "gemm" or config.get("bits", 4) != 4:
            raise ValueError(f"version {config.get('version')!r}, {config.get('bits')} bits (the GEMM layout holds int4)")
        # zero-points are always stored; a symmetric spec would only fix them at 8
        return AWQLayout(QuantSpec(4, False, "group", int(config["group_size"])))


FORMAT = AWQFormat()
