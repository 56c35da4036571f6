"""Paged decode attention's test cases, shared by the GPU kernel's tests (test_paged_attention.py)
and the CPU kernel's (test_cpu_attention.py): pools whose blocks sequences own in shuffled order,
every slot no sequence holds NaN (a read outside a sequence's keys shows in its output), and
attention written out in float64, sequence by sequence."""

from __future__ import annotations

import torch

# heads, kv heads, head dim, value dim, block size, query rows, window, soft-cap, partition, tile
CASES = {
    "gqa": (4, 2, 16, 16, 16, 1, None, None, 32, 16),
    "window-softcap-odd-block": (8, 2, 48, 48, 7, 1, 24, 20.0, 32, 16),
    "verify-rows-window-wide-block": (4, 4, 32, 16, 64, 3, 24, None, 64, 32),
    "mqa-verify-softcap": (8, 1, 64, 64, 16, 2, None, 30.0, 256, 32),
}
LENGTHS = [1, 17, 40, 5, 64, 33]  # of each sequence's last query row


def make_inputs(case, dtype, device):
    heads, kv, dim, vdim, bs, m, *_ = case
    g = torch.Generator().manual_seed(0)
    needs = [-(-n // bs) for n in LENGTHS]
    num_blocks = sum(needs) + 3
    order = torch.randperm(num_blocks, generator=g)  # sequences own scattered blocks
    width = max(needs) + 1  # one column more than any sequence needs, as a padded table has
    table = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    keys = torch.full((num_blocks, kv, bs, dim), float("nan"))
    values = torch.full((num_blocks, kv, bs, vdim), float("nan"))
    taken = 0
    for s, (n, need) in enumerate(zip(LENGTHS, needs)):
        table[s, :need] = order[taken : taken + need]
        taken += need
        for p in range(n):
            keys[table[s, p // bs], :, p % bs] = torch.randn(kv, dim, generator=g)
            values[table[s, p // bs], :, p % bs] = torch.randn(kv, vdim, generator=g)
    q = torch.randn(len(LENGTHS), m, heads, dim, generator=g) * 2
    lengths = torch.tensor(LENGTHS)[:, None] - torch.arange(m - 1, -1, -1)[None, :]  # row r sees its own key, causal
    lengths = lengths.clamp_min(1)
    cache = torch.float8_e4m3fn if dtype == "fp8" else getattr(torch, dtype)
    compute = torch.bfloat16 if dtype == "fp8" else cache
    return (q.to(device, compute), keys.to(device, cache), values.to(device, cache), table.to(device), lengths.to(device))


def reference(q, keys, values, table, lengths, scale, window, softcap):
    seqs, m, heads, dim = q.shape
    kv, bs = keys.shape[1], keys.shape[2]
    out = torch.empty(seqs, m, heads, values.shape[-1], dtype=torch.float64)
    for s in range(seqs):
        n = int(lengths[s].max())
        blocks = table[s, : -(-n // bs)].cpu()
        k = keys.cpu()[blocks].double().transpose(0, 1).reshape(kv, -1, dim)[:, :n].repeat_interleave(heads // kv, 0)
        v = values.cpu()[blocks].double().transpose(0, 1).reshape(kv, -1, values.shape[-1])[:, :n].repeat_interleave(heads // kv, 0)
        scores = torch.einsum("rhd,hkd->rhk", q[s].cpu().double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos, last = torch.arange(n), lengths[s].cpu()[:, None, None] - 1
        hidden = pos > last
        if window is not None:
            hidden |= pos <= last - window
        out[s] = torch.einsum("rhk,hkd->rhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)
    return out
