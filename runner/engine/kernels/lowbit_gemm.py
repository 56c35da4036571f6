"""Weight-only low-bit matrix products in Triton: ``y = x @ W.T`` for activations ``x [M, K]`` in
fp16, bf16 or fp32 and a weight ``W [N, K]`` held as int4 or int8 codes with a scale (and, when
asymmetric, a zero-point) per output and group of inputs, ``W = (code - zero) · scale``.

Decoding multiplies a few rows by every weight of the model, so a step takes as long as the
weights take to read: int4 reads a quarter of bf16's bytes and should be up to four times faster,
if the kernel streams the codes at the memory's speed and dequantizes them where they land, in
registers, never writing a float copy. Here each program dequantizes a tile of codes to the
activations' dtype and feeds it to the tensor cores (``tl.dot``), accumulating in fp32.

The weight is packed once, at load (``pack``), in the layout the kernel reads fastest:

- codes transposed to ``[K, N]`` (outputs contiguous, so each row of a tile is one run of bytes,
  read 16 to a thread), int4 two to a byte along the inputs (``[K/2, N]``, the even input in the low
  nibble), int8 one to a byte;
- scales (and zero-points, only where they differ from the mid-level) as ``[groups, N]`` in the
  activations' dtype, as tinygemm and Marlin keep them;
- GPTQ act-order weights (``group_index``) have their input columns sorted by group, so that
  groups are runs of consecutive rows again; the kernel reads each input column through the same
  permutation (``order``), so there is no gathered copy of ``x``.

Which program computes what (``schedule``, a table to be tuned on a GPU, not measured yet):

- decode (a few rows): one 16-row tile of ``x`` against a strip of outputs, and the inputs split
  among several programs (split-K) when the strips alone would leave multiprocessors idle; the
  splits' fp32 partial sums are added by a second small kernel in a fixed order, so a product
  gives the same bits every time (atomic adds would not);
- more rows: the usual tiled GEMM, ``tl.dot`` on 64- or 128-row tiles.

Above some number of rows a product is bound by arithmetic, not by bytes, and cuBLAS on a
dequantized copy wins; ``dequantize`` writes that copy (runner/engine/cuda_linear.py decides).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from core.tensors import QuantizedTensor

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_CODES = 2**31  # offsets into the codes are 32-bit


@dataclass(frozen=True)
class PackedWeight:
    """One weight in the kernel's layout (see the module's docstring)."""

    codes: torch.Tensor  # uint8 [K/2, N] (int4) or [K, N] (int8)
    scales: torch.Tensor  # [groups, N], the activations' dtype
    zeros: torch.Tensor | None  # like scales; None where every zero-point is the mid-level
    order: torch.Tensor | None  # int32 [K]: the input column each packed row holds (act-order)
    bits: int
    group: int  # inputs per scale (K: one scale per output)
    n_out: int
    n_in: int


def refusal(q: QuantizedTensor, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot multiply ``q`` with ``dtype`` activations, or None when it can."""
    spec, (n_out, n_in) = q.spec, q.shape
    if spec.format != "int" or spec.bits not in (4, 8):
        return f"{spec.label} weights (the kernel reads int4 and int8 codes)"
    if spec.granularity == "block":
        return "block scales (the kernel takes scales per output, by groups of inputs)"
    if dtype not in ACTIVATION_DTYPES:
        return f"{dtype} activations"
    groups = q.scales.shape[1]
    if n_in % groups:
        return f"{n_in} inputs in {groups} groups"
    group = n_in // groups
    if groups > 1 and group % 16:
        return f"groups of {group} inputs (the kernel's tiles take multiples of 16)"
    if spec.bits == 4 and n_in % 2:
        return f"{n_in} inputs, an odd number (int4 codes go two to a byte)"
    if q.group_index is not None:
        in_order = torch.sort(q.group_index.long()).values
        if not torch.equal(in_order, torch.arange(n_in, device=in_order.device) // group):
            return "act-order groups of unequal sizes"
    if q.codes.numel() >= MAX_CODES:
        return f"{n_out} x {n_in} codes (offsets are 32-bit)"
    return None


def pack(q: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> PackedWeight:
    """``q`` in the kernel's layout on ``device`` (repacked there: a GPU does it faster), its scales
    in ``dtype`` (``refusal`` is None)."""
    codes, n_in = q.codes.to(device), q.shape[1]
    order = None
    if q.group_index is not None:  # act-order: columns sorted by group, the inputs read the same way
        perm = torch.argsort(q.group_index.to(device).long(), stable=True)
        codes, order = codes[:, perm], perm.to(torch.int32)
    columns = codes.T.contiguous()  # [K, N]
    if q.spec.bits == 4:
        columns = columns[0::2] | (columns[1::2] << 4)
    mid = 2 ** (q.spec.bits - 1)
    zeros = None if bool((q.zeros == mid).all()) else q.zeros.T.to(device=device, dtype=dtype).contiguous()
    return PackedWeight(columns, q.scales.T.to(device=device, dtype=dtype).contiguous(), zeros, order,
                        q.spec.bits, n_in // q.scales.shape[1], q.shape[0], n_in)


class Schedule(NamedTuple):
    """How the product is cut: tiles of ``block_m`` rows, ``block_n`` outputs and ``block_k``
    inputs, the inputs split ``split_k`` ways; Triton's ``num_warps`` and ``num_stages``."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int


# (most rows, block_m, block_n, block_k, warps, stages), the last row for any count. Chosen without
# a GPU, by compiling for sm_90 (Triton 3.9, ptxas): the largest tiles whose every variant (int4
# and int8, zero-points or not, act-order) keeps within 255 registers without spilling; below 64
# rows mma.sync, from 64 on wgmma. To be tuned on a GPU with bench/lowbit_gemm.py --sweep.
SCHEDULES = [
    (16, 16, 64, 256, 8, 4),
    (32, 32, 64, 128, 4, 4),
    (64, 64, 64, 128, 4, 4),
    (None, 64, 128, 64, 8, 3),
]
FP32_SCHEDULES = [  # fp32's exact products (ieee) multiply on plain FMAs: small tiles, else they spill
    (16, 16, 64, 64, 8, 3),
    (32, 32, 64, 32, 4, 3),
    (None, 64, 64, 32, 8, 3),
]
PROGRAMS_PER_PROCESSOR = 2  # what split-K fills the grid up to, where the tiles leave multiprocessors idle


def schedule(rows: int, w: PackedWeight, processors: int) -> Schedule:
    """The table's tiles for ``rows`` rows, the input tile fitted to the groups; where there
    are fewer tiles than multiprocessors, the inputs split until every one has
    ``PROGRAMS_PER_PROCESSOR`` programs."""
    table = FP32_SCHEDULES if w.scales.dtype == torch.float32 else SCHEDULES
    block_m, block_n, block_k, warps, stages = next(s[1:] for s in table if s[0] is None or rows <= s[0])
    block_k = fit_block_k(block_k, w)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(w.n_out, block_n)
    k_tiles = triton.cdiv(w.n_in, block_k)
    split = 1 if tiles >= processors else min(k_tiles, triton.cdiv(PROGRAMS_PER_PROCESSOR * processors, tiles))
    return Schedule(block_m, block_n, block_k, triton.cdiv(k_tiles, triton.cdiv(k_tiles, split)), warps, stages)


def fit_block_k(block_k: int, w: PackedWeight) -> int:
    """The widest input tile up to ``block_k`` (and not much past K) that holds whole groups or
    lies within one: tiles are powers of two, so a group of 48 takes tiles of 16."""
    block_k = min(block_k, max(16, triton.next_power_of_2(w.n_in)))
    if w.group == w.n_in or w.group & (w.group - 1) == 0:
        return block_k
    return min(block_k, w.group & -w.group)


def matmul(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, plan: Schedule | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for 2-D ``x`` in the scales' dtype, by ``plan`` or the schedule's."""
    rows = x.shape[0]
    plan = plan or schedule(rows, w, _processors(x.device))
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(rows, w.n_out, dtype=x.dtype, device=x.device)
    target = out if plan.split_k == 1 else torch.empty(plan.split_k, rows, w.n_out, dtype=torch.float32, device=x.device)
    k_tiles = triton.cdiv(w.n_in, plan.block_k)
    per_split = triton.cdiv(k_tiles, plan.split_k)
    grid = (triton.cdiv(rows, plan.block_m) * triton.cdiv(w.n_out, plan.block_n), plan.split_k)
    _gemm_kernel[grid](
        x, _or(w.order, x), w.codes, w.scales, _or(w.zeros, w.scales), _or(bias, out), target,
        rows, w.n_out, w.n_in, x.stride(0), per_split,
        **_weight_constants(w, plan.block_k), HAS_ORDER=w.order is not None, HAS_BIAS=bias is not None and plan.split_k == 1,
        PARTIAL=plan.split_k > 1, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, EVEN_N=w.n_out % plan.block_n == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=plan.warps, num_stages=plan.stages)
    if plan.split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(out.numel(), block),)](
            target, _or(bias, out), out, out.numel(), w.n_out, SPLIT_K=plan.split_k, HAS_BIAS=bias is not None, BLOCK=block)
    return out


def dequantize(w: PackedWeight, out: torch.Tensor) -> torch.Tensor:
    """``W.T`` as ``[K, N]`` floats in ``out``'s dtype, written into ``out`` (at least K·N long),
    its rows in the packed order (act-order's sorted columns): for cuBLAS above the kernel's rows."""
    block_k, block_n = fit_block_k(64, w), 128
    dense = out[: w.n_in * w.n_out].view(w.n_in, w.n_out)
    grid = (triton.cdiv(w.n_in, block_k), triton.cdiv(w.n_out, block_n))
    _dequantize_kernel[grid](w.codes, w.scales, _or(w.zeros, w.scales), dense, w.n_out, w.n_in,
                             **_weight_constants(w, block_k), BLOCK_N=block_n, num_warps=4)
    return dense


def _weight_constants(w: PackedWeight, block_k: int) -> dict:
    """The compile-time description of a weight's tiles that both kernels share."""
    return dict(BITS=w.bits, GROUP=w.group, SCALES_PER_TILE=w.group == w.n_in or w.group % block_k == 0,
                HAS_ZEROS=w.zeros is not None, MID=float(2 ** (w.bits - 1)), BLOCK_K=block_k, EVEN_K=w.n_in % block_k == 0)


def _or(tensor: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """A pointer argument the kernel does not read (its HAS_ flag is off) still needs a tensor."""
    return stand_in if tensor is None else tensor


@functools.lru_cache(maxsize=None)
def _processors(device: torch.device) -> int:
    """Multiprocessors to fill; under the interpreter (a CPU tensor) any small number serves."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


# The kernels call Triton's builtins only, not its jit functions (tl.cdiv, tl.zeros): an interpreter
# turned on after Triton was first imported cannot call those.


@triton.jit
def _weight_tile(codes_ptr, scales_ptr, zeros_ptr, k0, cols, N, K,
                 BITS: tl.constexpr, GROUP: tl.constexpr, SCALES_PER_TILE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 MID: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    """W.T's ``[BLOCK_K, BLOCK_N]`` tile at inputs ``k0 ..``, outputs ``cols``, in the scales'
    dtype: codes read once, unpacked and scaled in registers. Inputs past K come out as
    zero-point·scale (finite); the activations there are zero."""
    if BITS == 4:
        pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        pointers = codes_ptr + pairs[:, None] * N + cols[None, :]
        if EVEN_K:
            packed = tl.load(pointers)
        else:
            packed = tl.load(pointers, mask=(pairs < K // 2)[:, None], other=0)
        q = tl.join(packed & 15, packed >> 4).permute(0, 2, 1).reshape(BLOCK_K, BLOCK_N)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        pointers = codes_ptr + ks[:, None] * N + cols[None, :]
        if EVEN_K:
            q = tl.load(pointers)
        else:
            q = tl.load(pointers, mask=(ks < K)[:, None], other=0)
    q = q.to(scales_ptr.dtype.element_ty)  # (code - zero) is exact there: one rounding, as fp32 then a cast would give
    if SCALES_PER_TILE:  # the tile lies within one group (compiled code has one return, after both branches)
        at = (k0 // GROUP) * N + cols
        scale = tl.load(scales_ptr + at)[None, :]
        if HAS_ZEROS:
            w = (q - tl.load(zeros_ptr + at)[None, :]) * scale
        else:
            w = (q - MID) * scale
    else:  # the tile holds whole groups
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        at = groups[:, None] * N + cols[None, :]
        inside = (groups * GROUP < K)[:, None]
        scale = tl.load(scales_ptr + at, mask=inside, other=0.0)[:, None, :]
        by_group = tl.reshape(q, (BLOCK_K // GROUP, GROUP, BLOCK_N))
        if HAS_ZEROS:
            by_group = (by_group - tl.load(zeros_ptr + at, mask=inside, other=0.0)[:, None, :]) * scale
        else:
            by_group = (by_group - MID) * scale
        w = tl.reshape(by_group, (BLOCK_K, BLOCK_N))
    return w


@triton.jit
def _gemm_kernel(x_ptr, order_ptr, codes_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
                 M, N, K, stride_xm, tiles_per_split,
                 BITS: tl.constexpr, GROUP: tl.constexpr, SCALES_PER_TILE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 MID: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 HAS_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of the product over one split's run of input tiles: the
    finished tile (bias added), or where the inputs are split (PARTIAL) its fp32 partial sum at
    ``out[split]``; the split count is the grid's, not compiled in."""
    tile, split = tl.program_id(0), tl.program_id(1)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    offs_m = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64) * stride_xm  # rows past M repeat the last; not stored
    cols = offs_n if EVEN_N else tl.minimum(offs_n, N - 1)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    first = split * tiles_per_split
    for t in range(first, tl.minimum(first + tiles_per_split, (K + BLOCK_K - 1) // BLOCK_K)):
        ks = t * BLOCK_K + tl.arange(0, BLOCK_K)
        if HAS_ORDER:
            ks_in = tl.load(order_ptr + ks) if EVEN_K else tl.load(order_ptr + ks, mask=ks < K, other=0)
        else:
            ks_in = ks
        pointers = x_ptr + x_rows[:, None] + ks_in[None, :]
        a = tl.load(pointers) if EVEN_K else tl.load(pointers, mask=(ks < K)[None, :], other=0.0)
        w = _weight_tile(codes_ptr, scales_ptr, zeros_ptr, t * BLOCK_K, cols, N, K,
                         BITS, GROUP, SCALES_PER_TILE, HAS_ZEROS, MID, BLOCK_K, BLOCK_N, EVEN_K)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    at = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    inside = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        tl.store(out_ptr + split.to(tl.int64) * M * N + at, acc, mask=inside)


@triton.jit
def _sum_splits_kernel(partials_ptr, bias_ptr, out_ptr, size, N,
                       SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``out = sum of the SPLIT_K partials (+ bias)``, in split order, cast to ``out``'s dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < size
    acc = tl.load(partials_ptr + offs, mask=inside, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(partials_ptr + s * size + offs, mask=inside, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, zeros_ptr, out_ptr, N, K,
                       BITS: tl.constexpr, GROUP: tl.constexpr, SCALES_PER_TILE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       MID: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """One ``[BLOCK_K, BLOCK_N]`` tile of ``W.T``, dequantized into ``out [K, N]``."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = _weight_tile(codes_ptr, scales_ptr, zeros_ptr, k0, tl.minimum(offs_n, N - 1), N, K,
                     BITS, GROUP, SCALES_PER_TILE, HAS_ZEROS, MID, BLOCK_K, BLOCK_N, EVEN_K)
    ks = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + ks.to(tl.int64)[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(ks < K)[:, None] & (offs_n < N)[None, :])
