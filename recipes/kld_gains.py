"""What a unit of proxy error costs in KL divergence, measured item by item: the scale that puts the
proxy errors of different tensors on one footing for the searches that trade bits between them
(``type: auto``, recipes/type_search.py; ``bits: auto``, recipes/bit_search.py).

A proxy (the importance-weighted squared rounding error) ranks one tensor's choices well and
different tensors' badly (docs/formats.md). So each item (a tensor, or the Linears vLLM runs as one
product) is encoded in one of its choices alone, the rest of the model left as it is, and the KL
divergence it adds to the float model's distributions on a few calibration windows is divided by
that choice's proxy: the item's gain, by which all its proxies are then scaled. It costs one
evaluation pass of the model per item (``sensitivity: kld``).

``sensitivity: fisher`` estimates the same KL divergence instead, to second order, from the Fisher
diagonals of one forward and backward walk over the calibration windows (calib/output_fisher.py):
about three passes of the model whatever its number of items, where measuring takes one per item
(226 for a 7B Llama). docs/formats.md compares the two.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from rich.progress import Progress

from calib.output_fisher import output_fisher
from core.tensors import TensorPayload, dequantized
from evalsuite.reference import ReferenceStore
from evalsuite.streamed import streamed_scores
from formats.variant_weights import VariantWeights

GAIN_WINDOWS = 4  # calibration windows each gain is measured on


def sensitivity_gains(sensitivity: str, ckpt, proxies: list[float | None], alone: Callable[[int], dict[str, TensorPayload]],
                      windows: torch.Tensor, imatrix: Mapping[str, np.ndarray] | None, progress: Progress) -> np.ndarray:
    """Each item's KL divergence per unit of proxy, measured (``kld``) or estimated (``fisher``,
    with the Linears' importance matrix); 1 for every item with ``proxy``, which ranks by the
    proxy alone."""
    if sensitivity == "kld":
        return kld_gains(ckpt, proxies, alone, windows, progress)
    if sensitivity == "fisher":
        return fisher_gains(ckpt, proxies, alone, windows, imatrix, progress)
    return np.ones(len(proxies))


def kld_gains(ckpt, proxies: list[float | None], alone: Callable[[int], dict[str, TensorPayload]], windows: torch.Tensor,
              progress: Progress) -> np.ndarray:
    """Each item's added KL divergence per unit of proxy: ``alone(i)`` is item ``i``'s tensors in the
    choice whose proxy error is ``proxies[i]`` (None: an item without a choice, gain 1)."""
    gains = np.ones(len(proxies))
    windows = windows[:GAIN_WINDOWS]
    task = progress.add_task("measure KL divergence per tensor", total=len(proxies))
    with tempfile.TemporaryDirectory() as tmp:
        streamed_scores(ckpt, windows, keep=Path(tmp) / "float")
        reference = ReferenceStore(Path(tmp) / "float", windows)
        for i, proxy in enumerate(proxies):
            if proxy is not None:
                encoded = VariantWeights(Path(tmp) / str(i), ckpt)
                for name, payload in alone(i).items():
                    encoded.put(name, payload)
                gains[i] = max(streamed_scores(encoded, windows, reference).kld, 1e-12) / max(proxy, 1e-30)
                shutil.rmtree(encoded.folder)
            progress.advance(task)
    progress.remove_task(task)
    return gains


def fisher_gains(ckpt, proxies: list[float | None], alone: Callable[[int], dict[str, TensorPayload]], windows: torch.Tensor,
                 imatrix: Mapping[str, np.ndarray] | None, progress: Progress) -> np.ndarray:
    """``kld_gains`` with each item's added KL divergence estimated from the Fisher diagonals
    (calib/output_fisher.py) and the Linears' importance matrix (none: 1 for every input)."""
    gains = np.ones(len(proxies))
    task = progress.add_task("estimate KL divergence per tensor (Fisher)", total=len(proxies) + 1)
    fisher = output_fisher(ckpt, windows[:GAIN_WINDOWS])
    progress.advance(task)
    for i, proxy in enumerate(proxies):
        if proxy is not None:
            estimate = 0.0
            for name, payload in alone(i).items():
                error = ckpt.tensor(name).float() - dequantized(payload).float().reshape(ckpt.shape(name))
                estimate += fisher.kld(name, error, imatrix.get(name) if imatrix else None)
            gains[i] = max(estimate, 1e-12) / max(proxy, 1e-30)
        progress.advance(task)
    progress.remove_task(task)
    return gains
