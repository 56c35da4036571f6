"""``bits: auto``: each Linear's integer grid (bits and group size) chosen so that the model loses
least within a budget of bits per weight, for the checkpoints vLLM loads.

Each Linear is rounded to nearest on every candidate grid (recipes/fields.py: ``GRIDS``; by default
the 4-bit grids vLLM's CPU build serves) and its rounding error weighed by the importance matrix of
the calibration text (quant/error.py): the mean squared input per column is the Hessian's diagonal,
so the weighted error is, to first order, the squared error the Linear adds to its outputs per
token, one scale for every Linear and grid. GPTQ's own error on a grid is smaller than rounding's
but unknown until its pass has run, and its pass on every candidate would cost one GPTQ per grid:
rounding ranks the grids of one Linear the same way at a fraction of that. That proxy ranks one
Linear's grids well and different Linears' badly, so by default each item's errors are scaled by
the KL divergence it adds alone on its smallest grid over that grid's proxy (recipes/kld_gains.py;
estimated, ``sensitivity: fisher``, or measured, ``kld``), as ``type: auto`` does. The multiple-choice
knapsack (quant/knapsack.py) then picks one grid per item with the least summed error whose bits,
counted as the exports store them (codes, fp16 scales, zero-points when asymmetric: the report's
bits per weight), fit the budget. An item is a set of Linears vLLM runs as one product (q, k and v;
gate and up: formats/quantized_folder.py), which must share a grid to load there. With the candidate
``16-bit`` an item may also stay unquantized, at no error and 16 bits a weight: where one product
costs the model far more than the rest, keeping it whole is what the budget buys best.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from rich.progress import Progress

from core.errors import InputError
from core.schemes import QuantSpec
from core.tensors import QuantizedTensor
from formats.quantized_folder import by_product
from quant.error import weighted_rounding_error
from quant.knapsack import cheapest_picks
from quant.rtn import quantize_rtn
from recipes.fields import UNQUANTIZED
from recipes.kld_gains import sensitivity_gains


Choice = QuantSpec | None  # an item's grid; None: left unquantized (the candidate 16-bit)


def grid_bits(spec: Choice, shape: tuple[int, int]) -> float:
    """Bits of a ``[out, in]`` weight on ``spec``'s grid: its codes, an fp16 scale per group (and a
    zero-point of ``bits`` when asymmetric), as ``QuantizedTensor.bits_per_weight`` counts them;
    16 a weight unquantized."""
    out, n_in = shape
    if spec is None:
        return 16.0 * out * n_in
    groups = n_in // spec.group_size if spec.granularity == "group" else 1
    return out * (n_in * spec.bits + groups * (16 + (0 if spec.symmetric else spec.bits)))


def grid_items(modules: list[str]) -> dict[str, list[str]]:
    """The weights of the Linear ``modules``, by the product vLLM runs them as, in their order."""
    return {product: [f"{m}.weight" for m in members] for product, members in by_product(modules).items()}


def item_grids(ckpt, variant, weights: list[str]) -> list[Choice]:
    """The candidate grids whose groups divide every input size of one item's weights, smallest
    first, then None where the item may stay unquantized."""
    fitting: list[Choice] = [s for s in variant.weights.grids
                             if s.granularity == "channel" or all(ckpt.shape(n)[1] % s.group_size == 0 for n in weights)]
    if variant.weights.keeps_16_bit:
        fitting.append(None)
    if not fitting:
        raise InputError(f"variant '{variant.name}': no candidate grid's group size divides the input size "
                         f"{ckpt.shape(weights[0])[1]} of tensor '{weights[0]}'")
    return fitting


def smallest_grids(ckpt, variant, modules: list[str]) -> dict[str, QuantSpec]:
    """Each weight of the Linear ``modules`` on its smallest grid, as it stays until the search
    (``searched_grids``) reads the weights; refused in one line when even that mix exceeds the budget.
    Weights left unquantized are not in it."""
    items = grid_items(modules)
    smallest = {}
    for weights in items.values():
        grids = item_grids(ckpt, variant, weights)
        pick = min(grids, key=lambda s: sum(grid_bits(s, ckpt.shape(n)) for n in weights))
        smallest |= {n: pick for n in weights}
    count = sum(int(np.prod(ckpt.shape(n))) for n in smallest)
    smallest_bits = sum(grid_bits(s, ckpt.shape(n)) for n, s in smallest.items())
    if smallest_bits > variant.weights.bpw * count:
        raise InputError(f"variant '{variant.name}': a budget of {variant.weights.bpw:g} bpw is below the smallest mix "
                         f"of its candidates, {smallest_bits / count:.3f} bpw ({smallest_bits / 8e6:.3f} MB)")
    return {n: s for n, s in smallest.items() if s is not None}


def searched_grids(ckpt, variant, modules: list[str], imatrix: dict[str, np.ndarray] | None,
                   windows: torch.Tensor | None, progress: Progress) -> dict[str, QuantSpec]:
    """Each weight of the Linear ``modules`` on the grid the knapsack picks from the importance-weighted
    rounding errors, each item's scaled by its measured KL divergence gain on the calibration
    ``windows`` unless the weights say ``sensitivity: proxy``. Weights left unquantized are not in it."""
    items = grid_items(modules)
    choices = [item_grids(ckpt, variant, weights) for weights in items.values()]
    width = max(len(c) for c in choices)
    costs = np.full((len(items), width), np.inf)
    sizes = np.zeros((len(items), width))
    task = progress.add_task(f"{variant.name}: measure grids", total=len(items))
    for i, (weights, grids) in enumerate(zip(items.values(), choices)):
        sizes[i, : len(grids)] = [sum(grid_bits(s, ckpt.shape(n)) for n in weights) for s in grids]
        costs[i, : len(grids)] = 0.0
        for n in weights:  # each weight read once, rounded on every grid
            weight, importance = ckpt.tensor(n).float(), imatrix.get(n) if imatrix else None
            costs[i, : len(grids)] += [0.0 if s is None else rounding_error(weight, s, importance, n) for s in grids]
        progress.advance(task)
    progress.remove_task(task)
    sensitivity = variant.weights.sensitivity_used
    if sensitivity != "proxy":
        if windows is None:
            raise InputError(f"variant '{variant.name}': sensitivity {sensitivity} needs calibration text "
                             f"(add 'calibration: {{text: ...}}')")
        members = list(items.values())
        proxies = [costs[i, 0] if len(grids) > 1 else None for i, grids in enumerate(choices)]

        def alone(i: int) -> dict[str, QuantizedTensor]:  # the item on its smallest grid
            return {n: quantize_rtn(ckpt.tensor(n), choices[i][0], n) for n in members[i]}
        costs *= sensitivity_gains(sensitivity, ckpt, proxies, alone, windows, imatrix, progress)[:, None]
    count = sum(int(np.prod(ckpt.shape(n))) for weights in items.values() for n in weights)
    picks = cheapest_picks(costs, sizes, variant.weights.bpw * count)
    return {n: grids[k] for weights, grids, k in zip(items.values(), choices, picks) for n in weights if grids[k] is not None}


def rounding_error(weight: torch.Tensor, spec: QuantSpec, importance: np.ndarray | None, name: str) -> float:
    """The importance-weighted squared error of ``weight`` rounded to nearest on ``spec``'s grid."""
    return weighted_rounding_error(weight, quantize_rtn(weight, spec, name).dequantize(), importance)


def grid_label(weights) -> str:
    """How the report names the weights' grid: its label, or ``auto 4.5 bpw`` for a search."""
    return f"auto {weights.bpw:g} bpw" if weights.searches_bits else weights.spec.label


def grid_summary(specs: dict[str, QuantSpec], unquantized: int = 0) -> str:
    """"int4-g128-sym: 30 tensors, int4-g32-sym: 12, 16-bit: 3": how many Linears each grid holds,
    most first, and how many a search left ``unquantized``."""
    counts: dict[str, int] = defaultdict(int)
    for spec in specs.values():
        counts[spec.label] += 1
    if unquantized:
        counts[UNQUANTIZED] = unquantized
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{g}: {n} tensors" if i == 0 else f"{g}: {n}" for i, (g, n) in enumerate(ranked))

