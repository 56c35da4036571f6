"""A variant against the original on the same windows and the same examples: flips and paired
bootstrap intervals.

Pairing is what makes small differences visible: both models see the same texts, so resampling
windows (or examples) together cancels how hard each text is, and what is left is the variant's
own change. An interval that spans zero means the evaluation cannot tell the variant from the
original; flips show answers that changed even when the accuracy did not (Dutta et al. 2024).
"""

from __future__ import annotations

import numpy as np

from evalsuite.metrics import Scores

RESAMPLES = 2000
LEVEL = 0.95


def _draws(n: int, seed: int) -> np.ndarray:
    """``RESAMPLES`` resamples of ``n`` indices with replacement, the same for every variant."""
    return np.random.default_rng(seed).integers(0, n, size=(RESAMPLES, n))


def _interval(samples: np.ndarray) -> list[float]:
    tail = (1 - LEVEL) / 2 * 100
    lo, hi = np.percentile(samples, [tail, 100 - tail])
    return [float(lo), float(hi)]


def score_intervals(original: Scores, variant: Scores, seed: int = 0) -> dict[str, list[float]]:
    """95% intervals, over evaluation windows, of the variant's perplexity minus the original's,
    its KLD and its top-1 agreement."""
    o, v = original.per_window, variant.per_window
    if not o or not v or len(o["tokens"]) != len(v["tokens"]):
        return {}
    idx = _draws(len(o["tokens"]), seed)
    tokens = np.asarray(v["tokens"])[idx].sum(1)
    ppl = lambda nll: np.exp(np.asarray(nll)[idx].sum(1) / tokens)  # noqa: E731
    return {
        "ppl_delta": _interval(ppl(v["nll"]) - ppl(o["nll"])),
        "kld": _interval(np.asarray(v["kld"])[idx].sum(1) / tokens),
        "top1": _interval(np.asarray(v["agree"])[idx].sum(1) / tokens),
    }


def accuracy_interval(correct: list[bool], seed: int = 0) -> list[float]:
    """95% interval of one model's accuracy over resampled examples."""
    idx = _draws(len(correct), seed)
    return _interval(np.asarray(correct, dtype=np.float64)[idx].mean(1))


def task_comparison(original: list[bool], variant: list[bool], seed: int = 0) -> dict:
    """The variant's accuracy change on one task with its paired 95% interval, and the examples
    (by index) that flipped either way."""
    o = np.asarray(original, dtype=np.float64)
    v = np.asarray(variant, dtype=np.float64)
    idx = _draws(len(o), seed)
    return {
        "delta": float(v.mean() - o.mean()),
        "delta_interval": _interval(v[idx].mean(1) - o[idx].mean(1)),
        "right_to_wrong": [int(i) for i in np.flatnonzero((o == 1) & (v == 0))],
        "wrong_to_right": [int(i) for i in np.flatnonzero((o == 0) & (v == 1))],
    }


_ROUNDING = 1e-6  # a difference this small is float rounding (an F16 copy of bf16 weights), not a change


def spans_zero(interval: list[float]) -> bool:
    return bool(interval) and interval[0] <= _ROUNDING and interval[1] >= -_ROUNDING
