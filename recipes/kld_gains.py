"""What a unit of proxy error costs in KL divergence, measured item by item: the scale that puts the
proxy errors of different tensors on one footing for the searches that trade bits between them
(``type: auto``, recipes/type_search.py; ``bits: auto``, recipes/bit_search.py).

A proxy (the importance-weighted squared rounding error) ranks one tensor's choices well and
different tensors' badly (docs/formats.md). So each item (a tensor, or the Linears vLLM runs as one
product) is encoded in one of its choices alone, the rest of the model left as it is, and the KL
divergence it adds to the float model's distributions on a few calibration windows is divided by
that choice's proxy: the item's gain, by which all its proxies are then scaled. It costs one
evaluation pass of the model per item.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from rich.progress import Progress

from core.tensors import TensorPayload
from evalsuite.reference import ReferenceStore
from evalsuite.streamed import streamed_scores
from formats.variant_weights import VariantWeights

GAIN_WINDOWS = 4  # calibration windows each gain is measured on


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
