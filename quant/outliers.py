"""Outlier input channels: measuring them, and keeping their weight columns in 16 bits (LLM.int8).

A few input channels of a Linear can carry activations far larger than the rest (Dettmers et al.,
2022). Their weight columns' rounding errors are multiplied by those activations, so they dominate
the output error of a weight-only quantized layer. LLM.int8 finds them by magnitude (6.0) and
computes them in fp16; here they are found once, from the largest |x| each input channel reaches on
the calibration text, and their weight columns are stored in fp16 beside the quantized rest.

The per-channel maxima are also what SmoothQuant balances against the weights, and what a report
shows to explain why a layer suffers under activation quantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterator

import torch

from calib.layerwise import input_statistics, linear_groups
from calib.streaming import LayerStep, skeleton, to_cpu, walk_layers
from core.errors import InputError
from core.schemes import QuantSpec
from core.tensors import LayerResult, MixedPrecisionTensor
from formats.hf import HFCheckpoint
from quant.rtn import quantize_rtn


@dataclass(frozen=True)
class OutlierRule:
    """An input channel is an outlier when its largest calibration |x| exceeds ``threshold``
    (LLM.int8's 6.0) and ``relative`` times the median over the Linear's input channels.

    6.0 alone suits models whose typical activations are near 1. Where every channel of an input
    is large (the down_proj inputs of the shared ref model: median maxima 7 to 13), it would keep
    nearly all columns in fp16 (3952 columns on ref, 6.1 bits per weight at int4); the relative
    factor keeps only channels that stand out from their neighbours (18 columns on ref).
    """

    threshold: float = 6.0
    relative: float = 3.0

    def channels(self, abs_max: torch.Tensor) -> torch.Tensor:
        """The outlier input channels (int32, ascending) of a Linear with these per-channel maxima."""
        limit = max(self.threshold, self.relative * abs_max.median().item())
        return torch.nonzero(abs_max > limit).flatten().to(torch.int32)


def layer_input_abs_max(step: LayerStep) -> dict[str, torch.Tensor]:
    """Largest |x| per input channel of every Linear in one decoder layer of a walk, over all
    calibration tokens, by name relative to the layer (Linears sharing an input share the tensor)."""
    base, layer, inputs = step
    groups = linear_groups(layer, inputs)
    stats = input_statistics(layer, inputs, [g[0] for g in groups], hessians=False)
    result = {}
    for group in groups:
        abs_max = stats[group[0]].abs_max
        if not torch.isfinite(abs_max).all():
            raise InputError(f"{base}{group[0]}: its calibration inputs contain NaN or Inf")
        result.update(dict.fromkeys(group, abs_max))
    return result


def input_abs_max(ckpt: HFCheckpoint, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """``layer_input_abs_max`` of every decoder layer of the float model, streamed from the
    checkpoint, by full module name (``model.layers.0.mlp.down_proj``), on the CPU."""
    result: dict[str, torch.Tensor] = {}
    for step in walk_layers(ckpt, skeleton(ckpt), windows):
        result.update({step.prefix + n: a.cpu() for n, a in layer_input_abs_max(step).items()})
    return result


def channel_statistics(abs_max: dict[str, torch.Tensor], rule: OutlierRule = OutlierRule()) -> dict[str, dict]:
    """Per Linear: how many outlier input channels ``rule`` finds, the largest |x|, and the
    max/median ratio of the per-channel maxima (1 for flat inputs; large where a few channels
    dominate). Plain numbers, ready for a JSON report."""
    report = {}
    for name, a in abs_max.items():
        median = a.median().item()
        report[name] = {
            "outlier_channels": int(rule.channels(a).numel()),
            "max_abs": round(a.max().item(), 4),
            "max_over_median": round(a.max().item() / median, 3) if median > 0 else float("inf"),
        }
    return report


def mixed_precision_rtn(weight: torch.Tensor, spec: QuantSpec, columns: torch.Tensor, name: str = "tensor") -> MixedPrecisionTensor:
    """RTN-quantize ``weight [out, in]`` except the given input columns, which are kept in fp16;
    those columns are zeroed in the quantized base so they do not widen any group's range."""
    w = weight.to(torch.float32).clone()
    index = columns.long()
    dense = w[:, index].to(torch.float16)
    if not torch.isfinite(dense).all():
        raise InputError(f"{name}: an outlier column holds NaN or Inf or overflows fp16")
    w[:, index] = 0.0
    return MixedPrecisionTensor(quantize_rtn(w, spec, name), columns.to(torch.int32), dense)


def mixed_precision_model(
    ckpt: HFCheckpoint,
    windows: torch.Tensor,
    spec: QuantSpec,
    rule: OutlierRule = OutlierRule(),
    modules: Collection[str] | None = None,
) -> Iterator[LayerResult]:
    """RTN on the decoder-layer Linear weights (those in ``modules``, full names; all by default),
    keeping each one's outlier input columns (found on the calibration windows of the float model)
    in fp16; one ``LayerResult`` per decoder layer, as the layers stream from the checkpoint. The
    statistics cover every Linear."""
    for step in walk_layers(ckpt, skeleton(ckpt), windows):
        abs_max = layer_input_abs_max(step)
        layer_modules = dict(step.layer.named_modules())
        tensors = {
            f"{step.prefix}{n}.weight": to_cpu(mixed_precision_rtn(layer_modules[n].weight.data, spec, rule.channels(a), f"{step.prefix}{n}.weight"))
            for n, a in abs_max.items() if modules is None or step.prefix + n in modules
        }
        yield LayerResult(tensors, channel_statistics({step.prefix + n: a for n, a in abs_max.items()}, rule), {})
