"""Memory needed while quantizing a model with quantbench's own passes (``quantize fit --quantizing``).

The passes stream (``calib.streaming``): RTN holds one tensor at a time; GPTQ and AWQ hold one
decoder layer in float32, that layer's calibration inputs and outputs, the statistics of one group
of Linear modules, and the forward pass's intermediates for one batch of windows. What grows with
the model is the quantized codes of the layers already done (one byte per weight, with their
scales), kept until the export writes them in the checkpoint's order.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from runner.fit.gpus import GIB
from runner.fit.model_shape import ModelShape

# python, torch, transformers and quantbench imported: measured peak RSS of that process on the
# project's machine (354 MiB); on a GPU, add the CUDA context.
PROCESS_BYTES = int(0.35 * GIB)
_BATCH = 8  # windows per layer call (calib.layerwise._BATCH)
_F32 = 4


@dataclass
class QuantizingMemory:
    method: str
    peak_bytes: int
    breakdown: dict[str, int]
    machine_bytes: int = 0  # the memory it is checked against (this machine's RAM, or the GPU's)
    fits: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


def quantizing_memory(shape: ModelShape, method: str, windows: int = 128, window: int = 512) -> QuantizingMemory:
    """Peak memory of ``method`` (rtn, gptq, awq) on ``shape`` with ``windows`` calibration windows
    of ``window`` tokens, in bytes, with the terms that make it up."""
    layer_tensors = [(n, s) for n, s in shape.tensors if ".layers.0." in n]
    largest = max(math.prod(s) for _, s in shape.tensors)
    if method == "rtn":
        # the source tensor in float32, a working copy, the codes and the dequantized weights
        parts = {"process": PROCESS_BYTES, "tensor in flight": 3 * largest * _F32 + largest}
        return QuantizingMemory(method, sum(parts.values()), parts)
    layer_params = sum(math.prod(s) for _, s in layer_tensors)
    decoder_params = layer_params * len(shape.layers)
    hidden = windows * window * shape.arch.hidden * _F32
    inputs = {s[-1] for n, s in layer_tensors if len(s) == 2}
    batch = min(_BATCH, windows)
    intermediates = batch * window * (shape.arch.heads * window + 3 * shape.intermediate) * _F32
    parts = {
        "process": PROCESS_BYTES,
        "layer (float32)": layer_params * _F32,
        "layer inputs and outputs": 2 * hidden,
        "largest Hessian": max(inputs) ** 2 * _F32,
        "forward intermediates (one batch)": intermediates,
        "codes kept until export": decoder_params,
    }
    if method == "awq":
        # the scale search quantizes the concatenated weights of one group (gate+up) at each step
        parts["scale search copies"] = 3 * 2 * shape.intermediate * shape.arch.hidden * _F32
    return QuantizingMemory(method, sum(parts.values()), parts)
