"""GPTQ (Frantar et al., 2022): quantize a Linear weight one input column at a time, and let the
columns not yet quantized absorb each column's rounding error, weighted by how the layer's inputs
correlate.

The layer's output error for a weight change ``dW`` is ``tr(dW H dWᵀ)`` with ``H = 2/n Σ x xᵀ``
over the calibration inputs ``x``. Quantizing column ``j`` costs ``err² / [H⁻¹]_jj``, and the
optimal correction of the remaining columns is ``-err · [H⁻¹]_j,: / [H⁻¹]_jj``. Taking the rows of
``H⁻¹`` from the upper Cholesky factor of ``H⁻¹`` makes every step a rank-one update, and doing the
updates for a block of columns lazily (one matrix product per block) keeps it fast. Scales come
from each group's *updated* weights when the loop reaches the group (min-max, MSE or percentile
range, any number format: quant/rtn.py fits, rounds and decodes for both quantizers), so they fit
the weights that are actually rounded.

Act-order visits columns by decreasing ``H_jj`` (the inputs with the most energy first, while the
most columns remain to absorb their error); groups are then formed in that order and the column ->
group map travels with the result (``group_index``, GPTQ's ``g_idx``), unless ``static_groups``
fixes the groups to contiguous input columns with scales from the original weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import InputError
from core.schemes import QuantSpec
from core.tensors import QuantizedTensor, all_finite
from quant.error import relative_error
from quant.rtn import fit_grid, grid_values, round_to_grid

_DAMP_STEP = 0.01  # added to the damping fraction each time H + damp·mean(diag H)·I is not positive definite
_DAMP_LIMIT = 1.0


@dataclass(frozen=True)
class GPTQSettings:
    damp: float = 0.01  # fraction of mean(diag H) added to the diagonal
    block_size: int = 128  # columns per lazy update
    act_order: bool = False
    static_groups: bool = False
    keep_unrounded: bool = False  # return each column as it was just before rounding (QAT trains on from there)


@dataclass(frozen=True)
class GPTQResult:
    tensor: QuantizedTensor
    loss: float  # Σ err² / [H⁻¹]_jj / 2: the layer-output error GPTQ minimised, for the report
    damp: float  # the damping that made H positive definite
    output_error: float | None = None  # quant/error.py: ‖ΔW X‖ / ‖W X‖ on the calibration inputs
    unrounded: torch.Tensor | None = None  # [out, in]: each column as updated, just before it was rounded


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, settings: GPTQSettings = GPTQSettings(), name: str = "tensor"
) -> GPTQResult:
    """Quantize ``weight [out, in]`` given the Hessian ``[in, in]`` of its inputs."""
    out, n_in = weight.shape
    if spec.granularity == "block":
        raise InputError(f"{name}: GPTQ quantizes one input column at a time and cannot use granularity 'block' (use 'group')")
    group = spec.group_size if spec.granularity == "group" else n_in
    if n_in % group:
        raise InputError(f"{name}: input size {n_in} is not a multiple of group_size {group}")
    W = weight.to(torch.float32).clone()
    H = hessian.to(torch.float32)  # copied only where changed: a down_proj's is 14336² (822 MB)
    if not all_finite(H):
        raise InputError(f"{name}: calibration activations contain NaN or Inf")
    dead = torch.diagonal(H) == 0  # inputs that were always zero: any weight there is free
    if dead.any():
        H = H.clone() if H is hessian else H
        H[dead, dead] = 1.0
        W[:, dead] = 0.0

    if spec.granularity != "group" or settings.static_groups:
        # Ranges fixed before any update: per tensor/channel always, per group when static.
        fixed_scales, fixed_zeros = fit_grid(W.reshape(out, n_in // group, group), spec, name)
    device = W.device
    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True) if settings.act_order else torch.arange(n_in, device=device)
    if settings.act_order:
        W, H = W[:, perm], H[perm[:, None], perm]
    Hinv, damp = _inverse_hessian_factor(H, settings.damp, name)

    codes = torch.empty(W.shape, dtype=torch.uint8, device=device)
    unrounded = torch.empty_like(W) if settings.keep_unrounded else None
    # each visited column's group, by visit position: known before the loop, which then neither
    # writes one element per column nor (static groups) reads one back from a GPU
    if spec.granularity != "group":
        col_group = torch.zeros(n_in, dtype=torch.int64, device=device)
    else:
        col_group = (perm if settings.static_groups else torch.arange(n_in, device=device)) // group
    static_group = col_group.tolist() if spec.granularity == "group" and settings.static_groups else None
    scales, zeros = [], []
    loss = torch.zeros((), dtype=torch.float64, device=device)
    block = -(-max(settings.block_size, group) // group) * group if spec.granularity == "group" else settings.block_size
    for b0 in range(0, n_in, block):
        b1 = min(b0 + block, n_in)
        W1 = W[:, b0:b1].clone()
        Err = torch.empty_like(W1)
        Hinv1 = Hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            j = b0 + i
            if spec.granularity == "group" and not settings.static_groups:
                if j % group == 0:  # a new group starts: its range from the weights as updated so far
                    s, z = fit_grid(W1[:, i : i + group].unsqueeze(1), spec, name)
                    scales.append(s[:, 0])
                    zeros.append(z[:, 0])
                s, z = scales[j // group], zeros[j // group]
            else:
                g = 0 if spec.granularity != "group" else static_group[j]
                s, z = fixed_scales[:, g], fixed_zeros[:, g]
            w = W1[:, i]
            q = round_to_grid(w, s, z, spec)
            codes[:, j] = q
            if unrounded is not None:
                unrounded[:, j] = w
            d = Hinv1[i, i]
            err = (w - grid_values(q, s, z, spec)) / d
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err[:, i] = err
        W[:, b1:] -= Err @ Hinv[b0:b1, b1:]
        loss += (Err.double() ** 2).sum() / 2

    inverse = torch.argsort(perm)
    if spec.granularity == "group" and not settings.static_groups:
        scale_t, zero_t = torch.stack(scales, 1), torch.stack(zeros, 1)
    else:
        scale_t, zero_t = fixed_scales, fixed_zeros
    group_index = col_group[inverse]
    contiguous = torch.equal(group_index, torch.arange(n_in, device=device) // group) or spec.granularity != "group"
    tensor = QuantizedTensor(
        spec=spec,
        codes=codes[:, inverse],
        scales=scale_t.contiguous(),
        zeros=zero_t.contiguous(),
        group_index=None if contiguous else group_index.to(torch.int32),
    )
    return GPTQResult(tensor, float(loss), damp, relative_error(weight, tensor.dequantize(), hessian),
                      None if unrounded is None else unrounded[:, inverse])


def _inverse_hessian_factor(H: torch.Tensor, damp: float, name: str) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + λI)⁻¹`` with ``λ = damp·mean(diag H)``, raising ``damp`` by
    steps while the damped Hessian is still not positive definite (few or collinear samples)."""
    mean_diag = torch.diagonal(H).mean()
    while damp <= _DAMP_LIMIT + 1e-9:
        # two [in, in] matrices at a time beside H (each 822 MB for a 14336-wide down_proj), each
        # step's input freed as its output is made
        damped = H.clone()
        damped.diagonal().add_(damp * mean_diag)
        L, info = torch.linalg.cholesky_ex(damped)
        del damped
        if info == 0:
            inverse = torch.cholesky_inverse(L)
            del L
            U, info = torch.linalg.cholesky_ex(inverse, upper=True)
            del inverse
            if info == 0:
                return U, damp
        damp += _DAMP_STEP
    raise InputError(f"{name}: the inputs' Hessian is not positive definite even with damping {_DAMP_LIMIT} (calibration text too short?)")
