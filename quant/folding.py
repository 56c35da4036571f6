"""Per-input-channel scales folded into a decoder layer without changing what it computes.

AWQ and SmoothQuant both rescale the input channels of Linear modules: the modules' weight columns
are multiplied by ``s`` and whatever produces their input (a norm's weight, or a Linear's output
rows) is divided by ``s``. The product ``(x / s) · (W · s)ᵀ`` is ``x · Wᵀ`` exactly, so the float
model is unchanged; what changes is how the weights' and the activations' ranges look to a
quantizer. Which module feeds which is the one architectural fact these passes need.
"""

from __future__ import annotations

import torch

from quant.types import InputError

_BLOCK = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def layer_mappings(modules: dict[str, torch.nn.Module], method: str) -> list[tuple[str, list[str]]]:
    """(feeding module, Linear modules it feeds) in a Llama/Mistral/Qwen2 block, names relative to
    the layer, in call order. The v -> o pair is skipped under grouped-query attention, where v's
    rows do not line up with o's columns. ``method`` names the pass in the error for other blocks."""
    missing = [n for n in _BLOCK if n not in modules]
    if missing:
        raise InputError(f"{method}: decoder layer has no '{missing[0]}' (supported: Llama, Mistral, Qwen2 blocks)")
    pairs = [("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])]
    if modules["self_attn.v_proj"].out_features == modules["self_attn.o_proj"].in_features:
        pairs.append(("self_attn.v_proj", ["self_attn.o_proj"]))
    pairs += [("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"]), ("mlp.up_proj", ["mlp.down_proj"])]
    return pairs


def fold_scales(feeder: torch.nn.Module, targets: list[torch.nn.Linear], scales: torch.Tensor) -> None:
    """Multiply the targets' input columns by ``scales`` and divide what feeds them (a norm's
    weight, or a Linear's output rows and bias) by the same: the float model is unchanged."""
    with torch.no_grad():
        feeder.weight.div_(scales.view(-1, *([1] * (feeder.weight.dim() - 1))).to(feeder.weight.dtype))
        if getattr(feeder, "bias", None) is not None:
            feeder.bias.div_(scales.to(feeder.bias.dtype))
        for t in targets:
            t.weight.mul_(scales.to(t.weight.dtype))
