"""The fused paged decode-attention kernel (runner/engine/kernels/paged_attention.py) against attention
written out in float64, sequence by sequence: ragged lengths, block tables in shuffled order, GQA
and MQA, sliding windows, soft-caps, speculative verify rows, several partitions per sequence.
Off the GPU it runs in Triton's interpreter; on CUDA, compiled, in bf16 and fp8 too. Every pool
slot no sequence holds is NaN, so a read outside a sequence's keys would show in its output."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.paged_attention_cases import CASES, make_inputs, reference

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
CHECK_CASES = {"test_the_kernel_computes_attention_over_the_blocks_where_they_lie[window-softcap-odd-block-float32]"}
DEVICE = "cuda" if CUDA else "cpu"  # off the GPU, the interpreter (tests/conftest.py switches it on)


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
