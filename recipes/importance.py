"""Importance matrices for a checkpoint: computed on calibration text, or read from llama.cpp files,
always keyed by the checkpoint's own tensor names."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from rich.progress import Progress

from calib.imatrix import streamed_importance_matrix
from calib.text import token_windows
from core.errors import InputError
from formats.gguf import gguf_name
from formats.gguf_file import is_gguf_file
from formats.hf import HFCheckpoint, load_tokenizer
from formats.imatrix import read_imatrix
from recipes.methods import Imatrix


def model_imatrix(ckpt: HFCheckpoint, windows: torch.Tensor, on_layer: Callable[[], None] | None = None) -> Imatrix:
    """The importance matrix keyed by checkpoint tensor names, its layers streamed from ``ckpt``.

    The output head is left out, as ``llama-imatrix`` does by default, so a file quantized with our
    matrix and one quantized with llama.cpp's treat the head alike.
    """
    return streamed_importance_matrix(ckpt, windows, on_layer)


def compute_imatrix(ckpt: HFCheckpoint, text: Path, progress: Progress, max_windows: int = 128) -> tuple[Imatrix, int]:
    """An importance matrix from up to ``max_windows`` 512-token windows of a text, and its token count."""
    windows = token_windows(load_tokenizer(ckpt), text, 512, max_windows)
    task = progress.add_task("importance matrix", total=ckpt.arch.layers)
    means = model_imatrix(ckpt, windows, lambda: progress.advance(task))
    progress.remove_task(task)
    return means, windows.numel()


def is_imatrix_file(path: Path) -> bool:
    """Whether ``--imatrix PATH`` names llama.cpp's importance matrix (GGUF or legacy .dat) rather
    than a calibration text to compute one from."""
    return is_gguf_file(path) or path.suffix == ".dat"


def load_or_compute_imatrix(ckpt: HFCheckpoint, path: Path, progress: Progress) -> Imatrix:
    """An imatrix file (GGUF or legacy .dat, by GGUF tensor names) or one computed from a text."""
    if not path.is_file():
        raise InputError(f"{path}: --imatrix file not found")
    if is_imatrix_file(path):
        by_gguf = read_imatrix(path)
        by_hf = {gguf_name(n, ckpt.arch): n for n in ckpt.names if gguf_name(n, ckpt.arch)}
        unknown = sorted(set(by_gguf) - set(by_hf))
        if unknown:
            raise InputError(f"{path}: imatrix entry '{unknown[0]}' matches no tensor of {ckpt.path}")
        for name, values in by_gguf.items():
            if values.shape[0] != ckpt.shape(by_hf[name])[-1]:
                raise InputError(f"{path}: imatrix entry '{name}' has {values.shape[0]} values, "
                                 f"the tensor has {ckpt.shape(by_hf[name])[-1]} columns")
        return {by_hf[n]: v for n, v in by_gguf.items()}
    return compute_imatrix(ckpt, path, progress)[0]
