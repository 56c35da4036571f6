import numpy as np
import pytest
import torch

from core.errors import InputError
from core.file_types import tensor_types
from quant.ggml import encode

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)


def test_float_and_q8_0_files_keep_norms_in_f32():
    from formats.architecture import from_config

    config = from_config({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "hidden_size": 256}, "config")
    tensors = [
        ("model.embed_tokens.weight", (8192, 256)),
        ("model.layers.0.input_layernorm.weight", (256,)),
        ("model.layers.0.self_attn.q_proj.weight", (256, 256)),
        ("model.layers.0.mlp.down_proj.weight", (256, 40)),  # rows that do not split into blocks of 32
        ("model.norm.weight", (256,)),
    ]
    assert list(tensor_types("Q8_0", tensors, config).values()) == ["Q8_0", "F32", "Q8_0", "F16", "F32"]
    assert list(tensor_types("F16", tensors, config).values()) == ["F16", "F32", "F16", "F16", "F32"]
    assert list(tensor_types("F32", tensors, config).values()) == ["F32"] * 5


def test_q8_0_blocks_hold_each_value_within_half_a_step():
    w = torch.randn(16, 256) * 0.05
    enc = encode(w, "Q8_0")
    assert enc.raw.dtype == np.uint8 and enc.raw.shape == (16, 256 // 32 * 34)
    assert enc.bits_per_weight == 8.5
    blocks = enc.raw.reshape(16, 8, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [16, 8, 1]
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    deq = torch.from_numpy((d * q).reshape(16, 256))
    torch.testing.assert_close(enc.dequantize(), deq, rtol=0, atol=0)  # gguf's decoder agrees
    step = torch.from_numpy(np.repeat(d[..., 0], 32, axis=1))
    # ggml rounds d to fp16 after choosing the codes: up to 127 * 2**-11 of a step more than half.
    assert bool(((deq - w).abs() <= (0.5 + 127 * 2**-11) * step).all())


def test_f16_is_plain_half_precision():
    w = torch.randn(4, 64)
    enc = encode(w, "F16")
    assert enc.raw.dtype == np.float16
    torch.testing.assert_close(enc.dequantize(), w.half().float(), rtol=0, atol=0)


def test_non_finite_weights_are_refused_by_name():
    w = torch.zeros(4, 64)
    w[0, 0] = float("inf")
    with pytest.raises(InputError, match="blk.3: weights contain NaN or Inf"):
        encode(w, "Q8_0", "blk.3")


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K", "Q5_0"])
def test_tensors_split_across_worker_processes_encode_as_one_block(ggml_type, monkeypatch):
    """Large tensors are encoded in row blocks by worker processes; the bytes must not depend on
    where the rows are cut (odd row count, so the blocks differ in size)."""
    from quant.ggml import type_named, workers

    encoder = type_named(ggml_type).quantize
    w = torch.randn(301, 512) * 0.02
    imatrix = np.random.default_rng(0).random(512).astype(np.float32) + 0.1
    monkeypatch.setattr(workers, "_cores", lambda: 3)
    monkeypatch.setattr(workers, "_MIN_VALUES_PER_WORKER", 512 * 50)  # three parts of ~100 rows
    split = encode(w, ggml_type, imatrix=imatrix).raw
    assert split.tobytes() == encoder(w.numpy(), imatrix).tobytes()
