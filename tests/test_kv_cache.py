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


def _rows_with_edges() -> torch.Tensor:
    """Random rows at many magnitudes, and blocks built on the encoders' edges: all zeros, halves
    that round away from zero (q8_0 with d = 1), equal magnitudes of both signs (q4_0 takes the
    first), a level past 15, values whose scale is subnormal or beyond fp16."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(256, 128, generator=g) * torch.logspace(-6, 4, 256)[:, None]
    edges = torch.zeros(8, 128)
    edges[1, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 126.5, -126.5, 1.5] * 4)
    edges[2, :32] = torch.tensor([-8.0, 8.0, 0.5, -0.5, 7.5, -7.5, 3.5, -4.5] * 4)
    edges[3, :32] = torch.tensor([8.0, -8.0, 0.5, -0.5, 7.5, -7.5, 3.5, -4.5] * 4)
    edges[4] = torch.randn(128, generator=g) * 1e-30
    edges[5] = torch.randn(128, generator=g) * 1e8
    edges[6, ::2] = -0.0
    edges[7, 32:64] = torch.arange(32) - 16.0
    return torch.cat([rows, edges])


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0"])
def test_the_engines_torch_blocks_are_the_ggml_encoders_bytes(ggml_type, device):
    """The engine's cache encodes on its own device (quant/ggml/device_blocks.py); its blocks are
    quant.ggml.encode's (what the recipe's simulation quantizes with) byte for byte, and decode to its values."""
    from quant.ggml import encode
    from quant.ggml.device_blocks import decode_q4_0, decode_q8_0, encode_q4_0, encode_q8_0

    rows = _rows_with_edges()
    with np.errstate(over="ignore", invalid="ignore"):  # the scales beyond fp16: inf, and inf * 0 decodes to NaN
        reference = encode(rows, ggml_type, "KV cache")
        expected = reference.dequantize()
    encoder, decoder = {"Q8_0": (encode_q8_0, decode_q8_0), "Q4_0": (encode_q4_0, decode_q4_0)}[ggml_type]
    codes, scales = encoder(rows.to(device))
    assert codes.device.type == scales.device.type == device
    ours = torch.cat([scales.cpu()[..., None].view(torch.uint8), codes.cpu().view(torch.uint8).unflatten(-1, (4, -1))], -1)
    assert np.array_equal(ours.flatten(1).numpy(), reference.raw.reshape(len(rows), -1))
    torch.testing.assert_close(decoder(codes, scales).cpu(), expected, rtol=0, atol=0, equal_nan=True)
