"""How much one Linear's quantization changed it, for the report's "where it hurts" heat map.

With the Hessian of its calibration inputs (H = Σ x xᵀ, which GPTQ gathers anyway) the measure is
the relative change of the layer's outputs on those inputs, ‖ΔW X‖ / ‖W X‖ = √(tr ΔW H ΔWᵀ / tr W H Wᵀ):
what the next layer actually receives. Without calibration it is the relative change of the
weights, ‖ΔW‖ / ‖W‖.
"""

from __future__ import annotations

import torch

OUTPUT_ERROR = "relative output error on calibration inputs"
WEIGHT_ERROR = "relative weight error"


def relative_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor | None = None) -> float:
    w = weight.to(torch.float64)
    delta = quantized.to(torch.float64) - w
    if hessian is None:
        return float(delta.norm() / w.norm().clamp_min(1e-30))
    h = hessian.to(torch.float64)
    return float((((delta @ h) * delta).sum() / ((w @ h) * w).sum().clamp_min(1e-30)).clamp_min(0).sqrt())
