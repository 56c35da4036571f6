"""Rotary-embedding facts that several layers must agree on: the channel order llama.cpp keeps a
head's rotary pairs in, and the frequency bands of Llama 3's rope scaling."""

from __future__ import annotations

import numpy as np
import torch

from core.architecture import Rope


def pairs_side_by_side(head_dim: int) -> torch.Tensor:
    """Channel order [0, d/2, 1, d/2 + 1, ...]: each rotary pair of a rotate-half head together, as
    llama.cpp's "normal" rope keeps them (its converter permutes the q/k rows of llama models so)."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], 1).reshape(-1)


def to_pairs_side_by_side(rows: np.ndarray, heads: int) -> np.ndarray:
    """A q/k weight's rows (or encoded rows: rows are independent in every ggml type) reordered
    within each of ``heads`` heads into ``pairs_side_by_side`` order."""
    head_dim = rows.shape[0] // heads
    return rows.reshape(heads, head_dim, *rows.shape[1:])[:, pairs_side_by_side(head_dim).numpy()].reshape(rows.shape)


def from_pairs_side_by_side(rows: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of ``to_pairs_side_by_side``: rotate-half order, as transformers keeps it."""
    head_dim = rows.shape[0] // heads
    back = torch.argsort(pairs_side_by_side(head_dim)).numpy()
    return rows.reshape(heads, head_dim, *rows.shape[1:])[:, back].reshape(rows.shape)


def llama3_bands(rope: Rope, wavelen):
    """Llama 3's rope scaling splits the rotary frequencies by wavelength (numpy or torch arrays):
    short ones keep their frequency, long ones are divided by ``factor``, and those between blend
    the two by ``smooth``. Returns (short, long, smooth); transformers (the engine) and llama.cpp's
    converter (``rope_freqs.weight``) each finish the sum in their own arithmetic."""
    short = wavelen < rope.original_context / rope.high_freq_factor
    long = wavelen > rope.original_context / rope.low_freq_factor
    smooth = (rope.original_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    return short, long, smooth
