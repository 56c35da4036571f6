"""Decode attention over the paged KV cache, reading every key and value in the block where it lies.

A decoding sequence has one query row (or the ``m`` rows of a speculative verify step), and its
keys sit in the pool's blocks, ``[blocks, kv_heads, block_size, dim]`` per layer, in the order its
block table lists them. The torch path (``model.py``) gathers those blocks into one batch every
step; this kernel instead looks each token's block up in the table as it goes, so the only memory
traffic is the keys and values themselves, read once.

Two launches (flash-decoding's split, as vLLM's paged attention v2 does it):

- ``_partition``: one program per (sequence, KV head, partition of ``partition`` positions) scores
  the query rows of every head that shares the KV head (GQA) against the partition's keys, ``tile``
  positions at a time, with an online softmax in float32: a running maximum, sum and weighted sum of
  values per row. Splitting a sequence over partitions keeps the GPU busy when few sequences decode
  (one long sequence alone would otherwise run on as many programs as it has KV heads). A sliding
  window skips the positions before it; Gemma's soft-cap is applied before the mask, as the torch path does.
- ``_combine``: per row and head, the partitions' results rescaled to their common maximum and summed.

The partition count comes from the block table's width, never from the lengths' values: a
static table (``static_decode.py``) gives a static grid, which a CUDA graph can replay. A table
wide enough for more than ``MAX_PARTS`` partitions gets longer partitions instead, so that the
combining program holds at most ``MAX_PARTS`` partial results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PARTS = 64

@triton.jit
def _tanh(x):
    """tanh from exp (Triton's core has none): 1 - 2 / (e^2x + 1), exact at both saturations."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _partition(q, keys, values, table, lengths, part_max, part_sum, part_out,
               scale, softcap, window,
               q_seq, q_row, q_head, k_block, k_head, k_slot, v_block, v_head, v_slot, table_seq, len_seq, len_row,
               M: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr, HEADS: tl.constexpr, PARTS: tl.constexpr,
               DIM: tl.constexpr, DIM_P: tl.constexpr, VDIM: tl.constexpr, VDIM_P: tl.constexpr,
               BLOCK: tl.constexpr, TILE: tl.constexpr, PARTITION: tl.constexpr,
               WINDOWED: tl.constexpr, CAPPED: tl.constexpr):
    seq, kv, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = tl.arange(0, ROWS)  # the program's query rows: row i // GROUPS of head kv * GROUPS + i % GROUPS
    real = i < M * GROUPS
    row, head = i // GROUPS, kv * GROUPS + i % GROUPS
    length = tl.load(lengths + seq * len_seq + row * len_row, mask=real, other=0).to(tl.int32)  # keys each row sees
    d, dv = tl.arange(0, DIM_P), tl.arange(0, VDIM_P)
    queries = tl.load(q + seq * q_seq + row[:, None] * q_row + head[:, None] * q_head + d[None, :],
                      mask=real[:, None] & (d[None, :] < DIM), other=0.0)
    lo = part * PARTITION
    hi = tl.minimum(lo + PARTITION, tl.max(length, 0))
    if WINDOWED:  # positions before every row's window are skipped
        lo = tl.maximum(lo, tl.min(tl.where(real, length, 2**31 - 1), 0) - window)
    run_max = tl.full([ROWS], float("-inf"), tl.float32)
    run_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, VDIM_P], tl.float32)
    for start in range(lo, hi, TILE):
        pos = start + tl.arange(0, TILE)
        inside = pos < hi
        block = tl.load(table + seq * table_seq + pos // BLOCK, mask=inside, other=0).to(tl.int64)
        slot = pos % BLOCK
        k = tl.load(keys + block[:, None] * k_block + kv * k_head + slot[:, None] * k_slot + d[None, :],
                    mask=inside[:, None] & (d[None, :] < DIM), other=0.0)
        scores = tl.dot(queries, tl.trans(k.to(queries.dtype)), input_precision="ieee") * scale  # [ROWS, TILE]
        if CAPPED:
            scores = softcap * _tanh(scores / softcap)
        visible = inside[None, :] & (pos[None, :] < length[:, None])
        if WINDOWED:
            visible &= pos[None, :] >= length[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, 1))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that has seen no key yet
        weights = tl.exp(scores - safe[:, None])
        rescale = tl.exp(run_max - safe)
        run_sum = run_sum * rescale + tl.sum(weights, 1)
        v = tl.load(values + block[:, None] * v_block + kv * v_head + slot[:, None] * v_slot + dv[None, :],
                    mask=inside[:, None] & (dv[None, :] < VDIM), other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(queries.dtype), v.to(queries.dtype), input_precision="ieee")
        run_max = new_max
    at = ((seq * M + row) * HEADS + head) * PARTS + part
    tl.store(part_max + at, run_max, mask=real)
    tl.store(part_sum + at, run_sum, mask=real)
    tl.store(part_out + at[:, None] * VDIM + dv[None, :], acc, mask=real[:, None] & (dv[None, :] < VDIM))


@triton.jit
def _combine(part_max, part_sum, part_out, out, PARTS: tl.constexpr, PARTS_P: tl.constexpr,
             VDIM: tl.constexpr, VDIM_P: tl.constexpr):
    i = tl.program_id(0)  # (sequence, row, head), flat
    p, dv = tl.arange(0, PARTS_P), tl.arange(0, VDIM_P)
    maxes = tl.load(part_max + i * PARTS + p, mask=p < PARTS, other=float("-inf"))
    sums = tl.load(part_sum + i * PARTS + p, mask=p < PARTS, other=0.0)
    top = tl.max(maxes, 0)
    weights = tl.exp(maxes - tl.where(top == float("-inf"), 0.0, top))  # partitions with no key weigh 0
    outs = tl.load(part_out + (i * PARTS + p[:, None]) * VDIM + dv[None, :],
                   mask=(p[:, None] < PARTS) & (dv[None, :] < VDIM), other=0.0)
    total = tl.sum(sums * weights, 0)
    tl.store(out + i * VDIM + dv, tl.sum(outs * weights[:, None], 0) / total, mask=dv < VDIM)


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
                           partition: int = 256, tile: int = 32) -> torch.Tensor:
    """Attention outputs, float32 ``[seqs, m, heads, value_dim]``, of ``q`` ``[seqs, m, heads, dim]``
    (in the keys' compute dtype) over one layer's ``keys`` ``[blocks, kv_heads, block_size, dim]``
    and ``values`` (``value_dim``): sequence ``s`` reads blocks ``table[s, :]`` and its row ``r``
    sees its first ``lengths[s, r]`` positions (the last ``window`` of them where there is a
    window). ``partition`` (positions per program, at least) and ``tile`` (per iteration) are
    powers of two of at least 16."""
    seqs, m, heads, dim = q.shape
    _, kv, block, _ = keys.shape
    vdim, groups = values.shape[-1], heads // kv
    if q.stride(-1) != 1:
        q = q.contiguous()
    longest = table.shape[1] * block
    partition = max(partition, triton.next_power_of_2(-(-longest // MAX_PARTS)))
    parts = max(1, -(-longest // partition))
    dims = dict(DIM=dim, DIM_P=max(16, triton.next_power_of_2(dim)), VDIM=vdim, VDIM_P=max(16, triton.next_power_of_2(vdim)))
    part_max = torch.empty(seqs, m, heads, parts, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_out = torch.empty(seqs, m, heads, parts, vdim, dtype=torch.float32, device=q.device)
    _partition[(seqs, kv, parts)](
        q, keys, values, table, lengths, part_max, part_sum, part_out,
        scale, softcap or 0.0, window or 0,
        q.stride(0), q.stride(1), q.stride(2), *keys.stride()[:3], *values.stride()[:3], table.stride(0), *lengths.stride(),
        M=m, GROUPS=groups, ROWS=max(16, triton.next_power_of_2(m * groups)), HEADS=heads, PARTS=parts, BLOCK=block,
        TILE=tile, PARTITION=partition, WINDOWED=window is not None, CAPPED=softcap is not None, **dims)
    out = torch.empty(seqs, m, heads, vdim, dtype=torch.float32, device=q.device)
    _combine[(seqs * m * heads,)](part_max, part_sum, part_out, out, PARTS=parts,
                                  PARTS_P=triton.next_power_of_2(parts), VDIM=vdim, VDIM_P=dims["VDIM_P"])
    return out
