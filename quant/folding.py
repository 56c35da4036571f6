"""Per-input-channel scales folded into a decoder layer without changing what it computes.

AWQ and SmoothQuant both rescale the input channels of Linear modules: the modules' weight columns
are multiplied by ``s`` and whatever produces their input (a norm's weight, or a Linear's output
rows) is divided by ``s``. The product ``(x / s) · (W · s)ᵀ`` is ``x · Wᵀ`` exactly, so the float
model is unchanged; what changes is how the weights' and the activations' ranges look to a
quantizer. Which module feeds which is the one architectural fact these passes need, and it is
read off the architecture description: Gemma's MLP is fed by its pre-feedforward norm and scales
by (1 + weight); Phi-3's fused projections feed through their last rows (v in qkv, up in gate_up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.architecture import Architecture
from core.errors import InputError


@dataclass(frozen=True)
class Fold:
    """A module whose output is the ``targets``' input: a norm (scaling by ``offset + weight``),
    or a Linear whose last ``rows`` output rows are that input (None: all of them)."""

    feeder: str
    targets: list[str]
    rows: int | None = None
    offset: float = 0.0


def layer_mappings(modules: dict[str, torch.nn.Module], arch: Architecture, method: str) -> list[Fold]:
    """The folds of one decoder layer (names relative to it), in call order. Output to input is
    skipped under grouped-query attention, where v's rows do not line up with o's columns.
    ``method`` names the pass in the error for a block of another shape."""
    if arch.fused_projections:
        qkv, gate_up, v = ["self_attn.qkv_proj"], ["mlp.gate_up_proj"], "self_attn.qkv_proj"
    else:
        qkv, gate_up, v = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"], "self_attn.v_proj"
    mlp_norm = "pre_feedforward_layernorm" if arch.post_norms else "post_attention_layernorm"
    needed = ["input_layernorm", *qkv, "self_attn.o_proj", mlp_norm, *gate_up, "mlp.down_proj"]
    missing = [n for n in needed if n not in modules]
    if missing:
        raise InputError(f"{method}: this {arch.model_type} decoder layer has no '{missing[0]}'")
    o, down = modules["self_attn.o_proj"], modules["mlp.down_proj"]
    folds = [Fold("input_layernorm", qkv, offset=arch.norm_offset)]
    if arch.kv_heads[0] == arch.heads and arch.value_dim * arch.heads == o.in_features:
        folds.append(Fold(v, ["self_attn.o_proj"], rows=o.in_features if arch.fused_projections else None))
    folds.append(Fold(mlp_norm, gate_up, offset=arch.norm_offset))
    folds.append(Fold(gate_up[-1], ["mlp.down_proj"], rows=down.in_features if arch.fused_projections else None))
    return folds


def fold_scales(modules: dict[str, torch.nn.Module], fold: Fold, scales: torch.Tensor) -> None:
    """Multiply the targets' input columns by ``scales`` and divide what feeds them (a norm's
    ``offset + weight``, or a Linear's output rows and bias) by the same: the float model is unchanged."""
    feeder = modules[fold.feeder]
    with torch.no_grad():
        if fold.offset:
            feeder.weight.copy_((feeder.weight + fold.offset) / scales.to(feeder.weight.dtype) - fold.offset)
        else:
            rows = slice(-fold.rows, None) if fold.rows else slice(None)
            shape = (-1, *([1] * (feeder.weight.dim() - 1)))
            feeder.weight[rows].div_(scales.view(shape).to(feeder.weight.dtype))
            if getattr(feeder, "bias", None) is not None:
                feeder.bias[rows].div_(scales.to(feeder.bias.dtype))
        for t in fold.targets:
            modules[t].weight.mul_(scales.to(modules[t].weight.dtype))
