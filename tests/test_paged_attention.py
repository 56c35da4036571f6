"""The fused paged decode-attention kernel (runner/engine/kernels/paged_attention.py) against attention
written out in float64, sequence by sequence: ragged lengths, block tables in shuffled order, GQA
and MQA, sliding windows, soft-caps, speculative verify rows, several partitions per sequence.
Off the GPU it runs in Triton's interpreter; on CUDA, compiled, in bf16 and fp8 too. Every pool
slot no sequence holds is NaN, so a read outside a sequence's keys would show in its output."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
CHECK_CASES = {"test_the_kernel_computes_attention_over_the_blocks_where_they_lie[window-softcap-odd-block-float32]"}
DEVICE = "cuda" if CUDA else "cpu"  # off the GPU, the interpreter (tests/conftest.py switches it on)


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


# the interpreter reads bf16 wrongly (and knows no fp8): those run on a GPU only
DTYPES = ["float32", "float16"] + [pytest.param(d, marks=pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine"))
                                   for d in ("bfloat16", "fp8")]
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2, "fp8": 3e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_computes_attention_over_the_blocks_where_they_lie(dtype, case):
    from runner.engine.kernels.paged_attention import paged_decode_attention

    assert CUDA or os.environ.get("TRITON_INTERPRET") == "1"
    *_, window, softcap, partition, tile = CASES[case]
    inputs = make_inputs(CASES[case], dtype, DEVICE)
    scale = inputs[0].shape[-1] ** -0.5
    ours = paged_decode_attention(*inputs, scale, window, softcap, partition=partition, tile=tile)
    assert ours.dtype == torch.float32 and ours.shape == (*inputs[0].shape[:3], inputs[2].shape[-1])
    expected = reference(*inputs, scale, window, softcap)
    torch.testing.assert_close(ours.cpu().double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_wide_table_gets_longer_partitions_not_more(monkeypatch):
    """Past MAX_PARTS partitions (a table padded to a long max_model_len), each partition grows."""
    from runner.engine.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "MAX_PARTS", 2)
    inputs = make_inputs(CASES["gqa"], "float32", DEVICE)
    ours = paged_attention.paged_decode_attention(*inputs, 0.25, None, None, partition=16, tile=16)
    torch.testing.assert_close(ours.cpu().double(), reference(*inputs, 0.25, None, None), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(CUDA, reason="on a GPU the engine's own tests run the compiled kernel")
@pytest.mark.parametrize("static", [False, True])
def test_the_engine_with_the_kernel_gives_transformers_tokens(tmp_path, monkeypatch, static):
    """The model's glue (query views, GQA heads, tables, lengths, windows, verify rows) around the
    kernel, checked on the CPU: the engine runs the interpreted kernel in place of torch's decode
    attention, eagerly on the normal layout (verifying the guesses of a draft: rows m > 1) or on the
    static decode buffers that CUDA graphs replay, and greedy tokens stay transformers'."""
    from helpers.engine import prompts_from_text, random_model, transformers_greedy
    from runner import LLM, SamplingParams
    from runner.engine import model
    from runner.engine.kernels.paged_attention import paged_decode_attention

    path = random_model(tmp_path / "mistral", "mistral", sliding_window=24)
    prompts = prompts_from_text([40, 3, 17])
    monkeypatch.setattr(model, "_fused_kernel", lambda pool: paged_decode_attention)
    llm = LLM(path, dtype="fp32", kv_memory=2**20, max_model_len=64, max_num_seqs=3, speculative=None if static else f"draft={path},k=2")
    if static:
        llm.engine.decoder = llm.engine.static_decode()
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == transformers_greedy(path, prompts, 8)
    assert static or llm.engine.spec_accepted > 0
