"""``type: auto``: each tensor's ggml type chosen so that the file loses least within a budget.

Each tensor is encoded in every candidate type it can take and the importance-weighted squared
error of each encoding measured (quant/ggml/sensitivity.py); the multiple-choice knapsack
(quant/knapsack.py) then picks one type per tensor with the least summed error whose bytes of
tensor data fit the budget. The plan made before any data is read (``auto_plan``) already knows
each tensor's size in every type, so a budget that no mix can meet is refused before work starts.

The errors of different tensors are put on one scale, the squared error a tensor adds to its
outputs per token: a decoder Linear's is the proxy with its importance matrix; the output head,
which llama-imatrix leaves out, counts each column once (its input is RMS-normalised); the token
embedding is read one row per token, so its summed error is divided by its rows. That scale
ranks one tensor's types well and different tensors badly (docs/formats.md: bench/auto_proxy.py),
so with calibration text each tensor's proxies are scaled by a gain: the KL divergence
that the tensor alone, in its candidate nearest 4 bits per weight, adds to the float model's
distributions on a few calibration windows, over that type's proxy. It costs one evaluation pass
of the model per tensor measured (``sensitivity: kld``); ``fisher``, the default, estimates it from
one forward and backward walk (recipes/kld_gains.py).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from rich.progress import Progress

from core.errors import InputError
from core.tensors import GGMLTensor
from core.file_types import NEEDS_IMATRIX, fit_rows, is_embedding_or_head, is_quantizable
from formats.gguf import gguf_name
from quant.ggml import encode
from quant.ggml.sensitivity import weighted_error
from quant.knapsack import cheapest_picks
from recipes.kld_gains import sensitivity_gains
from recipes.methods import Imatrix, Plan, gguf_plan

# the default candidates: every K- and i-quant type we encode, and Q8_0, smallest first
AUTO_CANDIDATES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "Q2_K", "IQ3_XXS", "IQ3_S", "Q3_K", "IQ4_XS",
                   "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
HEAD_ONLY = ("F16", "BF16")  # candidates for the token embedding and the output head alone


def tensor_bytes(shape: tuple[int, ...], ggml_type: str) -> int:
    """Bytes of a tensor's data in ``ggml_type``: its blocks times the type's block bytes."""
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    return int(np.prod(shape)) // block * block_bytes


def tensor_choices(ckpt, names: list[str], weights, has_imatrix: bool) -> dict[str, tuple[str, ...]]:
    """The types each tensor may take: the candidates whose blocks split its rows (the float head
    types only for the embedding and the head; none that llama.cpp makes only with an importance
    matrix where the tensor has none: anywhere without one, and in the embedding and the head,
    which llama-imatrix leaves out), or llama.cpp's fallback for the smallest candidate where none does;
    F32 alone for the tensors every file keeps in F32 (norms, biases)."""
    given = weights.candidates or [t for t in (*AUTO_CANDIDATES, *HEAD_ONLY) if has_imatrix or t not in NEEDS_IMATRIX]
    choices = {}
    for name in names:
        shape = tuple(ckpt.shape(name))
        if not is_quantizable(name, shape):
            choices[name] = ("F32",)
            continue
        head = is_embedding_or_head(name)
        usable = [t for t in given if (t not in HEAD_ONLY or head) and not (head and t in NEEDS_IMATRIX)]
        fitting = tuple(t for t in usable if shape[-1] % GGML_QUANT_SIZES[GGMLQuantizationType[t]][0] == 0)
        choices[name] = fitting or (fit_rows(usable[0], shape[-1]),)
    return choices


def auto_plan(ckpt, variant, has_imatrix: bool) -> Plan:
    """The tensors of a ``type: auto`` variant, each in its smallest type until the search
    (``searched_plan``) reads the weights; refused in one line when even that mix exceeds the budget."""
    names = gguf_plan(ckpt, variant, "F32", has_imatrix).names
    choices = tensor_choices(ckpt, names, variant.weights, has_imatrix)
    types = {n: min(c, key=lambda t: tensor_bytes(ckpt.shape(n), t)) for n, c in choices.items()}
    smallest = sum(tensor_bytes(ckpt.shape(n), t) for n, t in types.items())
    weights = sum(int(np.prod(ckpt.shape(n))) for n in names)
    budget = variant.weights.budget_bytes(weights)
    if smallest > budget:
        raise InputError(f"variant '{variant.name}': a budget of {budget / 1e6:.3f} MB ({8 * budget / weights:.3f} bpw) "
                         f"is below the smallest mix of its candidates, {smallest / 1e6:.3f} MB ({8 * smallest / weights:.3f} bpw)")
    return Plan(names, types)


def searched_plan(ckpt, variant, plan: Plan, imatrix: Imatrix | None, windows: torch.Tensor | None,
                  progress: Progress) -> Plan:
    """``plan`` with the types the knapsack picks from each tensor's measured errors."""
    choices = tensor_choices(ckpt, plan.names, variant.weights, imatrix is not None)
    width = max(len(c) for c in choices.values())
    costs = np.full((len(plan.names), width), np.inf)
    sizes = np.zeros((len(plan.names), width))
    task = progress.add_task(f"{variant.name}: measure types", total=len(plan.names))
    for i, name in enumerate(plan.names):
        shape = tuple(ckpt.shape(name))
        sizes[i, : len(choices[name])] = [tensor_bytes(shape, t) for t in choices[name]]
        costs[i, : len(choices[name])] = proxy_errors(ckpt, name, choices[name], imatrix) if len(choices[name]) > 1 else 0.0
        progress.advance(task)
    progress.remove_task(task)
    sensitivity = variant.weights.sensitivity_used
    if sensitivity != "proxy":
        if windows is None:
            raise InputError(f"variant '{variant.name}': sensitivity {sensitivity} needs calibration text "
                             f"(add 'calibration: {{text: ...}}')")
        costs *= _gains(sensitivity, ckpt, plan.names, choices, costs, imatrix, windows, progress)[:, None]
    weights = sum(int(np.prod(ckpt.shape(n))) for n in plan.names)
    picks = cheapest_picks(costs, sizes, variant.weights.budget_bytes(weights))
    types = {name: choices[name][k] for name, k in zip(plan.names, picks)}
    return Plan(plan.names, types, plan.quantized, summary=type_summary(types))


def _gains(sensitivity: str, ckpt, names: list[str], choices: dict[str, tuple[str, ...]], costs: np.ndarray,
           imatrix: Imatrix | None, windows: torch.Tensor, progress: Progress) -> np.ndarray:
    """Each tensor's added KL divergence per unit of proxy (recipes/kld_gains.py), measured or
    estimated in its type nearest 4 bits per weight (1 where it has no choice)."""
    measured = [int(np.argmin([abs(8 * tensor_bytes(ckpt.shape(n), t) / np.prod(ckpt.shape(n)) - 4) for t in choices[n]]))
                for n in names]
    proxies = [costs[i, k] if len(choices[n]) > 1 else None for i, (n, k) in enumerate(zip(names, measured))]

    def alone(i: int) -> dict[str, GGMLTensor]:
        name = names[i]
        return {name: encode(ckpt.tensor(name), choices[name][measured[i]], name, imatrix.get(name) if imatrix else None)}
    return sensitivity_gains(sensitivity, ckpt, proxies, alone, windows, imatrix, progress)


def proxy_errors(ckpt, name: str, types: tuple[str, ...], imatrix: Imatrix | None) -> list[float]:
    """Each type's proxy error for one tensor, on the per-token scale the module describes."""
    weight = ckpt.tensor(name)
    importance = imatrix.get(name) if imatrix else None
    per_row = gguf_name(name, ckpt.arch) == "token_embd.weight" and "lm_head.weight" in ckpt.names
    scale = 1.0 / weight.shape[0] if per_row else 1.0
    return [scale * weighted_error(weight, t, importance, name) for t in types]


def type_summary(types: dict[str, str]) -> str:
    """"Q4_K: 28 tensors, Q5_K: 7, ...": how many quantized tensors each type holds, most first."""
    counts: dict[str, int] = {}
    for t in types.values():
        if t != "F32":
            counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{t}: {n} tensors" if i == 0 else f"{t}: {n}" for i, (t, n) in enumerate(ranked))
