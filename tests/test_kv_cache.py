"""KV-cache quantization as the evaluation simulates it: llama.cpp's q8_0/q4_0 cache blocks (checked
against gguf-py's own encoder and decoder) and vLLM's unscaled fp8 cache, applied to one model's
attention only."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from conftest import TINY
from quant.kv_cache import KVCacheSpec, fake_quantize_kv, simulated_kv_cache

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)


@pytest.mark.parametrize("fmt, ggml_type", [("int8", GGMLQuantizationType.Q8_0), ("int4", GGMLQuantizationType.Q4_0)])
def test_integer_caches_are_llama_cpp_blocks_of_32(fmt, ggml_type):
    keys = torch.randn(2, 4, 37, 64, generator=torch.Generator().manual_seed(0)) * 3  # [batch, kv heads, tokens, head dim]
    rows = keys.reshape(-1, 64).numpy()
    expected = dequantize(quantize(rows, ggml_type), ggml_type).reshape(keys.shape)
    assert np.array_equal(fake_quantize_kv(keys, KVCacheSpec(fmt)).numpy(), expected)


def test_fp8_cache_saturates_without_scales():
    values = torch.tensor([0.1, 1.0, 3.3, 447.0, 1000.0, -5000.0])
    out = fake_quantize_kv(values, KVCacheSpec("fp8"))
    assert out.tolist() == [0.1015625, 1.0, 3.25, 448.0, 448.0, -448.0]  # e4m3: 3 mantissa bits, ±448 at most


def test_only_the_wrapped_model_reads_a_quantized_cache():
    from transformers import AutoModelForCausalLM

    quantized, plain = (AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval() for _ in range(2))
    ids = torch.arange(64)[None] * 37 % 8000
    with torch.no_grad():
        before = quantized(ids).logits
        with simulated_kv_cache(quantized, KVCacheSpec("int4")):
            inside = quantized(ids).logits
            other = plain(ids).logits
        after = quantized(ids).logits
    assert (inside - before).abs().max() > 1e-2  # 4-bit keys and values move the logits
    assert torch.equal(other, before) and torch.equal(after, before)  # the other model, and afterwards: untouched


def test_llama_cpp_rotates_quantized_caches_by_hadamard_blocks():
    from quant.kv_cache import hadamard, rotations

    h = hadamard(64)
    torch.testing.assert_close(h @ h, torch.eye(64), rtol=0, atol=1e-6)  # orthonormal and symmetric: its own inverse
    assert set(torch.unique(h * 8).tolist()) == {-1.0, 1.0}
    # keys: the largest power of two dividing the head size; values: 64; none below 64 or for fp8
    assert rotations(KVCacheSpec("int4"), 128) == (128, 64)
    assert rotations(KVCacheSpec("int8"), 192) == (64, 64)
    assert rotations(KVCacheSpec("int4"), 96) == (None, None)
    assert rotations(KVCacheSpec("fp8"), 128) == (None, None)
    # a rotated cache quantizes H·x and hands back H·deq(q(H·x)): an outlier channel no longer
    # takes a whole block's range, so the error is smaller
    keys = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    keys[:, 3] *= 30
    plain = (fake_quantize_kv(keys, KVCacheSpec("int4")) - keys).square().mean()
    rotated = (fake_quantize_kv(keys, KVCacheSpec("int4"), rotation=64) - keys).square().mean()
    assert rotated < 0.5 * plain


def test_llama_cpp_keeps_rotary_pairs_of_llama_heads_side_by_side():
    from formats.architecture import from_config
    from core.rope import pairs_side_by_side

    def interleaves_rope_pairs(config: dict) -> bool:
        return from_config(config, "config").rope_pairs_adjacent_in_gguf

    assert pairs_side_by_side(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # the order our GGUF converter permutes q/k rows into
    assert interleaves_rope_pairs({"model_type": "llama"}) and interleaves_rope_pairs({"model_type": "mistral"})
    assert not interleaves_rope_pairs({"model_type": "qwen2"})  # NEOX rope: llama.cpp keeps transformers' order
