"""The CPU's paged decode-attention kernel (runner/engine/kernels/cpu_attention.c) against attention
written out in float64 (the GPU kernel's cases: ragged lengths, shuffled block tables, GQA and MQA,
windows, soft-caps, verify rows; every slot no sequence holds is NaN), in each float cache dtype,
and the engine running it against transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from helpers.paged_attention_cases import CASES, make_inputs, reference
from runner.engine.kernels import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(torch.float32), reason="no C compiler built the CPU kernel")
CHECK_CASES = {"test_the_kernel_computes_attention_over_the_blocks_where_they_lie[window-softcap-odd-block-bfloat16]",
               "test_the_engine_runs_the_kernel_and_gives_transformers_tokens[mistral]"}
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_computes_attention_over_the_blocks_where_they_lie(dtype, case):
    *_, window, softcap, _, _ = CASES[case]
    q, keys, values, table, lengths = make_inputs(CASES[case], dtype, "cpu")
    scale = q.shape[-1] ** -0.5
    ours = cpu_attention.paged_decode_attention(q, keys, values, table, lengths, scale, window, softcap)
    assert ours.dtype == torch.float32 and ours.shape == (*q.shape[:3], values.shape[-1])
    expected = reference(q, keys, values, table, lengths, scale, window, softcap)
    torch.testing.assert_close(ours.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_layer_of_the_pool_is_read_through_its_strides():
    """The engine passes one layer of the pool's [layers, blocks, kv, block, dim] store: a view
    whose block stride spans every KV head, not a tensor of its own."""
    q, keys, values, table, lengths = make_inputs(CASES["gqa"], "bfloat16", "cpu")
    pool_k = torch.full((3, *keys.shape), float("nan"), dtype=keys.dtype)
    pool_v = torch.full((3, *values.shape), float("nan"), dtype=values.dtype)
    pool_k[1], pool_v[1] = keys, values
    scale = q.shape[-1] ** -0.5
    ours = cpu_attention.paged_decode_attention(q, pool_k[1], pool_v[1], table, lengths, scale)
    torch.testing.assert_close(ours, cpu_attention.paged_decode_attention(q, keys, values, table, lengths, scale))


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_the_engine_runs_the_kernel_and_gives_transformers_tokens(tmp_path, monkeypatch, arch):
    """On a CPU with a float cache the engine's decode attention is the C kernel (the torch path
    is made to fail here to prove it), and greedy tokens stay transformers', with a sliding
    window, Gemma 2's soft-caps, and a draft's verify rows."""
    from helpers.engine import prompts_from_text, random_model, transformers_greedy
    from runner import LLM, SamplingParams
    from runner.engine.model import DecoderModel

    def torch_path(*args, **kwargs):
        raise AssertionError("the torch decode attention ran")

    path = random_model(tmp_path / arch, arch, sliding_window=24)
    prompts = prompts_from_text([40, 3, 17])
    llm = LLM(path, dtype="fp32", kv_memory=2**22, block_size=16, max_model_len=64, max_num_seqs=3,
              speculative=f"draft={path},k=2")  # blocks of 16: a sequence spans several
    monkeypatch.setattr(DecoderModel, "_gathered_attention", torch_path)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == transformers_greedy(path, prompts, 8)
    assert llm.engine.spec_accepted > 0
