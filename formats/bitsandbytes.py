"""bitsandbytes 4-bit checkpoints (nf4, fp4): what transformers writes for a model loaded with
``BitsAndBytesConfig(load_in_4bit=True)``, and reads back into bitsandbytes' ``Linear4bit``. Read
back: those, with or without double quantization, and LLM.int8 folders (``load_in_8bit``).

Per quantized Linear ``X`` with ``n`` weights in blocks of ``B`` consecutive values of the
flattened ``[out, in]`` weight (bitsandbytes' blocksize; our group size):

- ``X.weight`` uint8 ``[n/2, 1]``: two 4-bit codes per byte, the first in the high nibble.
- ``X.weight.absmax`` float32 ``[n/B]``: each block's scale (its largest magnitude).
- ``X.weight.quant_map`` float32 ``[16]``: the code table (nf4's or fp4's).
- ``X.weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``) uint8: a JSON record of the quant
  type, blocksize, the weight's dtype and shape.

No nested ("double") quantization of absmax: a float32 scale per block, as our spec keeps it. The
other tensors keep the source's dtype: bitsandbytes' own scales are float32, so nothing here needs
float16.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import torch

from core.errors import InputError
from core.schemes import FOUR_BIT_CODES, ActivationSpec, QuantSpec
from core.tensors import QuantizedTensor, TensorPayload
from formats.checkpoint_format import CheckpointFormat, ExportContents, weight_only
from formats.hf import HFCheckpoint
from formats.quantized_folder import Planned, QuantizedFolderWriter, unquantized_linears
from formats.quantized_layout import Expected, QuantizedLayout

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def check_spec(spec: QuantSpec) -> None:
    """ValueError saying why ``spec`` has no bitsandbytes 4-bit form."""
    if spec.format not in FOUR_BIT_CODES:
        raise ValueError(f"{spec.label} weights (bitsandbytes 4-bit holds nf4 and fp4)")
    if spec.granularity != "group" or spec.group_size not in BLOCKSIZES:
        raise ValueError(f"{spec.label} (bitsandbytes takes groups of {', '.join(map(str, BLOCKSIZES))})")


class BitsAndBytesWriter(QuantizedFolderWriter):
    """One variant as a bitsandbytes 4-bit folder."""

    export = "bitsandbytes"

    def __init__(self, dest: Path, source: HFCheckpoint, names: list[str], quantized: set[str], spec: QuantSpec):
        self._accept(spec, check_spec)
        self.float_dtype = Counter(source.dtype(n) for n in names if source.dtype(n).is_floating_point).most_common(1)[0][0]
        skipped = ["lm_head"] + unquantized_linears(source, quantized)
        quantization = {
            "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": spec.format, "bnb_4bit_use_double_quant": False,
            "bnb_4bit_compute_dtype": str(self.float_dtype).removeprefix("torch."), "bnb_4bit_quant_storage": "uint8",
            "llm_int8_skip_modules": skipped,
        }
        self._open(dest, source, names, quantized, quantization)

    def _state(self, shape: tuple[int, int]) -> torch.Tensor:
        record = {"quant_type": self.spec.format, "blocksize": self.spec.group_size,
                  "dtype": str(self.float_dtype).removeprefix("torch."), "shape": list(shape)}
        return torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)

    def stored(self, module: str, shape: tuple[int, int]) -> Planned:
        n = shape[0] * shape[1]
        return [
            (f"{module}.weight", torch.uint8, (n // 2, 1)),
            (f"{module}.weight.absmax", torch.float32, (n // self.spec.group_size,)),
            (f"{module}.weight.quant_map", torch.float32, (16,)),
            (f"{module}.weight.quant_state.bitsandbytes__{self.spec.format}", torch.uint8, (len(self._state(shape)),)),
        ]

    def encode(self, payload: QuantizedTensor) -> list[torch.Tensor]:
        codes = payload.codes.reshape(-1)
        return [
            ((codes[0::2] << 4) | codes[1::2]).reshape(-1, 1),
            payload.scales.reshape(-1).to(torch.float32),
            FOUR_BIT_CODES[self.spec.format].to(torch.float32),
            self._state(payload.shape),
        ]


def _state(raw: HFCheckpoint, name: str) -> dict:
    """The JSON record bitsandbytes keeps beside a 4-bit weight (quant type, blocksize, shape,
    and the nested blocksize and offset under double quantization)."""
    stored = [n for n in raw.names if n.startswith(f"{name}.quant_state.bitsandbytes__")]
    if len(stored) != 1:
        raise InputError(f"{raw.path}: no tensor '{name}.quant_state.bitsandbytes__nf4' (or __fp4) for the 4-bit weight")
    try:
        state = json.loads(bytes(raw.tensor(stored[0]).to(torch.uint8).tolist()))
        int(state["blocksize"])
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{raw.path}: tensor '{stored[0]}' is not bitsandbytes' record of a 4-bit weight ({e})") from None
    return state


class FourBitLayout(QuantizedLayout):
    """``load_in_4bit``: two codes a byte over the flattened weight, a scale per block."""

    name = "bnb-4bit"
    marker = ".weight.absmax"

    def expected(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> Expected:
        (out, n_in), state = shape, _state(raw, name)
        n = out * n_in
        if list(state.get("shape", [])) != [out, n_in] or n % 2 or n % state["blocksize"]:
            raise InputError(f"{raw.path}: '{name}' is recorded as {state.get('shape')} in blocks of "
                             f"{state['blocksize']}; the config gives {list(shape)}")
        blocks = n // state["blocksize"]
        record = next(n for n in raw.names if n.startswith(f"{name}.quant_state.bitsandbytes__"))
        tensors = {name: (torch.uint8, (n // 2, 1)), f"{name}.quant_map": (torch.float32, (16,)),
                   record: (torch.uint8, raw.shape(record))}
        if "nested_blocksize" in state:
            tensors.update({f"{name}.absmax": (torch.uint8, (blocks,)), f"{name}.nested_quant_map": (torch.float32, (256,)),
                            f"{name}.nested_absmax": (torch.float32, (math.ceil(blocks / state["nested_blocksize"]),))})
        else:
            tensors[f"{name}.absmax"] = (torch.float32, (blocks,))
        return tensors

    def shape(self, raw: HFCheckpoint, name: str) -> tuple[int, ...]:
        return tuple(_state(raw, name)["shape"])

    def payload(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> TensorPayload:
        """Under double quantization the scales are themselves 8-bit quantized in blocks of their
        own (bitsandbytes' ``dequantize_blockwise`` plus the stored offset); a code table or block
        our grids do not hold reads back as float32."""
        (out, n_in), read, state = shape, raw.tensor, _state(raw, name)
        packed = read(name).reshape(-1)
        codes = torch.stack([packed >> 4, packed & 15], 1).reshape(-1)
        absmax = read(f"{name}.absmax")
        if "nested_blocksize" in state:
            nested = read(f"{name}.nested_absmax").float().repeat_interleave(state["nested_blocksize"])[: absmax.numel()]
            absmax = read(f"{name}.nested_quant_map").float()[absmax.long()] * nested + float(state["nested_offset"])
        table, block = read(f"{name}.quant_map").float(), state["blocksize"]
        if n_in % block == 0 and torch.equal(table, FOUR_BIT_CODES[self.spec.format]):
            return QuantizedTensor(self.spec, codes.reshape(out, n_in), absmax.float().reshape(out, n_in // block),
                                   torch.zeros(out, n_in // block))
        return (table[codes.long()].reshape(-1, block) * absmax.float()[:, None]).reshape(out, n_in)


class Int8Layout(QuantizedLayout):
    """LLM.int8 (``load_in_8bit``): int8 rows, each times its absmax / 127."""

    name = "bnb-int8"
    marker = ".SCB"

    def expected(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> Expected:
        module = name.removesuffix(".weight")
        tensors = {name: (torch.int8, shape), f"{module}.SCB": (torch.float32, (shape[0],))}
        if f"{module}.weight_format" in raw.names:  # what older transformers saved beside (the row layout)
            tensors[f"{module}.weight_format"] = (raw.dtype(f"{module}.weight_format"), raw.shape(f"{module}.weight_format"))
        return tensors

    def payload(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> QuantizedTensor:
        codes = (raw.tensor(name).to(torch.int16) + 128).to(torch.uint8)
        scales = (raw.tensor(f"{name.removesuffix('.weight')}.SCB").float() / 127).reshape(shape[0], 1)
        return QuantizedTensor(self.spec, codes, scales, torch.full_like(scales, 128.0))


class BitsAndBytesFormat(CheckpointFormat):
    name = "bitsandbytes"
    codes = True
    holds_group_index = BitsAndBytesWriter.holds_group_index
    readable = "bitsandbytes (4-bit, int8)"

    def check(self, spec: QuantSpec, activations: ActivationSpec | None) -> None:
        weight_only(check_spec, spec, activations)

    def writer(self, dest: Path, contents: ExportContents) -> BitsAndBytesWriter:
        return BitsAndBytesWriter(dest, contents.source, contents.names, contents.quantized, contents.spec)

    def read(self, config: dict, raw: HFCheckpoint) -> QuantizedLayout:
        """The blocksize, which the config does not say, comes from the first weight's record."""
        if config.get("load_in_8bit"):
            return Int8Layout(QuantSpec(8, True, "channel"))
        if not config.get("load_in_4bit"):
            raise ValueError("neither load_in_4bit nor load_in_8bit")
        fmt = config.get("bnb_4bit_quant_type", "fp4")
        if fmt not in FOUR_BIT_CODES:
            raise ValueError(f"bnb_4bit_quant_type {fmt!r}")
        first = next((n.removesuffix(".absmax") for n in raw.names if n.endswith(".weight.absmax")), None)
        block = _state(raw, first)["blocksize"] if first else 64
        return FourBitLayout(QuantSpec(4, True, "group", int(block), format=fmt))


FORMAT = BitsAndBytesFormat()
