"""Decode-only steps laid out in buffers of fixed shapes, so that a CUDA graph captured once per batch
size replays them (cuda_graphs.py).

A step where every scheduled sequence computes its one last token (no prompt chunk, no
speculative guesses) is padded to a bucket of sequences: 1, 2, 4, 8, then steps of 8 up to 32 and
of 16 beyond, and ``max_num_seqs`` itself (vLLM's and nano-vllm's sizes). The forward reads views
of one packed buffer, ``[bucket, 4 + max_blocks]``: per row the token, its position, its cache
slot, its context length, then its block table padded to the most blocks a sequence of
``max_model_len`` holds. One host-to-device copy fills it each step. A padding row decodes token
0 at position 0 into the pool's scratch block, which no sequence holds, sees that one key, and its
logits are dropped.

Attention reads the padded table: the fused kernel where it runs (CUDA), which reads no further
than each sequence's length; else torch's block-by-block attention over every column of the
table, the columns past a sequence's length masked. On a CPU that is slower than the normal
layout, and runs only where a test asks for it: it shows the path computes the normal path's tokens.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np
import torch

from runner.engine.kernels import fused_decode
from runner.engine.kv_cache import KVPool
from runner.engine.model import DecodeBatch, DecoderModel, Step
from runner.engine.sequence import Sequence


def buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes a decode step is padded to, the largest ``max_num_seqs``."""
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, max_num_seqs, 16))
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


class StaticDecode:
    def __init__(self, model: DecoderModel, pool: KVPool, max_num_seqs: int, max_blocks: int, scratch_block: int):
        self.model, self.pool, self.scratch_block = model, pool, scratch_block
        self.buckets = buckets(max_num_seqs)
        size, device = self.buckets[-1], pool.device
        self.packed = torch.zeros(size, 4 + max_blocks, dtype=torch.long, device=device)
        self.rows = torch.arange(size, device=device)
        self.fused = fused_decode(device, pool.cache)
        if not self.fused:  # torch's attention reads every column of every row, as blocks
            self.owner = self.rows.repeat_interleave(max_blocks)
            self.first = (torch.arange(max_blocks, device=device) * pool.block_size).repeat(size)
        self.fill([], size)

    def bucket(self, sequences: int) -> int:
        return self.buckets[bisect_left(self.buckets, sequences)]

    def fill(self, seqs: list[Sequence], bucket: int) -> None:
        """Write the step of ``seqs`` (each decoding its last token) into the first ``bucket`` rows,
        padding after them. Only the table columns some sequence uses are copied: the kernel reads
        none beyond a sequence's length, and those left from earlier steps name blocks of the pool,
        which torch's masked attention weighs 0."""
        bs, width = self.pool.block_size, max([len(s.block_table) for s in seqs], default=1)
        host = np.empty((bucket, 4 + width), dtype=np.int64)
        host[:] = (0, 0, self.scratch_block * bs, 1) + (self.scratch_block,) * width
        for row, seq in enumerate(seqs):
            p, table = seq.num_computed, seq.block_table
            host[row, :4] = seq.tokens(p, p + 1)[0], p, table[p // bs] * bs + p % bs, p + 1
            host[row, 4 : 4 + len(table)] = table
        self.packed[:bucket, : 4 + width].copy_(torch.from_numpy(host))

    def step(self, bucket: int) -> Step:
        """The step over the buffers' first ``bucket`` rows, as views: a graph captured on it reads
        whatever the next ``fill`` writes."""
        packed, blocks = self.packed[:bucket], bucket * (self.packed.shape[1] - 4)
        table = packed[:, 4:]
        ids, owner, first = (None, None, None) if self.fused else (table.reshape(-1), self.owner[:blocks], self.first[:blocks])
        decode = DecodeBatch(rows=self.rows[:bucket, None], valid=None, ids=ids, owner=owner, first=first,
                             length=packed[:, 3:4], table=table)
        return Step(packed[:, 0], packed[:, 1], packed[:, 2], decode, None, self.rows[:bucket])

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Next-token logits of ``seqs`` (each decoding its last token), computed eagerly."""
        bucket = self.bucket(len(seqs))
        self.fill(seqs, bucket)
        return self.model.forward(self.step(bucket), self.pool)[: len(seqs)]
