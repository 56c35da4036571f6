"""A step's flat batch, laid out for the model: every scheduled token's id, position and cache
slot, the decode and prefill attention batches, and the rows whose logits are sampled.

A sequence verifying draft tokens (speculative decoding) runs them after its own last token, and
has every one of those rows sampled: the target's next-token distribution after each. A sequence
that asks for its prompt's log-probabilities has its prompt rows' logits computed too, after every
sampled row, so the sampled rows keep their places. Chunks of up
to ``decode_rows`` tokens (one; with speculation, a verify step's last token and guesses) attend as
decode rows, by blocks as a decode token does; longer ones (prompts) as prefill chunks.
"""

from __future__ import annotations

import torch

from runner.engine.model import DecodeBatch, PrefillBatch, Step
from runner.engine.sequence import Sequence


def layout(scheduled: list[tuple[Sequence, int]], bs: int, dev: torch.device, decode_rows: int = 1,
           score_prompts: bool = False) -> tuple[Step, list[Sequence], list[tuple[Sequence, range]]]:
    """``scheduled``: (sequence, tokens to compute, its draft tokens included); returns the step,
    the sequences sampled in it (those whose computed tokens reach their end) in row order, and
    with ``score_prompts`` the prompt positions whose logits follow the sampled rows', per sequence."""
    tokens, positions, owners, tables = [], [], [], []
    sample_rows, sampled, prompt_rows, scored = [], [], [], []
    decode, prefill = [], []
    for i, (seq, n) in enumerate(scheduled):
        start, drafts = len(tokens), seq.draft_ids
        own = n - len(drafts)
        tokens += seq.tokens(seq.num_computed, seq.num_computed + own) + drafts
        positions += range(seq.num_computed, seq.num_computed + n)
        owners += [i] * n
        tables.append(seq.block_table)
        if n <= decode_rows:
            decode.append((i, start, seq.num_computed + n, n))
        else:
            prefill.append((i, start, seq.num_computed + n))
        if seq.num_computed + own == seq.num_tokens:
            sample_rows += range(len(tokens) - 1 - len(drafts), len(tokens))
            sampled.append(seq)
        wanted = seq.prompt_rows if score_prompts else range(0)
        here = range(max(wanted.start, seq.num_computed), min(wanted.stop, seq.num_computed + own))
        if here:
            prompt_rows += range(start + here.start - seq.num_computed, start + here.stop - seq.num_computed)
            scored.append((seq, here))
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
    pos = torch.tensor(positions, dtype=torch.long, device=dev)
    owner = torch.tensor(owners, dtype=torch.long, device=dev)
    slots = table[owner, pos // bs] * bs + pos % bs
    step = Step(torch.tensor(tokens, dtype=torch.long, device=dev), pos, slots,
                _decode_batch(decode, table, bs, dev), _prefill_batch(prefill, scheduled, table, bs, dev),
                torch.tensor(sample_rows + prompt_rows, dtype=torch.long, device=dev))
    return step, sampled, scored


def _decode_batch(decode: list[tuple[int, int, int, int]], table: torch.Tensor, bs: int, dev) -> DecodeBatch | None:
    """The blocks every decoding sequence reads (all of its table up to its length), and its rows,
    as many per sequence as the most any has (a sequence with fewer repeats its last)."""
    if not decode:
        return None
    seq_index, start, end, n = torch.tensor(decode, dtype=torch.long, device=dev).T
    m = max(d[3] for d in decode)
    offsets = torch.minimum(torch.arange(m, device=dev)[None, :], n[:, None] - 1)
    counts = -(-end // bs)
    owner = torch.repeat_interleave(torch.arange(len(decode), device=dev), counts)
    within = torch.arange(owner.numel(), device=dev) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    padded = any(d[3] < m for d in decode)
    return DecodeBatch(rows=start[:, None] + offsets, valid=torch.arange(m, device=dev) < n[:, None] if padded else None,
                       ids=table[seq_index[owner], within], owner=owner, first=within * bs,
                       length=(end - n)[:, None] + offsets + 1, table=table[seq_index])


def _prefill_batch(prefill: list[tuple[int, int, int]], scheduled, table: torch.Tensor, bs: int, dev) -> PrefillBatch | None:
    """The chunks, one row each, padded to the longest chunk and the longest key list."""
    if not prefill:
        return None
    chunks = [scheduled[i][1] for i, _, _ in prefill]
    width, keys = max(chunks), max(end for _, _, end in prefill)
    offsets = torch.arange(width)
    start = torch.tensor([s for _, s, _ in prefill])[:, None]
    n = torch.tensor(chunks)[:, None]
    end = torch.tensor([e for _, _, e in prefill])[:, None]
    valid = offsets[None, :] < n
    query_pos = end - n + offsets[None, :]
    key_pos = torch.arange(keys)[None, :].expand(len(prefill), keys)
    owners = torch.tensor([i for i, _, _ in prefill], device=dev)
    rows = torch.where(valid, start + offsets, 0).to(dev)
    key_slots = table[owners[:, None], (key_pos // bs).to(dev)] * bs + (key_pos % bs).to(dev)
    key_slots = torch.where((key_pos < end).to(dev), key_slots, 0)
    return PrefillBatch(rows=rows, key_slots=key_slots, query_pos=query_pos.to(dev), key_pos=key_pos.to(dev),
                        valid=valid.to(dev))
