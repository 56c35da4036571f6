"""One choice per item, least summed cost within a byte budget: the multiple-choice knapsack that
``type: auto`` solves to pick each tensor's ggml type (recipes/methods/gguf.py).

Lagrangian relaxation first: for a price ``lam`` per byte, each item independently takes the choice
least in ``cost + lam * bytes``; bisecting ``lam`` finds the cheapest price whose picks fit. Such a
pick is exactly optimal for its own total bytes (no assignment of that size or less costs less:
were there one, it would beat the pick at the same price), and the optimum within the budget costs
at least the pick's cost less ``lam`` times the bytes it leaves unspent (weak duality). Those bytes
are fewer than one item's next step up at that price (bisection stops where one more step would
not fit), so the gap is at most one tensor's step in error. A greedy fill then spends that slack,
item by item, on the upgrade that saves the most cost per byte, which only narrows the gap. tests/test_auto_mix.py checks it against
brute force on small random instances.
"""

from __future__ import annotations

import numpy as np


def cheapest_picks(costs: np.ndarray, sizes: np.ndarray, budget: float) -> np.ndarray:
    """The index of each item's choice (``costs``, ``sizes`` ``[items, choices]``; ``inf`` cost
    marks a choice the item lacks) whose summed cost is least, near enough (the module says how
    near), with summed size at most ``budget``. ValueError when even the smallest choices exceed it."""
    costs = np.asarray(costs, np.float64)
    sizes = np.asarray(sizes, np.float64)
    allowed = np.isfinite(costs)
    smallest = np.where(allowed, sizes, np.inf).min(1).sum()
    if smallest > budget:
        raise ValueError(f"no mix fits in {budget:.0f} bytes: the smallest takes {smallest:.0f}")
    picks = _priced(costs, sizes, allowed, 0.0)
    if _size(sizes, picks) > budget:
        picks = _bisect_price(costs, sizes, allowed, budget)
    return _fill(costs, sizes, allowed, picks, budget)


def _priced(costs: np.ndarray, sizes: np.ndarray, allowed: np.ndarray, lam: float) -> np.ndarray:
    """Each item's choice least in cost + lam * size, the smaller size on a tie."""
    total = np.where(allowed, costs + lam * sizes, np.inf)
    best = total.min(1, keepdims=True)
    return np.where(total <= best, sizes, np.inf).argmin(1)


def _size(sizes: np.ndarray, picks: np.ndarray) -> float:
    return float(sizes[np.arange(len(picks)), picks].sum())


def _bisect_price(costs: np.ndarray, sizes: np.ndarray, allowed: np.ndarray, budget: float) -> np.ndarray:
    """The picks at the least price per byte whose total fits ``budget``: a price above every
    cost difference over size difference picks the smallest choices, which fit."""
    low, high = 0.0, 1.0
    while _size(sizes, _priced(costs, sizes, allowed, high)) > budget:
        low, high = high, high * 2
    for _ in range(100):
        mid = (low + high) / 2
        if _size(sizes, _priced(costs, sizes, allowed, mid)) > budget:
            low = mid
        else:
            high = mid
    return _priced(costs, sizes, allowed, high)


def _fill(costs: np.ndarray, sizes: np.ndarray, allowed: np.ndarray, picks: np.ndarray, budget: float) -> np.ndarray:
    """Spend the budget left over on single-item upgrades, the most cost saved per byte first."""
    rows = np.arange(len(picks))
    picks = picks.copy()
    while True:
        slack = budget - _size(sizes, picks)
        extra = sizes - sizes[rows, picks][:, None]
        saved = costs[rows, picks][:, None] - costs
        usable = allowed & (extra <= slack) & (saved > 0)
        if not usable.any():
            return picks
        rate = np.where(usable, saved / np.maximum(extra, 1e-9), -np.inf)
        item, choice = np.unravel_index(rate.argmax(), rate.shape)
        picks[item] = choice
