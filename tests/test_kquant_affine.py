"""Q4_K, Q5_K and Q2_K encoders: byte-exact against llama.cpp's own quantizer, and sound on their own.

The oracle tests need llama-cpp-python's libggml-base; the error tests only need gguf's decoder, so
they hold the encoders to llama.cpp's published test-quantize-fns numbers even without llama.cpp.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors import safe_open

import quant.ggml.kquant_affine as kq
from conftest import TINY
from helpers.ggml_cases import assert_same_blocks, random_imatrix, seeded_case, unusual_imatrix
from helpers.ggml_oracle import available, ggml_quantize

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)

ENCODERS = {"Q4_K": kq.Q4_K.quantize, "Q5_K": kq.Q5_K.quantize, "Q2_K": kq.Q2_K.quantize}
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q2_K": 84}
needs_oracle = pytest.mark.skipif(not available(), reason="llama-cpp-python's libggml-base is not installed")

ROWS, COLS = 96, 1024  # 384 super-blocks per synthetic case


def _gauss(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((ROWS, COLS)) * 0.02


def _heavy(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_t(3, (ROWS, COLS)) * 0.02
    outliers = rng.random((ROWS, COLS)) < 0.002
    x[outliers] *= 20
    return x


def _zero_and_constant(rng: np.random.Generator) -> np.ndarray:
    """Whole rows of 0, of one positive or one negative value, and rows with zeroed sub-blocks."""
    x = _gauss(rng)
    x[0:24] = 0
    x[24:40] = 0.37
    x[40:56] = -0.37
    x[56:72].reshape(16, -1, 16)[:, ::2] = 0  # every other 16-group of these rows
    return x


def _all_positive(rng: np.random.Generator) -> np.ndarray:
    return np.abs(_gauss(rng)) + 0.01


def _bf16_exact(rng: np.random.Generator) -> np.ndarray:
    return torch.from_numpy(_heavy(rng).astype(np.float32)).to(torch.bfloat16).float().numpy()


def _fp16_exact(rng: np.random.Generator) -> np.ndarray:
    return _heavy(rng).astype(np.float16)


def _tiny(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((ROWS, COLS)) * 1e-8


def _subnormal(rng: np.random.Generator) -> np.ndarray:
    """Scales overflow to inf here, so ggml's nearest_int sees inf/NaN and returns its bit garbage."""
    return rng.standard_normal((ROWS, COLS)) * 1e-39


def _mixed_magnitudes(rng: np.random.Generator) -> np.ndarray:
    """Normal, tiny (1e-39) and subnormal (1e-42) sub-blocks in the same rows, and offset ones: the
    search's chunk-wide range bound must give way to its per-group checks only where they matter."""
    x = _gauss(rng)
    groups = x.reshape(ROWS, -1, 16)
    groups[:, ::3] *= 1e-37
    groups[:, 1::5] = rng.standard_normal(groups[:, 1::5].shape) * 1e-42
    groups[:, 2::7] += 0.5
    return x


def _sparse(rng: np.random.Generator) -> np.ndarray:
    x = _gauss(rng)
    x[rng.random(x.shape) < 0.9] = 0
    return x


def _real_weights(rng: np.random.Generator) -> np.ndarray:
    with safe_open(TINY / "model.safetensors", "pt") as f:
        return f.get_tensor("model.layers.0.mlp.down_proj.weight").float().numpy()  # [256, 768]


CASES = {
    "gaussian": _gauss,
    "heavy_tailed": _heavy,
    "zero_and_constant": _zero_and_constant,
    "all_positive": _all_positive,
    "bf16_exact": _bf16_exact,
    "fp16_exact": _fp16_exact,
    "tiny": _tiny,
    "subnormal": _subnormal,
    "mixed_magnitudes": _mixed_magnitudes,
    "sparse": _sparse,
    "real_weights": _real_weights,
}


@lru_cache(maxsize=None)
def _data(case: str) -> np.ndarray:
    return seeded_case(CASES, case)


def _assert_same_blocks(ours: np.ndarray, ggml: np.ndarray, qtype: str) -> None:
    assert_same_blocks(ours, ggml, BLOCK_BYTES[qtype], "super-blocks")


@needs_oracle
@pytest.mark.parametrize("imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("qtype", list(ENCODERS))
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_match_llama_cpp(case: str, qtype: str, imatrix: bool) -> None:
    x = _data(case)
    qw = random_imatrix(x.shape[1]) if imatrix else None
    _assert_same_blocks(ENCODERS[qtype](x, qw), ggml_quantize(x, qtype, qw), qtype)


@needs_oracle
@pytest.mark.parametrize("qtype", list(ENCODERS))
@pytest.mark.parametrize(
    "kind",
    ["mostly_zero", "all_zero", "wide_range"],
)
def test_unusual_importance_weights_match_llama_cpp(qtype: str, kind: str) -> None:
    """Zero weights leave the search few points to fit, which moves the best offset onto a group's
    max: the case ggml's qkx3 guards against and we reproduce."""
    x = _data("heavy_tailed")
    qw = unusual_imatrix(kind, COLS)
    _assert_same_blocks(ENCODERS[qtype](x, qw), ggml_quantize(x, qtype, qw), qtype)


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_bytes_do_not_depend_on_chunking(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 7 super-blocks cut rows of 3 at varying places; each block must keep its columns'
    importance weights."""
    x = _data("real_weights")
    qw = random_imatrix(x.shape[1])
    whole = ENCODERS[qtype](x, qw), ENCODERS[qtype](x)
    monkeypatch.setattr(kq, "_CHUNK_BLOCKS", 7)
    chunked = ENCODERS[qtype](x, qw), ENCODERS[qtype](x)
    np.testing.assert_array_equal(chunked[0], whole[0])
    np.testing.assert_array_equal(chunked[1], whole[1])


def _test_quantize_fns_data(offset: int) -> np.ndarray:
    """llama.cpp's test data, ``0.1 + 2*cosf(i + offset)`` stored as float.

    cosf is computed in double and rounded, which is what a correctly rounded libm cosf gives;
    numpy's float32 cos is not correctly rounded.
    """
    arg = np.arange(4096, dtype=np.float32) + np.float32(offset)
    cos = np.cos(arg.astype(np.float64)).astype(np.float32)
    return (0.1 + 2.0 * cos.astype(np.float64)).astype(np.float32)[None, :]


def _total_error(x: np.ndarray, raw: np.ndarray, qtype: str) -> float:
    y = dequantize(raw, GGMLQuantizationType[qtype]).reshape(x.shape)
    diff = x.astype(np.float64) - y.astype(np.float64)
    return float(np.sqrt(np.sum(diff * diff)) / x.size)


# Published by llama.cpp's tests/test-quantize-fns.cpp: its limit, and the error it measures.
QUANTIZE_FNS = {"Q2_K": (0.0075, 0.004672), "Q4_K": (0.002, 0.000982), "Q5_K": (0.002, 0.000531)}


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_quantize_fns_total_error(qtype: str) -> None:
    limit, measured = QUANTIZE_FNS[qtype]
    errors = []
    for offset in (0, 1):
        x = _test_quantize_fns_data(offset)
        errors.append(_total_error(x, ENCODERS[qtype](x), qtype))
    assert max(errors) < limit
    assert round(errors[0], 6) == measured  # llama.cpp reports the error on its first data set


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_importance_weights_favour_the_weighted_columns(qtype: str) -> None:
    """Decoded independently: with the imatrix, the heavily weighted columns come out closer."""
    x = _data("gaussian")
    qw = np.ones(COLS, dtype=np.float32)
    qw[::4] = 100.0
    err_ref = (dequantize(ENCODERS[qtype](x), GGMLQuantizationType[qtype]) - x) ** 2
    err_imx = (dequantize(ENCODERS[qtype](x, qw), GGMLQuantizationType[qtype]) - x) ** 2
    assert err_imx[:, ::4].mean() < err_ref[:, ::4].mean()


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_rejects_bad_input(qtype: str) -> None:
    encode = ENCODERS[qtype]
    with pytest.raises(ValueError, match="multiple of 256"):
        encode(np.zeros((2, 100), dtype=np.float32))
    with pytest.raises(ValueError, match="shape"):
        encode(np.zeros((2, 256), dtype=np.float32), np.ones(512, dtype=np.float32))
    bad = np.zeros((2, 256), dtype=np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        encode(bad)


def test_q4_k_parts_read_back_llama_cpps_grid_and_write_it_again_byte_for_byte() -> None:
    """What QAT trains on: the grid Q4_K bytes store, and those bytes again from the grid."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 1.0, (6, 1))).astype(np.float32)
    x[0, :256] = 0.0  # a super-block of zeros: d = dmin = 0
    raw = kq.Q4_K.quantize(x)
    d, dmin, sc, m, q = kq.q4_k_parts(raw)
    assert d.shape == dmin.shape == (12,) and sc.shape == m.shape == (12, 8) and q.shape == (12, 256)
    assert q.max() <= 15 and sc.max() <= 63 and m.max() <= 63
    values = q.reshape(-1, 8, 32) * (d[:, None] * sc)[..., None] - (dmin[:, None] * m)[..., None]
    assert np.array_equal(values.reshape(x.shape), dequantize(raw, GGMLQuantizationType.Q4_K).reshape(x.shape))
    assert np.array_equal(kq.q4_k_from_parts(d, dmin, sc, m, q).reshape(raw.shape), raw)
