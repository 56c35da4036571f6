"""Streamed evaluation (evalsuite/streamed.py): the original walked layer by layer with its
distributions kept on disk, a variant scored against them, equal to the in-memory scores."""

from __future__ import annotations

import pytest

from conftest import EVAL_TEXT, TINY
from evalsuite.metrics import causal_lm_logprobs, score
from evalsuite.reference import ReferenceStore
from evalsuite.streamed import streamed_scores
from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer
from quant.types import InputError
from recipes.schema import Variant
from recipes.variants import build_variant


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """The bundled model, an int4 RTN variant of it as a float folder, and 6 evaluation windows."""
    from calib.text import token_windows

    ckpt = HFCheckpoint.open(TINY)
    windows = token_windows(load_tokenizer(ckpt), EVAL_TEXT, 256, 6)
    out = tmp_path_factory.mktemp("streamed")
    variant = Variant.model_validate({"name": "int4", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64},
                                      "exports": ["safetensors"]})
    build_variant(ckpt, variant, out, keep_weights=False)
    return ckpt, HFCheckpoint.open(out / "int4" / "safetensors"), windows, out


def test_streamed_scores_equal_the_in_memory_ones(setting, tmp_path):
    ckpt, variant, windows, _ = setting
    original = load_causal_lm(ckpt)
    expected_original = score(causal_lm_logprobs(original), windows)
    expected = score(causal_lm_logprobs(load_causal_lm(variant)), windows, causal_lm_logprobs(original))
    ticks = []
    kept = streamed_scores(ckpt, windows, keep=tmp_path / "reference", on_window=lambda: ticks.append(1))
    assert len(ticks) == len(windows)
    store = ReferenceStore(tmp_path / "reference", windows)
    assert store.top_k == ckpt.arch.vocab  # small enough to keep exactly
    got = streamed_scores(variant, windows, reference=store)
    assert kept.ppl == pytest.approx(expected_original.ppl, rel=1e-5) and kept.kld is None
    assert got.ppl == pytest.approx(expected.ppl, rel=1e-5)
    assert got.kld == pytest.approx(expected.kld, rel=1e-4)
    assert abs(got.top1 - expected.top1) <= 2 / got.tokens  # a float near-tie may flip an argmax
    assert expected.kld > 0.01  # the variant differs enough for the comparison to mean something
    assert got.per_window["nll"] == pytest.approx(expected.per_window["nll"], rel=1e-5)


def test_a_top_k_store_bounds_the_divergence_from_below_and_keeps_the_top_token(setting, tmp_path):
    """The bundled model's tail is flat (a vocabulary of 8192 over a small model): its top 256
    tokens hold 92% of the variant's divergence, its top 32, 75%."""
    ckpt, variant, windows, _ = setting
    scores = {}
    for k in (None, 256, 32):
        folder = tmp_path / f"top{k}"
        streamed_scores(ckpt, windows, keep=folder, top_k=k)
        scores[k] = streamed_scores(variant, windows, reference=ReferenceStore(folder, windows))
    size = {k: sum(f.stat().st_size for f in (tmp_path / f"top{k}").iterdir()) for k in (None, 32)}
    assert size[32] * 100 < size[None]
    assert scores[32].top1 == scores[256].top1 == scores[None].top1 and scores[32].ppl == scores[None].ppl
    assert 0.7 * scores[None].kld < scores[32].kld < scores[256].kld <= scores[None].kld * (1 + 1e-6)
    assert scores[256].kld > 0.9 * scores[None].kld


def test_a_store_of_other_windows_is_refused(setting, tmp_path):
    ckpt, _, windows, _ = setting
    streamed_scores(ckpt, windows[:2], keep=tmp_path / "reference")
    with pytest.raises(InputError, match="computed on other evaluation windows"):
        ReferenceStore(tmp_path / "reference", windows)
    with pytest.raises(InputError, match="not a reference store"):
        ReferenceStore(tmp_path, windows)
