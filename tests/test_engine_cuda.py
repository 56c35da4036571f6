"""The engine on a CUDA device, where one is present: int4 and int8 variants run on the Triton
kernel of runner/engine/cuda_linear.py (not a dequantized copy) and compute what their dequantized
weights compute; a seeded sampled request draws the same tokens on the GPU as on the CPU; decode
steps replay CUDA graphs and give the tokens of eager steps; float caches are read by the fused
paged-attention kernel. The rest of the engine's tests (test_engine.py, test_engine_quantized.py,
test_speculative.py, test_server.py, test_paged_attention.py) run on CUDA unchanged on such a
machine: the engine picks the device itself, and there captures graphs and runs the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner import LLM, SamplingParams
from helpers.engine import prompts_from_text
from helpers.engine import VARIANTS, variants  # noqa: F401  (the module's variant folders, a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

INT4 = [name for name, (_, _, kind) in VARIANTS.items() if kind == "int4"]
INT8 = [name for name, (_, _, kind) in VARIANTS.items() if kind == "int8"]


def _linears(llm):
    return [linear for layer in llm.engine.model.layers for m in ("qkv", "o", "gate_up", "down") for linear in layer[m]]


def _llm(path, dtype="bf16"):
    return LLM(path, dtype=dtype, kv_memory=16 * 2**20)


@pytest.mark.parametrize("name", INT4 + INT8)
def test_low_bit_variants_run_on_the_triton_kernel_that_computes_the_dequantized_product(variants, name):  # noqa: F811
    from formats.quantized_checkpoint import QuantizedCheckpoint

    export = VARIANTS[name][1][-1]
    llm = _llm(variants / name / export)
    assert llm.engine.device.type == "cuda"
    assert {linear.kind.split(" (")[0] for linear in _linears(llm)} == {f"{VARIANTS[name][2]} triton"}
    assert all(linear.packed.codes.is_cuda for linear in _linears(llm))
    # layer 0's down projection against the product of its dequantized weights, both in bf16
    dense = QuantizedCheckpoint.open(variants / name / export).payload("model.layers.0.mlp.down_proj.weight")
    dense = dense.dequantize().to("cuda", torch.bfloat16)
    x = torch.randn(5, dense.shape[1], generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    ours, expected = llm.engine.model.layers[0]["down"][0](x).float(), F.linear(x, dense).float()
    assert (ours - expected).norm() / expected.norm() < 2e-2


@pytest.mark.parametrize("name", INT4 + INT8)
def test_the_low_bit_kernel_strays_from_fp32_no_further_than_bf16_itself(variants, name):  # noqa: F811
    """bf16 rounds the kernel's products differently from a dense product's, so greedy tokens may
    part at a near tie; before they part the distributions must agree. Measured at each prompt's
    first next token (prefill through the kernel): the log-probabilities of fp32's 20 likeliest
    tokens, the kernel's distance from the fp32 dense run against dense bf16's own."""
    prompts = prompts_from_text()[:8]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)

    def first(path, dtype):
        return [o.top_logprobs[0] for o in _llm(path, dtype).generate(prompts, params)]

    dense = variants / name / "safetensors"
    exact, dense_bf16, kernel = first(dense, "fp32"), first(dense, "bf16"), first(variants / name / VARIANTS[name][1][-1], "bf16")

    def distance(run):
        gaps = [abs(run[i][t] - exact[i][t]) for i in range(len(prompts)) for t in exact[i] if t in run[i]]
        assert len(gaps) >= 0.8 * 20 * len(prompts)  # the likeliest tokens stay among the likeliest
        return sum(gaps) / len(gaps)

    assert distance(kernel) <= 3 * distance(dense_bf16) + 0.01


def test_a_seeded_request_draws_on_cuda_what_it_draws_on_the_cpu(monkeypatch):
    """The requests' generators live on the CPU, whatever device scores: in fp32 the two devices'
    distributions agree to rounding, so a seed gives the same tokens on both."""
    from conftest import TINY

    prompts = prompts_from_text()[:4]
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=seed) for seed in range(4)]
    on_cuda = [o.token_ids for o in _llm(TINY, "fp32").generate(prompts, params)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    llm = _llm(TINY, "fp32")
    assert llm.engine.device.type == "cpu"
    assert [o.token_ids for o in llm.generate(prompts, params)] == on_cuda


@pytest.mark.parametrize("cache", ["fp32", "fp8"])
def test_decode_steps_replay_cuda_graphs_and_give_the_eager_tokens(cache):
    """A graph per bucket is captured at start; every decode-only step replays one (prefill and
    mixed steps run eagerly), and greedy tokens are those of the same engine with enforce_eager,
    for outputs of different lengths (ragged, padded batches)."""
    from conftest import TINY
    from runner.engine.cuda_graphs import CudaGraphs
    from runner.engine.static_decode import buckets

    prompts = prompts_from_text()
    params = [SamplingParams(max_tokens=8 + i % 9, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    options = dict(dtype="fp32", kv_cache_dtype=cache, kv_memory=16 * 2**20, max_model_len=256, max_num_seqs=12)
    eager = LLM(TINY, enforce_eager=True, **options)
    assert eager.engine.decoder is None
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    llm = LLM(TINY, **options)
    graphs = llm.engine.decoder
    assert isinstance(graphs, CudaGraphs) and sorted(graphs.graphs) == buckets(12) == [1, 2, 4, 8, 12]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert graphs.replays > 10
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_the_fused_kernel_reads_float_caches_on_cuda_and_quantized_ones_stay_on_torch():
    from conftest import TINY
    from runner.engine.model import _fused_kernel

    for cache, fused in (("bf16", True), ("fp8", True), ("int8", False), ("int4", False)):
        llm = LLM(TINY, dtype="bf16", kv_cache_dtype=cache, kv_memory=16 * 2**20, max_model_len=256)
        assert (_fused_kernel(llm.engine.pool) is not None) == fused
        assert (llm.engine.decoder is not None) == fused  # graphs where the kernel runs: a q8_0/q4_0 cache encodes on the CPU
