"""Q4_0, Q4_1, Q5_0, Q5_1 with an importance matrix: byte-exact against llama.cpp's own quantizer.

These types are what K-quant files fall back to when a row is not a multiple of 256, so a
byte-exact file with an imatrix needs them exact too. Without an imatrix we rely on
``gguf.quants.quantize``, and a test here pins that down as well. The oracle tests need
llama-cpp-python's libggml-base; the others only need gguf's decoder.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors import safe_open

import quant.ggml.legacy as legacy
from conftest import TINY
from helpers.ggml_cases import assert_same_blocks, random_imatrix, seeded_case, unusual_imatrix, weighted_column_errors
from helpers.ggml_oracle import available, ggml_quantize

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)

ENCODERS = {
    "Q4_0": legacy.Q4_0.quantize,
    "Q4_1": legacy.Q4_1.quantize,
    "Q5_0": legacy.Q5_0.quantize,
    "Q5_1": legacy.Q5_1.quantize,
}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}
needs_oracle = pytest.mark.skipif(not available(), reason="llama-cpp-python's libggml-base is not installed")

ROWS, COLS = 24, 576  # 432 blocks per synthetic case; 576 is a hidden size that needs these types


def _gauss(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((ROWS, COLS)) * 0.02


def _heavy(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_t(3, (ROWS, COLS)) * 0.02
    x[rng.random((ROWS, COLS)) < 0.005] *= 30
    return x


def _zero_and_constant(rng: np.random.Generator) -> np.ndarray:
    """Whole rows of 0, −0, one positive or one negative value; rows with zeroed and −0 blocks,
    and rows of zeros alternating in sign (starting with +0 or with −0).

    A flat Q4_1/Q5_1 block stores its minimum as the offset (ggml keeps the first of equal
    values, ``np.min`` may not), and an all-zero Q4_0/Q5_0 block stores scale 0, so the sign of a
    zero reaches the fp16 bytes.
    """
    x = _gauss(rng)
    x[0:4] = 0
    x[4:6] = -0.0
    x[6:10] = 0.37
    x[10:14] = -0.37
    x[14:18].reshape(4, -1, 32)[:, ::2] = 0
    x[18:22].reshape(4, -1, 32)[:, 1::2, 3:20] = -0.0
    x[22:24] = 0
    x[22, 1::2] = -0.0
    x[23, 0::2] = -0.0
    return x


def _all_positive(rng: np.random.Generator) -> np.ndarray:
    return np.abs(_gauss(rng)) + 0.01


def _bf16_exact(rng: np.random.Generator) -> np.ndarray:
    return torch.from_numpy(_heavy(rng).astype(np.float32)).to(torch.bfloat16).float().numpy()


def _tiny(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((ROWS, COLS)) * 1e-8


def _subnormal(rng: np.random.Generator) -> np.ndarray:
    """Q4_1/Q5_1's first inverse scale overflows here; ggml's nearest_int then reads inf/NaN bits."""
    return rng.standard_normal((ROWS, COLS)) * 1e-39


def _real_weights(rng: np.random.Generator) -> np.ndarray:
    with safe_open(TINY / "model.safetensors", "pt") as f:
        return f.get_tensor("model.layers.0.mlp.down_proj.weight").float().numpy()  # [256, 768]


CASES = {
    "gaussian": _gauss,
    "heavy_tailed": _heavy,
    "zero_and_constant": _zero_and_constant,
    "all_positive": _all_positive,
    "bf16_exact": _bf16_exact,
    "tiny": _tiny,
    "subnormal": _subnormal,
    "real_weights": _real_weights,
}


@lru_cache(maxsize=None)
def _data(case: str) -> np.ndarray:
    return seeded_case(CASES, case)


def _offset_at_max() -> tuple[np.ndarray, np.ndarray]:
    """Blocks whose only weighted elements are the max and a value just below it.

    Their two-point fit puts the best offset right at the block's max, so the next search step
    divides by almost nothing and ggml's nearest_int leaves its exact range. This tells apart
    ggml's plain rounding (what the oracle does) from a ``v > 0 ? .. : 0`` guarded one.
    """
    rng = np.random.default_rng(3)
    blocks = COLS // 32
    x = -rng.random((ROWS, blocks, 32))
    top = 10.0 ** rng.uniform(-7, -2, (ROWS, blocks)) * rng.choice([-1.0, 1.0], (ROWS, blocks))
    x[:, :, 5] = top
    x[:, :, 9] = top - 10.0 ** rng.uniform(-9, -3, (ROWS, blocks))
    qw = np.zeros((blocks, 32))
    qw[:, 5] = 1.0
    qw[:, 9] = rng.random(blocks) + 0.1
    return x.reshape(ROWS, COLS).astype(np.float32), qw.reshape(COLS).astype(np.float32)


def _assert_same_blocks(ours: np.ndarray, ggml: np.ndarray, qtype: str) -> None:
    assert_same_blocks(ours, ggml, BLOCK_BYTES[qtype], "blocks")


@needs_oracle
@pytest.mark.parametrize("qtype", list(ENCODERS))
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_match_llama_cpp(case: str, qtype: str) -> None:
    x = _data(case)
    qw = random_imatrix(x.shape[1])
    _assert_same_blocks(ENCODERS[qtype](x, qw), ggml_quantize(x, qtype, qw), qtype)


@needs_oracle
@pytest.mark.parametrize("qtype", list(ENCODERS))
@pytest.mark.parametrize("kind", ["mostly_zero", "all_zero", "wide_range", "uniform"])
def test_unusual_importance_weights_match_llama_cpp(qtype: str, kind: str) -> None:
    """Zero weights leave the searches few points to fit (or none: every candidate is rejected)."""
    x = _data("heavy_tailed")
    qw = unusual_imatrix(kind, COLS)
    _assert_same_blocks(ENCODERS[qtype](x, qw), ggml_quantize(x, qtype, qw), qtype)


@needs_oracle
@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_best_offset_at_the_max_matches_llama_cpp(qtype: str) -> None:
    x, qw = _offset_at_max()
    _assert_same_blocks(ENCODERS[qtype](x, qw), ggml_quantize(x, qtype, qw), qtype)


def _signed_zero_blocks(x: np.ndarray, qtype: str) -> tuple[np.ndarray, int]:
    """The blocks where gguf's reference quantizer may store a zero of the other sign than ggml,
    and the byte (the high byte of an fp16 field) where that shows.

    Q4_0/Q5_0: ggml's scale of an all-zero block is ``0.0f/-8`` (−0); gguf divides the block's
    first element instead, which gives +0 when that is −0.0. Q4_1/Q5_1: ggml stores the first of
    the block's minimal values as the offset, gguf ``np.min``'s choice among +0 and −0.
    """
    blocks = x.reshape(-1, 32)
    zero = blocks == 0
    if qtype in ("Q4_0", "Q5_0"):
        return zero.all(axis=1) & np.signbit(blocks[:, 0]), 1
    negative_zero = zero & np.signbit(blocks)
    mixed = negative_zero.any(axis=1) & (zero & ~negative_zero).any(axis=1)
    return (blocks.min(axis=1) == 0) & mixed, 3


@needs_oracle
@pytest.mark.parametrize("qtype", list(ENCODERS))
@pytest.mark.parametrize(
    "case", ["gaussian", "heavy_tailed", "zero_and_constant", "bf16_exact", "tiny", "real_weights"]
)
def test_gguf_quantize_is_llama_cpp_without_imatrix(case: str, qtype: str) -> None:
    """Without an imatrix ggml runs the reference row quantizers, which gguf reproduces: we rely on it.

    The one exception is the sign of a stored zero in blocks of signed zeros (see
    ``_signed_zero_blocks``); both decode to the same values.
    """
    x = _data(case)
    ours = quantize(x, GGMLQuantizationType[qtype]).reshape(-1, BLOCK_BYTES[qtype])
    ggml = ggml_quantize(x, qtype).reshape(-1, BLOCK_BYTES[qtype])
    blocks, byte = _signed_zero_blocks(x, qtype)
    assert np.isin(ours[blocks, byte] ^ ggml[blocks, byte], (0x00, 0x80)).all()
    ours[blocks, byte] = ggml[blocks, byte]
    _assert_same_blocks(ours, ggml, qtype)


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_bytes_do_not_depend_on_chunking(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row per chunk must give every block its own columns' importance and its row's sigma2."""
    x = _data("real_weights")[:40]
    qw = random_imatrix(x.shape[1])
    whole = ENCODERS[qtype](x, qw)
    monkeypatch.setattr(legacy, "_CHUNK_ELEMENTS", 1)
    np.testing.assert_array_equal(ENCODERS[qtype](x, qw), whole)


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_search_beats_plain_rounding(qtype: str) -> None:
    """Decoded by gguf (an independent reader of the layout), the searched blocks with a flat
    imatrix come out closer to the input than gguf's own absmax/min-max rounding: a wrong packing
    or a broken search would not."""
    x = _data("gaussian")
    t = GGMLQuantizationType[qtype]
    rms_search = np.sqrt(np.mean((dequantize(ENCODERS[qtype](x, np.ones(COLS, np.float32)), t) - x) ** 2))
    rms_plain = np.sqrt(np.mean((dequantize(quantize(x, t), t) - x) ** 2))
    assert rms_search < 0.97 * rms_plain


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_importance_weights_favour_the_weighted_columns(qtype: str) -> None:
    heavy, flat = weighted_column_errors(ENCODERS[qtype], qtype, _data("gaussian"))
    assert heavy < 0.8 * flat


@pytest.mark.parametrize(
    ("x", "qw"),
    [
        (np.zeros((2, 48), np.float32), np.ones(48, np.float32)),  # row not a multiple of 32
        (np.zeros(64, np.float32), np.ones(64, np.float32)),  # not 2-D
        (np.zeros((2, 64), np.float32), np.ones(32, np.float32)),  # qw of the wrong length
        (np.full((2, 64), np.nan, np.float32), np.ones(64, np.float32)),
        (np.zeros((2, 64), np.float32), np.full(64, np.inf, np.float32)),
    ],
    ids=["row_length", "one_dimensional", "qw_length", "nan_weights", "inf_importance"],
)
def test_rejects_bad_input(x: np.ndarray, qw: np.ndarray) -> None:
    with pytest.raises(ValueError):
        legacy.Q4_0.quantize(x, qw)
