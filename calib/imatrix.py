"""Importance matrices: how much each input column of each Linear weight matters on real text.

For every Linear layer, the mean over calibration tokens of the squared input activation of each
input column (what llama.cpp's ``llama-imatrix`` collects). Quantizers weight their rounding error
by it, spending precision on the columns that carry signal.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from formats.hf import HFCheckpoint


def streamed_importance_matrix(ckpt: HFCheckpoint, windows: torch.Tensor, on_layer: Callable[[], None] | None = None) -> dict[str, np.ndarray]:
    """Mean squared input activation per column of every decoder Linear, keyed by its weight's name
    (``...q_proj.weight``), as the layers stream from ``ckpt`` (calib/streaming.py), one layer in
    memory: a model larger than RAM gets one too. The output head is not walked (``llama-imatrix``
    leaves it out by default). Sums accumulate in float64 so that thousands of windows add up
    without drift."""
    from calib.layerwise import decoder_layers, run_layer
    from calib.streaming import skeleton, walk_layers

    squares = _Squares()
    model = skeleton(ckpt)
    last = len(decoder_layers(model)) - 1
    handles: list = []
    for index, step in enumerate(walk_layers(ckpt, model, windows)):
        for handle in handles:  # the previous layer has run: its inputs are counted
            handle.remove()
        handles = squares.watch(step.layer, step.prefix)  # counted as the walk runs the layer for the next one
        if index == last:  # which the walk does not do for its last
            run_layer(step.layer, step.inputs)
        if on_layer:
            on_layer()
    for handle in handles:
        handle.remove()
    return squares.means()


class _Squares:
    """Per-column sums of squared inputs of Linear modules, in float64, and the tokens counted."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def watch(self, module: torch.nn.Module, prefix: str) -> list:
        return [m.register_forward_pre_hook(self._collector(f"{prefix}{name}.weight"))
                for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)]

    def _collector(self, name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            self.sums[name] = self.sums.get(name, 0) + (x * x).sum(dim=0)
            self.counts[name] = self.counts.get(name, 0) + x.shape[0]

        return hook

    def means(self) -> dict[str, np.ndarray]:
        return {name: (total / self.counts[name]).to(torch.float32).cpu().numpy() for name, total in self.sums.items()}
