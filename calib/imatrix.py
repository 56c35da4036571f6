"""Importance matrices: how much each input column of each Linear weight matters on real text.

For every Linear layer, the mean over calibration tokens of the squared input activation of each
input column (what llama.cpp's ``llama-imatrix`` collects). Quantizers weight their rounding error
by it, spending precision on the columns that carry signal.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch


def importance_matrix(
    model: torch.nn.Module, windows: torch.Tensor, on_window: Callable[[], None] | None = None
) -> dict[str, np.ndarray]:
    """Mean squared input activation per column, keyed by the Linear weight's name (``...q_proj.weight``).

    Sums accumulate in float64 so that thousands of windows add up without drift.
    """
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def collector(name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            sums[name] = sums.get(name, 0) + (x * x).sum(dim=0)
            counts[name] = counts.get(name, 0) + x.shape[0]

        return hook

    handles = [
        module.register_forward_pre_hook(collector(f"{name}.weight"))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    try:
        with torch.inference_mode():
            for i in range(windows.shape[0]):
                model(input_ids=windows[i : i + 1])
                if on_window:
                    on_window()
    finally:
        for handle in handles:
            handle.remove()
    return {name: (total / counts[name]).to(torch.float32).numpy() for name, total in sums.items()}
