"""Turning a text file into fixed-length token windows, the unit of calibration and evaluation."""

from __future__ import annotations

from pathlib import Path

import torch

from quant.types import InputError


def read_text(path: Path) -> str:
    if not path.is_file():
        raise InputError(f"{path}: text file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise InputError(f"{path}: text file is empty")
    return text


def token_windows(tokenizer, path: Path, window: int, max_windows: int | None = None) -> torch.Tensor:
    """Consecutive, non-overlapping windows of ``window`` tokens from the start of the file.

    Deterministic by construction (no sampling), so two runs score exactly the same tokens. The
    tail shorter than a window is dropped, as llama.cpp's perplexity tool does.
    """
    ids = tokenizer(read_text(path), add_special_tokens=False)["input_ids"]
    n = len(ids) // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise InputError(f"{path}: {len(ids)} tokens is shorter than one window of {window} tokens")
    return torch.tensor(ids[: n * window], dtype=torch.long).reshape(n, window)
