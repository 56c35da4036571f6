"""IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0 and MXFP4: byte-exact against llama.cpp's own quantizer, block by block.

IQ4_NL, IQ4_XS (quant/ggml/iquant_nl.py), IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS and IQ2_S
(quant/ggml/iquant_lattice.py) IQ1_S and IQ1_M (quant/ggml/iquant_iq1.py) are our ports, with and without
an importance matrix (IQ2_XXS, IQ2_XS and IQ1_S only with one, as llama.cpp);
TQ1_0, TQ2_0 and MXFP4 come from gguf-py, which we rely on only because these tests pin it to
llama.cpp's bytes, and llama.cpp reads no importance matrix for them (pinned here too). Rows are
1024 wide so that IQ4_XS's super-blocks of 256 hold several blocks of 32.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors import safe_open

from conftest import TINY
from helpers.ggml_cases import (UNUSUAL_IMATRIX, assert_same_blocks, random_imatrix, seeded_case, unusual_imatrix,
                                weighted_column_errors)
from helpers.ggml_oracle import available, ggml_quantize
from quant.ggml import iquant_iq1, iquant_lattice, iquant_nl, lattice
from quant.ggml.types import type_named

PORTED = ["IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]
LATTICE = ["IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]  # the C searches
ONLY_WITH_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ1_S"}  # ggml asserts an importance matrix
FROM_GGUF = ["TQ1_0", "TQ2_0", "MXFP4"]
needs_oracle = pytest.mark.skipif(not available(), reason="llama-cpp-python's libggml-base is not installed")

ROWS, COLS = 32, 1024
# the fast tier (docs/testing.md): one i-quant, real weights, with an importance matrix
CHECK_CASES = {"test_bytes_match_llama_cpp[imatrix-real_weights-IQ4_XS]"}


def _scaled(magnitude: float) -> Callable[[np.random.Generator], np.ndarray]:
    """Gaussian rows of one magnitude (float64 until the case is stored as float32)."""
    return lambda rng: rng.standard_normal((ROWS, COLS)) * magnitude


def _heavy(rng: np.random.Generator) -> np.ndarray:
    """Student-t rows with a few outliers 25x larger: blocks whose largest value stands alone."""
    x = rng.standard_t(3, (ROWS, COLS)) * 0.02
    x[rng.random((ROWS, COLS)) < 0.003] *= 25
    return x


def _zeros(rng: np.random.Generator) -> np.ndarray:
    """Rows of +0, −0 and one constant; rows with every other block of 32 zero (+0 or −0), and a
    row with one super-block zero: IQ4_XS then stores d = −0 (ggml's ``−max_scale/32`` of 0)."""
    x = _scaled(0.02)(rng)
    x[0:2] = 0
    x[2:4] = -0.0
    x[4:6] = 0.37
    x[6:8] = -0.37
    x[8:12].reshape(4, -1, 32)[:, ::2] = 0
    x[12:16].reshape(4, -1, 32)[:, 1::2] = -0.0
    x[16, 256:512] = 0
    return x


def _on_a_grid(rng: np.random.Generator) -> np.ndarray:
    """Q4_1-like blocks (every value one of 16 levels): full of ties between the search's candidates,
    as SmolLM2's weights are."""
    levels = rng.integers(0, 16, (ROWS, COLS // 32, 32))
    scale = rng.uniform(0.001, 0.01, (ROWS, COLS // 32, 1))
    return (levels * scale - 8 * scale).reshape(ROWS, COLS)


def _real_weights(rng: np.random.Generator) -> np.ndarray:
    with safe_open(TINY / "model.safetensors", "pt") as f:
        return f.get_tensor("model.layers.0.mlp.up_proj.weight").float().numpy()  # [768, 256]: rows of one super-block


CASES = {
    "gaussian": _scaled(0.02),
    "heavy_tailed": _heavy,
    "zeros": _zeros,
    "on_a_grid": _on_a_grid,
    "bf16_exact": lambda rng: torch.from_numpy(_heavy(rng).astype(np.float32)).to(torch.bfloat16).float().numpy(),
    # rows around ggml's 1e-15 threshold: some blocks all zero to the search, some not
    "tiny": lambda rng: _scaled(1.0)(rng) * 10.0 ** rng.uniform(-17, -13, (ROWS, 1)),
    "small": lambda rng: _scaled(1.0)(rng) * 10.0 ** rng.uniform(-10, -6, (ROWS, 1)),  # IQ3_XXS's 1e-8 threshold
    "subnormal": _scaled(1e-39),
    "huge": _scaled(1e25),  # x² overflows float32: the search meets inf and NaN, which ggml's scans skip
    "real_weights": _real_weights,
}


@lru_cache(maxsize=None)
def _data(case: str) -> np.ndarray:
    return seeded_case(CASES, case)


def _assert_same_blocks(ours: np.ndarray, ggml: np.ndarray, qtype: str) -> None:
    assert_same_blocks(ours, ggml, type_named(qtype).type_size)


def _quantize(qtype: str, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    with np.errstate(all="ignore"):  # the huge case overflows in gguf-py's encoders too
        return type_named(qtype).quantize(x, qw)


@needs_oracle
@pytest.mark.parametrize("qtype", PORTED + FROM_GGUF)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("imatrix", [False, True], ids=["ref", "imatrix"])
def test_bytes_match_llama_cpp(imatrix: bool, case: str, qtype: str) -> None:
    if imatrix is False and qtype in ONLY_WITH_IMATRIX:
        pytest.skip("llama.cpp's quantizer asserts an importance matrix for this type")
    if case == "huge" and qtype.startswith(("IQ3", "IQ2")):
        pytest.skip("llama.cpp aborts: every neighbour's error is inf (GGML_ASSERT in iq3_find_best_neighbour)")
    x = _data(case)
    qw = random_imatrix(x.shape[1]) if imatrix else None
    _assert_same_blocks(_quantize(qtype, x, qw), ggml_quantize(x, qtype, qw), qtype)


@needs_oracle
@pytest.mark.parametrize("qtype", PORTED)
@pytest.mark.parametrize("kind", UNUSUAL_IMATRIX)
def test_unusual_importance_weights_match_llama_cpp(qtype: str, kind: str) -> None:
    """Zero weights leave the search few points to fit (or none: every candidate is rejected)."""
    x = _data("heavy_tailed")
    qw = unusual_imatrix(kind, COLS)
    _assert_same_blocks(_quantize(qtype, x, qw), ggml_quantize(x, qtype, qw), qtype)


@needs_oracle
@pytest.mark.parametrize("qtype", FROM_GGUF)
def test_llama_cpp_reads_no_importance_matrix_for_the_reference_types(qtype: str) -> None:
    """Why these types have ``takes_imatrix = False`` and come from gguf-py's reference encoders."""
    x = _data("heavy_tailed")
    assert not type_named(qtype).takes_imatrix
    np.testing.assert_array_equal(ggml_quantize(x, qtype, random_imatrix(COLS)), ggml_quantize(x, qtype))


def test_best_index_is_ggmls_nearest_level_search() -> None:
    """The table over floor(2v) against ggml's binary search and float32 comparison, written out,
    on every half-integer, its float32 neighbours, random values and the non-finite ones."""
    halves = np.arange(-300, 300, 0.5, dtype=np.float32)
    v = np.concatenate([halves, np.nextafter(halves, np.float32(-1e9)), np.nextafter(halves, np.float32(1e9)),
                        np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 80,
                        np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, -0.0], np.float32)])
    k = iquant_nl.KVALUES
    mu = np.clip(np.searchsorted(k, v, side="right"), 1, 15)  # the first level above v, within 1..15
    expected = np.where(v - k[mu - 1] < k[mu] - v, mu - 1, mu)
    np.testing.assert_array_equal(iquant_nl.best_index(v), expected)


@pytest.mark.parametrize("qtype", PORTED)
def test_bytes_do_not_depend_on_chunking(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row per chunk must keep every block's own importance and its super-block's sigma2."""
    x = _data("heavy_tailed")
    qw = random_imatrix(COLS)
    whole = _quantize(qtype, x, qw)
    monkeypatch.setattr(sys.modules[type_named(qtype).__module__], "_CHUNK_ELEMENTS", 1)
    np.testing.assert_array_equal(_quantize(qtype, x, qw), whole)


@pytest.mark.parametrize("qtype", LATTICE)
def test_the_numpy_searches_give_the_c_kernels_bytes(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no C compiler builds quant/ggml/lattice_search.c and iq1_split.c, numpy searches the
    neighbours and IQ1's splits: the same bytes on every case, the overflowing one included, and on
    zero-weighted columns."""
    if iquant_lattice._kernel() is None or iquant_iq1._kernel() is None:
        pytest.skip("no C compiler built the kernels")
    inputs = [(x, random_imatrix(x.shape[1])) for x in map(_data, CASES)]
    inputs += [(_data("heavy_tailed"), unusual_imatrix(kind, COLS)) for kind in UNUSUAL_IMATRIX]
    by_c = [_quantize(qtype, x, qw) for x, qw in inputs]
    monkeypatch.setattr(iquant_lattice, "_kernel", lambda: None)
    monkeypatch.setattr(iquant_iq1, "_kernel", lambda: None)
    for (x, qw), expected in zip(inputs, by_c):
        np.testing.assert_array_equal(_quantize(qtype, x, qw), expected)


@pytest.mark.parametrize("qtype", PORTED)
def test_importance_weights_favour_the_weighted_columns(qtype: str) -> None:
    """Decoded by gguf-py (an independent reader of the layout): columns weighted 100x come out closer."""
    heavy, flat = weighted_column_errors(lambda x, qw: _quantize(qtype, x, qw), qtype, _data("gaussian"))
    assert heavy < 0.8 * flat


@pytest.mark.parametrize("qtype", PORTED + FROM_GGUF)
def test_decoded_error_is_what_the_bits_allow(qtype: str) -> None:
    """Relative RMS error of Gaussian weights decoded by gguf-py. The IQ4 types beat Q4_0 (0.085 on
    this data) at the same or fewer bits, which is what their non-linear levels are for; ternary
    types keep about a fifth of the signal. A wrong layout would decode to noise (error 1 or more)."""
    x = _data("gaussian")
    flat = np.ones(COLS, np.float32) if qtype in ONLY_WITH_IMATRIX else None
    back = dequantize(_quantize(qtype, x, flat), GGMLQuantizationType[qtype])
    rel = np.sqrt(np.mean((back - x) ** 2) / np.mean(x**2))
    assert rel < {"IQ4_NL": 0.08, "IQ4_XS": 0.08, "IQ3_S": 0.17, "IQ3_XXS": 0.23, "IQ2_XXS": 0.4, "IQ2_XS": 0.35, "IQ2_S": 0.35, "IQ1_S": 0.6, "IQ1_M": 0.6, "MXFP4": 0.13, "TQ1_0": 0.85, "TQ2_0": 0.85}[qtype], rel


@pytest.mark.parametrize("qtype", PORTED)
def test_rejects_bad_input(qtype: str) -> None:
    with pytest.raises(ValueError, match="multiple of"):
        type_named(qtype).quantize(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="NaN or Inf"):
        type_named(qtype).quantize(np.full((1, 256), np.nan, np.float32))
    if qtype in ONLY_WITH_IMATRIX:
        with pytest.raises(ValueError, match="needs an importance matrix"):
            type_named(qtype).quantize(np.ones((1, 256), np.float32))


def test_the_iq3_s_lattice_is_llama_cpps() -> None:
    """512 distinct points of 4 levels 0..7; every code off the grid has neighbours, the nearest
    first (squared distance in levels never decreasing along a list)."""
    grid = lattice.iq3_s()
    assert grid.points.shape == (512, 4) and len({tuple(p) for p in grid.points}) == 512
    off = grid.index < 0
    assert off.sum() == 4096 - 512 and (grid.row[off] >= 0).all() and (grid.row[~off] == -1).all()
    codes = np.flatnonzero(off)
    assert (grid.counts[grid.row[codes]] > 0).all()
    levels = (codes[:, None] >> (3 * np.arange(4))) & 7
    cand = grid.neighbours[grid.row[codes]]
    d2 = ((grid.points[np.maximum(cand, 0)] - levels[:, None, :]) ** 2).sum(axis=2)
    d2 = np.where(cand >= 0, d2, np.iinfo(np.int64).max)
    assert (np.diff(d2, axis=1) >= 0).all()


def test_a_recipe_takes_the_new_file_types() -> None:
    """``{method: gguf, type: IQ4_XS, imatrix: true}``: the recipe's field lists every file type."""
    from recipes.methods.gguf import GGUFWeights

    for name in ("IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_M", "IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M", "Q2_K_S", "TQ1_0",
                 "TQ2_0", "MXFP4_MOE"):
        assert GGUFWeights.model_validate({"method": "gguf", "type": name, "imatrix": True}).type == name
