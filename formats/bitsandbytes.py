"""bitsandbytes 4-bit checkpoints (nf4, fp4): what transformers writes for a model loaded with
``BitsAndBytesConfig(load_in_4bit=True)``, and reads back into bitsandbytes' ``Linear4bit``.

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
from collections import Counter
from pathlib import Path

import torch

from core.schemes import FOUR_BIT_CODES, QuantSpec
from core.tensors import QuantizedTensor
from formats.hf import HFCheckpoint
from formats.quantized_folder import Planned, QuantizedFolderWriter, unquantized_linears

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
