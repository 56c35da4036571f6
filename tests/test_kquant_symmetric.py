"""Q6_K and Q3_K encoders: byte-exact against llama.cpp's own quantizer, and right on their own.

The oracle tests compare every byte with ``ggml_quantize_chunk`` over inputs chosen to reach each
branch of the encoders (all-zero groups, a zero step after fp16 rounding, subnormal products,
signed maxima, zero importance). The oracle-free tests check the §6 error figures of llama.cpp's
test-quantize-fns through gguf's independent decoder.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors import safe_open

import quant.ggml.kquant_symmetric as ks
from conftest import TINY
from helpers.ggml_oracle import available, ggml_quantize
quantize_q3_k, quantize_q6_k = ks.Q3_K.quantize, ks.Q6_K.quantize

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)

ENCODERS = {"Q6_K": (quantize_q6_k, 210), "Q3_K": (quantize_q3_k, 110)}
ROWS, COLS = 96, 1024  # 384 super-blocks per case


def _gaussian(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((ROWS, COLS))


def _heavy_tailed(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_t(2.0, (ROWS, COLS))
    hits = rng.integers(0, x.size, 64)
    x.flat[hits] *= 20.0  # a few outliers dominate their sub-blocks
    return x


def _zero_rows(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((ROWS, COLS))
    x[::3] = 0.0
    return x


def _sparse_subblocks(rng: np.random.Generator) -> np.ndarray:
    """Whole 16-element sub-blocks zeroed, others with one live value or tiny next to large."""
    x = rng.standard_normal((ROWS, COLS))
    groups = x.reshape(ROWS, COLS // 16, 16)
    pick = rng.random(groups.shape[:2])
    groups[pick < 0.3] = 0.0
    single = (pick >= 0.3) & (pick < 0.4)
    groups[single, 1:] = 0.0
    groups[(pick >= 0.4) & (pick < 0.5)] *= 1e-4  # steps that round to zero beside large ones
    return x


def _constant_rows(rng: np.random.Generator) -> np.ndarray:
    values = rng.choice([-3.0, -0.5, 0.25, 1.0, 7.0], size=(ROWS, 1))
    return np.repeat(values, COLS, axis=1)


def _all_positive(rng: np.random.Generator) -> np.ndarray:
    return np.abs(rng.standard_normal((ROWS, COLS))) + 0.01


def _bf16_exact(rng: np.random.Generator) -> np.ndarray:
    x = torch.from_numpy(rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.02)
    return x.to(torch.bfloat16).to(torch.float32).numpy()


def _fp16_exact(rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float16)


def _tiny_1e8(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((ROWS, COLS)) * 1e-8


def _tiny_1e13(rng: np.random.Generator) -> np.ndarray:
    """Around 1e-13 the products w*x*l are float32 subnormals."""
    return rng.standard_normal((ROWS, COLS)) * 1e-13


def _near_eps(rng: np.random.Generator) -> np.ndarray:
    """Around 3e-15 some groups fall below ggml's 1e-15 "all zero" threshold and some do not."""
    return rng.standard_normal((ROWS, COLS)) * 3e-15


def _below_eps(rng: np.random.Generator) -> np.ndarray:
    """Every group just under the threshold: ggml calls them all zero although x^2 is not."""
    return rng.uniform(-9.9e-16, 9.9e-16, (ROWS, COLS))


def _tiny_1e20(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((ROWS, COLS)) * 1e-20


def _real_weight(name: str):
    def load(rng: np.random.Generator) -> np.ndarray:
        with safe_open(TINY / "model.safetensors", "pt") as f:
            return f.get_tensor(name).to(torch.float32).numpy()

    return load


CASES = {
    "gaussian": _gaussian,
    "heavy_tailed": _heavy_tailed,
    "zero_rows": _zero_rows,
    "sparse_subblocks": _sparse_subblocks,
    "constant_rows": _constant_rows,
    "all_positive": _all_positive,
    "bf16_exact": _bf16_exact,
    "fp16_exact": _fp16_exact,
    "tiny_1e-8": _tiny_1e8,
    "tiny_1e-13": _tiny_1e13,
    "near_eps": _near_eps,
    "below_eps": _below_eps,
    "tiny_1e-20": _tiny_1e20,
    "v_proj": _real_weight("model.layers.0.self_attn.v_proj.weight"),
    "down_proj": _real_weight("model.layers.0.mlp.down_proj.weight"),
}


def _imatrix(n: int, rng: np.random.Generator) -> np.ndarray:
    """Random importance with isolated zeros, a zero sub-block and, when there is room, a zero
    super-block (every weight of a block zero)."""
    qw = rng.exponential(1.0, n).astype(np.float32)
    qw[rng.random(n) < 0.1] = 0.0
    qw[32:48] = 0.0
    if n >= 1024:
        qw[512:768] = 0.0
    return qw


def _case_data(case: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.ascontiguousarray(CASES[case](rng), dtype=np.float32)


def _assert_same_blocks(ours: np.ndarray, ref: np.ndarray, block_bytes: int) -> None:
    assert ours.dtype == np.uint8 and ours.shape == ref.shape
    bad = (ours.reshape(-1, block_bytes) != ref.reshape(-1, block_bytes)).any(axis=1)
    first = np.flatnonzero(bad)[:5]
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} super-blocks differ, first {first}"


@pytest.mark.skipif(not available(), reason="llama-cpp-python (the interop extra) provides the oracle")
@pytest.mark.parametrize("imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("qtype", ENCODERS)
@pytest.mark.parametrize("case", CASES)
def test_bytes_match_ggml(case: str, qtype: str, imatrix: bool) -> None:
    seed = sorted(CASES).index(case)
    x = _case_data(case, seed)
    qw = _imatrix(x.shape[1], np.random.default_rng(1000 + seed)) if imatrix else None
    encode, block_bytes = ENCODERS[qtype]
    _assert_same_blocks(encode(x, qw), ggml_quantize(x, qtype, qw), block_bytes)


def test_chunking_never_changes_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _case_data("heavy_tailed", 7)[:24]
    qw = _imatrix(x.shape[1], np.random.default_rng(7))
    whole = {(q, w is None): enc(x, w) for q, (enc, _) in ENCODERS.items() for w in (None, qw)}
    monkeypatch.setattr(ks, "_CHUNK_ELEMENTS", 5 * x.shape[1])  # 5 rows per chunk, a ragged tail
    for (q, ref), out in whole.items():
        assert np.array_equal(ENCODERS[q][0](x, None if ref else qw), out), (q, ref)


def _test_quantize_fns_data() -> np.ndarray:
    """test-quantize-fns' data: ``0.1 + 2*cosf(i)`` for 4096 floats, the sum done in double."""
    i = np.arange(4096, dtype=np.float32)
    cos = np.cos(i.astype(np.float64)).astype(np.float32)  # cosf, correctly rounded
    return (0.1 + (2 * cos).astype(np.float64)).astype(np.float32)[None, :]


def _array_rmse(a: np.ndarray, b: np.ndarray) -> float:
    """test-quantize-fns' metric: sqrt of the double sum of float differences squared, over n."""
    diff = (a - b).astype(np.float64).ravel()
    return float(np.sqrt(np.sum(diff * diff))) / diff.size


@pytest.mark.parametrize(
    ("qtype", "limit", "expected"), [("Q3_K", 0.0040, 0.002510), ("Q6_K", 0.002, 0.000261)]
)
def test_quantize_fns_total_error(qtype: str, limit: float, expected: float) -> None:
    x = _test_quantize_fns_data()
    encode, _ = ENCODERS[qtype]
    err = _array_rmse(x, dequantize(encode(x), GGMLQuantizationType[qtype]))
    assert err < limit
    assert f"{err:.6f}" == f"{expected:.6f}"


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q6_k(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match="importance weights"):
        quantize_q3_k(np.zeros((2, 256), np.float32), np.ones(128, np.float32))
