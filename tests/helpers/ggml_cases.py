"""What the ggml encoders' byte-exactness tests share: seeded inputs, importance matrices (random
and unusual ones), and the block-by-block comparison with llama.cpp's bytes that names the first
block to differ."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def seeded_case(cases: dict[str, Callable[[np.random.Generator], np.ndarray]], case: str) -> np.ndarray:
    """float32 rows of one named case, drawn with a seed of its own (its place among the names)."""
    seed = sorted(cases).index(case)
    return np.ascontiguousarray(cases[case](np.random.default_rng(seed)), dtype=np.float32)


def random_imatrix(n: int, seed: int = 100) -> np.ndarray:
    """Random importance weights (mean squared activations) with about a fifth of them zero."""
    rng = np.random.default_rng(seed)
    qw = rng.exponential(1.0, n)
    qw[rng.random(n) < 0.2] = 0
    return qw.astype(np.float32)


UNUSUAL_IMATRIX = ("mostly_zero", "all_zero", "wide_range", "uniform")


def unusual_imatrix(kind: str, n: int) -> np.ndarray:
    """Importance weights that leave a search few points to fit, none, or a huge dynamic range."""
    rng = np.random.default_rng(7)
    return {  # all drawn, in this order, whichever is asked for
        "mostly_zero": np.where(rng.random(n) < 0.95, 0.0, rng.random(n)),
        "all_zero": np.zeros(n),
        "wide_range": 10.0 ** rng.uniform(-10, 10, n),
        "uniform": np.ones(n),
    }[kind].astype(np.float32)


def assert_same_blocks(ours: np.ndarray, ggml: np.ndarray, block_bytes: int, blocks: str = "blocks") -> None:
    """Our bytes equal ggml's; otherwise say how many ``blocks`` differ and where the first is."""
    assert ours.dtype == np.uint8 and ours.shape == ggml.shape
    bad = np.flatnonzero((ours.reshape(-1, block_bytes) != ggml.reshape(-1, block_bytes)).any(axis=1))
    assert bad.size == 0, f"{bad.size} of {ours.size // block_bytes} {blocks} differ, first at {bad[0]}"


def weighted_column_errors(encode: Callable[[np.ndarray, np.ndarray], bytes], qtype: str,
                           x: np.ndarray) -> tuple[float, float]:
    """Mean squared error, decoded by gguf-py (an independent reader of the layout), of every fourth
    column of ``x``: with those columns weighted 100x in the importance matrix, and with flat weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    flat = np.ones(x.shape[1], dtype=np.float32)
    heavy = flat.copy()
    heavy[::4] = 100.0
    t = GGMLQuantizationType[qtype]
    err = [((dequantize(encode(x, qw), t) - x) ** 2)[:, ::4].mean() for qw in (heavy, flat)]
    return float(err[0]), float(err[1])
