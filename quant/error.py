"""How much one Linear's quantization changed it, for the report's "where it hurts" heat map.

With the Hessian of its calibration inputs (H = Σ x xᵀ, which GPTQ gathers anyway) the measure is
the relative change of the layer's outputs on those inputs, ‖ΔW X‖ / ‖W X‖ = √(tr ΔW H ΔWᵀ / tr W H Wᵀ):
what the next layer actually receives. Without calibration it is the relative change of the
weights, ‖ΔW‖ / ‖W‖.
"""

from __future__ import annotations

import numpy as np
import torch

OUTPUT_ERROR = "relative output error on calibration inputs"
WEIGHT_ERROR = "relative weight error"


def relative_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor | None = None) -> float:
    """In float32 at least, on the weight's device: with a Hessian this costs one more matmul of
    GPTQ's own size per Linear, which must stay small beside GPTQ itself."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    w = weight.to(dtype)
    delta = quantized.to(w.device, dtype) - w
    if hessian is None:
        return float(delta.norm() / w.norm().clamp_min(1e-30))
    h = hessian.to(w.device, dtype)
    return float((((delta @ h) * delta).sum() / ((w @ h) * w).sum().clamp_min(1e-30)).clamp_min(0).sqrt())


def weighted_rounding_error(weight: torch.Tensor, decoded: torch.Tensor, importance: np.ndarray | None) -> float:
    """``sum importance[col] * (w - decoded)**2``, importance 1 for every column where there is none.
    With the importance matrix's mean squared input per column (the Hessian's diagonal per token)
    it is, to first order, the squared error the Linear adds to its outputs per token, summed over
    its rows, so that different Linears and grids compare on one scale: the proxy by which
    ``type: auto`` and ``bits: auto`` rank their candidates."""
    rows = weight.reshape(-1, weight.shape[-1]).float()
    per_column = (rows - decoded.reshape(rows.shape).float()).double().square().sum(0)
    if importance is None:
        return float(per_column.sum())
    return float((per_column * torch.from_numpy(np.asarray(importance, np.float64))).sum())
