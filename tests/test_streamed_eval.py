"""Streamed evaluation (evalsuite/streamed.py): the original walked layer by layer with its
distributions kept on disk, a variant scored against them, equal to the in-memory scores."""

from __future__ import annotations

import pytest
import torch

from conftest import EVAL_TEXT, TINY
from core.errors import InputError
from evalsuite.metrics import causal_lm_logprobs, score
from evalsuite.reference import ReferenceStore
from evalsuite.streamed import streamed_scores
from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer
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
    build_variant(ckpt, variant, out)
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


def test_a_recipe_scores_a_variant_with_its_activations_and_kv_cache_as_the_in_memory_model(tmp_path):
    """The job streams a variant's kept weights through its simulated int8 activations and int4
    KV cache; the whole variant in memory with the same hooks gives the same scores."""
    from rich.console import Console

    from calib.text import sample_windows, token_windows
    from conftest import BUNDLED, write_recipe
    from formats.architecture import transformers_config
    from formats.hf import model_from_state
    from quant.activations import simulated_activations
    from quant.kv_cache import simulated_kv_cache
    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe
    from recipes.variants import activation_modules

    spec = {"name": "w8a8-kv4", "weights": {"method": "rtn", "bits": 8}, "activations": {"format": "int8"},
            "kv_cache": {"format": "int4"}, "exports": ["compressed-tensors"]}
    recipe = load_recipe(write_recipe(tmp_path, {
        "model": str(TINY), "evaluation": {"text": str(EVAL_TEXT), "window": 256, "max_windows": 4},
        "calibration": {"text": str(BUNDLED / "calib.txt"), "window": 128, "max_windows": 8}, "variants": [spec]}))
    report = run_recipe(recipe, tmp_path / "out", Console(quiet=True))
    got = next(r for r in report.rows if r.name == "w8a8-kv4").scores
    assert not list((tmp_path / "out" / "w8a8-kv4").glob(".weights*"))  # the kept weights were scratch

    ckpt = HFCheckpoint.open(TINY)
    variant = Variant.model_validate(spec)
    c = recipe.calibration
    calibration = sample_windows(load_tokenizer(ckpt), c.text, c.window, c.max_windows, c.seed)
    kept = build_variant(ckpt, variant, tmp_path / "again", keep=tmp_path / "kept", calibration=calibration).weights
    model = model_from_state(transformers_config(ckpt.config, str(TINY)), {n: kept.tensor(n) for n in kept.names})
    windows = token_windows(load_tokenizer(ckpt), EVAL_TEXT, 256, 4)
    with simulated_activations(model, variant.activations.spec, activation_modules(ckpt, variant)), \
            simulated_kv_cache(model, variant.kv_cache.spec, ckpt.arch.rope_pairs_adjacent_in_gguf):
        expected = score(causal_lm_logprobs(model), windows, causal_lm_logprobs(load_causal_lm(ckpt)))
    assert got.ppl == pytest.approx(expected.ppl, rel=1e-5)
    assert got.kld == pytest.approx(expected.kld, rel=1e-4)
    assert abs(got.top1 - expected.top1) <= 2 / got.tokens
    without = streamed_scores(kept, windows, ReferenceStore(tmp_path / "out" / ".reference", windows))
    assert expected.kld > 1.5 * without.kld  # the hooks change the scores: the comparison means something


def test_kept_weights_give_back_each_payload_as_the_quantizer_made_it(tmp_path, monkeypatch):
    """Codes and scales (with act-order's group index), 16-bit outlier columns, ggml blocks and
    float tensors come back from the kept weights exactly as they were put there."""
    import dataclasses

    import numpy as np

    from calib.text import sample_windows
    from conftest import BUNDLED
    from formats.variant_weights import VariantWeights

    put = {}
    original_put = VariantWeights.put
    monkeypatch.setattr(VariantWeights, "put", lambda self, name, payload: (put.__setitem__((self.folder, name), payload),
                                                                         original_put(self, name, payload))[1])
    ckpt = HFCheckpoint.open(TINY)
    windows = sample_windows(load_tokenizer(ckpt), BUNDLED / "calib.txt", 128, 4)
    specs = [
        {"name": "gptq", "weights": {"method": "gptq", "bits": 4, "group_size": 64, "act_order": True, "symmetric": False}},
        {"name": "outliers", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64,
                                         "outliers": {"relative": 2.0}}},
        {"name": "q4", "weights": {"method": "gguf", "type": "Q4_K_M"}},
    ]

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, np.ndarray):
            return a.dtype == b.dtype and np.array_equal(a, b)
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
        return a == b

    kinds = set()
    for spec in specs:
        kept = build_variant(ckpt, Variant.model_validate(spec | {"exports": []}), tmp_path, keep=tmp_path / spec["name"],
                             calibration=windows).weights
        assert set(kept.names) == {name for folder, name in put if folder == kept.folder}
        for name in kept.names:
            payload = put[kept.folder, name]
            kinds.add(type(payload).__name__)
            assert same(payload, kept.payload(name)), name
    assert {"QuantizedTensor", "MixedPrecisionTensor", "Tensor", "GGMLTensor"} <= kinds, kinds
