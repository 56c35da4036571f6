"""The recipe job end to end on the bundled model, and what its files hold."""

import hashlib
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from conftest import TINY
from formats.hf import HFCheckpoint
from formats.hf import model_from_state
from recipes.schema import Variant
from recipes.variants import build_variant


def test_report_compares_every_variant_with_the_original(small_run):
    out, report = small_run
    rows = {r["name"]: r for r in report["variants"]}
    assert list(rows) == ["original", "int8", "int4-g64-asym", "gptq-int4-g64-asym", "awq-int4-g64", "int4-g64-outliers",
                          "w8a8-smoothquant", "kv-int4", "f16", "q8_0", "q4_k_m-imatrix"]
    assert report["evaluation"]["windows"] == 2
    assert rows["original"]["kld"] is None and rows["original"]["tokens"] == 2 * 511
    assert 20 < rows["original"]["ppl"] < 200
    # F16 changes the bf16 weights not at all; int4 moves the model far more than int8 does.
    assert rows["f16"]["kld"] < 1e-6 and rows["f16"]["top1"] > 0.995
    assert 0 < rows["int8"]["kld"] < rows["int4-g64-asym"]["kld"]
    assert rows["int8"]["top1"] > rows["int4-g64-asym"]["top1"]
    for name, row in rows.items():
        assert row["ppl_delta"] == pytest.approx(row["ppl"] - rows["original"]["ppl"])
    assert rows["int4-g64-asym"]["bits_per_weight"] < rows["int8"]["bits_per_weight"] < 16
    assert 8.5 < rows["q8_0"]["bits_per_weight"] < 8.52  # Q8_0 matrices, F32 norms
    # Q4_K_M: 4.5-bit matrices, 6.56-bit for some attn_v/ffn_down and the tied embedding-as-output
    assert 4.5 < rows["q4_k_m-imatrix"]["bits_per_weight"] < 6
    assert rows["q8_0"]["kld"] < rows["q4_k_m-imatrix"]["kld"] < rows["int4-g64-asym"]["kld"]
    assert rows["q4_k_m-imatrix"]["method"] == "gguf Q4_K_M imatrix"
    # Same grid as int4-g64-asym, fitted to 16 windows of calibration text: GPTQ moves the model less.
    assert rows["gptq-int4-g64-asym"]["kld"] < 0.8 * rows["int4-g64-asym"]["kld"]
    assert rows["gptq-int4-g64-asym"]["method"] == "gptq int4-g64-asym act-order"
    assert rows["gptq-int4-g64-asym"]["bits_per_weight"] > rows["int4-g64-asym"]["bits_per_weight"]  # + g_idx
    assert rows["awq-int4-g64"]["kld"] < rows["int4-g64-asym"]["kld"] and rows["awq-int4-g64"]["method"] == "awq int4-g64-asym"
    # fp16 outlier columns: a few more bits than the plain grid, less damage; their statistics reported
    outliers = rows["int4-g64-outliers"]
    assert outliers["method"] == "rtn int4-g64-asym fp16-outliers"
    assert rows["int4-g64-asym"]["bits_per_weight"] < outliers["bits_per_weight"] < rows["int4-g64-asym"]["bits_per_weight"] + 0.5
    assert outliers["kld"] < rows["int4-g64-asym"]["kld"]
    assert len(outliers["input_statistics"]) == 7 * 6 and sum(s["outlier_channels"] for s in outliers["input_statistics"].values()) > 0
    # W8A8: the activations' quantization is part of what is scored (int8 weights alone move it less)
    w8a8 = rows["w8a8-smoothquant"]
    assert w8a8["method"] == "rtn int8-channel-sym a-int8-token smoothquant-0.5"
    assert rows["int8"]["kld"] < w8a8["kld"] < rows["int4-g64-asym"]["kld"]
    assert set(w8a8["input_statistics"]) == set(outliers["input_statistics"])
    # the weights as they were, the KV cache in llama.cpp's q4_0: only the cache is scored
    kv = rows["kv-int4"]
    assert kv["method"] == "source weights kv-q4_0" and kv["bits_per_weight"] == rows["original"]["bits_per_weight"]
    assert 0 < kv["kld"] < rows["int4-g64-asym"]["kld"] and kv["files"] == []
    md = (out / "report.md").read_text()
    assert "| int4-g64-asym | rtn int4-g64-asym |" in md
    assert "## Activation outliers: int4-g64-outliers" in md and "## Activation outliers: w8a8-smoothquant" in md
    assert not list(out.rglob("*.partial"))


def test_every_export_listed_in_the_report_exists(small_run):
    out, report = small_run
    files = [f for r in report["variants"] for f in r["files"]]
    assert {f["path"] for f in files} == {
        "int8/safetensors", "int4-g64-asym/safetensors", "gptq-int4-g64-asym/safetensors", "awq-int4-g64/safetensors",
        "w8a8-smoothquant/safetensors",
        "int8/compressed-tensors", "int4-g64-asym/compressed-tensors", "awq-int4-g64/compressed-tensors",
        "w8a8-smoothquant/compressed-tensors", "int8/gptq", "gptq-int4-g64-asym/gptq", "awq-int4-g64/awq",
        "f16/tiny-F16.gguf", "q8_0/tiny-Q8_0.gguf",
        "q4_k_m-imatrix/tiny-Q4_K_M.gguf",
    }
    for f in files:
        path = out / f["path"]
        size = sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size
        assert size == f["bytes"]


def test_dense_export_reloads_in_transformers_with_the_variants_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = HFCheckpoint.open(TINY)
    variant = Variant.model_validate({
        "name": "v", "exports": ["safetensors"],
        "weights": {"method": "rtn", "bits": 4, "symmetric": False, "granularity": "group", "group_size": 64},
    })
    built = build_variant(ckpt, variant, tmp_path, keep=tmp_path / "kept")
    in_memory = model_from_state(AutoModelForCausalLM.from_pretrained(TINY).config, _state(built))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "v" / "safetensors").eval()
    ids = torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a = in_memory(input_ids=ids).logits
        b = reloaded(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    original = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    with torch.inference_mode():
        assert (original(input_ids=ids).logits - a).abs().max() > 1e-3  # the variant really is quantized


def _state(built) -> dict[str, torch.Tensor]:
    """A built variant's kept weights, dequantized, by name."""
    return {name: built.weights.tensor(name) for name in built.weights.names}


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def test_gguf_tensors_decode_to_the_evaluated_weights(tmp_path):
    """gguf's own reader and dequantizer (independent of our writer) see the variant's weights."""
    ckpt = HFCheckpoint.open(TINY)
    variant = Variant.model_validate({"name": "g", "weights": {"method": "gguf", "type": "Q8_0"}, "exports": ["gguf"]})
    built = build_variant(ckpt, variant, tmp_path, keep=tmp_path / "kept")
    reader = GGUFReader(built.files[0])
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 1 + 1 + 6 * 9  # token_embd, output_norm, 9 per layer (tied: no output)
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    names = [t.name for t in reader.tensors]
    assert names[:2] == ["output_norm.weight", "token_embd.weight"] and names[2].startswith("blk.0.")

    def decoded(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))

    state = _state(built)
    np.testing.assert_array_equal(decoded("blk.2.attn_v.weight"), state["model.layers.2.self_attn.v_proj.weight"].numpy())
    np.testing.assert_array_equal(decoded("token_embd.weight"), state["model.embed_tokens.weight"].numpy())
    q = _unpermute(decoded("blk.1.attn_q.weight"), 4)
    k = _unpermute(decoded("blk.1.attn_k.weight"), 2)
    np.testing.assert_array_equal(q, state["model.layers.1.self_attn.q_proj.weight"].numpy())
    np.testing.assert_array_equal(k, state["model.layers.1.self_attn.k_proj.weight"].numpy())
    arch = reader.fields["general.architecture"].contents()
    assert arch == "llama"
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2
    assert reader.fields["general.file_type"].contents() == 7
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 8192


def test_same_recipe_gives_byte_identical_files(tmp_path):
    ckpt = HFCheckpoint.open(TINY)
    variant = Variant.model_validate({
        "name": "v", "weights": {"method": "gguf", "type": "Q8_0"}, "exports": ["gguf"],
    })
    dense = Variant.model_validate({"name": "d", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64},
                                    "exports": ["safetensors", "compressed-tensors", "gptq", "awq"]})

    def digest(folder):
        files = [p for p in sorted(folder.rglob("*")) if p.is_file()]
        return [(p.relative_to(folder).as_posix(), hashlib.sha256(p.read_bytes()).hexdigest()) for p in files]

    for run in ("a", "b"):
        build_variant(ckpt, variant, tmp_path / run)
        build_variant(ckpt, dense, tmp_path / run)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")


def test_targets_and_ignore_choose_the_modules_rtn_and_awq_quantize(tmp_path):
    from calib.text import sample_windows
    from conftest import BUNDLED
    from formats.hf import load_tokenizer

    ckpt = HFCheckpoint.open(TINY)
    rtn = Variant.model_validate({"name": "r", "weights": {"method": "rtn", "bits": 4, "targets": ["*.mlp.*"], "ignore": ["*.down_proj"]}})
    state = _state(build_variant(ckpt, rtn, tmp_path, keep=tmp_path / "r-kept"))
    for name, tensor in state.items():
        source = ckpt.tensor(name).float()
        quantized = ".mlp.gate_proj." in name or ".mlp.up_proj." in name
        assert torch.equal(tensor, source) != quantized, name
    windows = sample_windows(load_tokenizer(ckpt), BUNDLED / "calib.txt", 128, 2)
    awq = Variant.model_validate({"name": "a", "weights": {"method": "awq", "bits": 4, "group_size": 64, "ignore": ["*.self_attn.*"]}})
    state = _state(build_variant(ckpt, awq, tmp_path, keep=tmp_path / "a-kept", calibration=windows))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        levels = max(row.unique().numel() for row in state[name][:, :64])  # one group of 64 columns per row
        assert (levels <= 16) == (".mlp." in name), name  # the attention weights are scaled, not quantized


@pytest.mark.check
def test_rerun_keeps_finished_variants_and_redoes_what_changed(tmp_path, monkeypatch):
    """A rerun into the same folder rebuilds only variants whose recipe entry changed or whose
    files are gone, against the original's distributions kept from the first run; with nothing to
    do it loads no model at all."""
    from rich.console import Console

    import recipes.pipeline as pipeline
    from conftest import SMALL_RECIPE, write_recipe
    from recipes.schema import load_recipe

    variants = [
        {"name": "a", "weights": {"method": "rtn", "bits": 8}, "exports": ["safetensors"]},
        {"name": "b", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64}, "exports": ["gptq"]},
    ]
    recipe = dict(SMALL_RECIPE, variants=variants)
    recipe.pop("calibration")
    out = tmp_path / "out"
    built = []
    real_build = pipeline.build_variant

    def counting_build(ckpt, variant, *args, **kwargs):
        built.append(variant.name)
        return real_build(ckpt, variant, *args, **kwargs)

    monkeypatch.setattr(pipeline, "build_variant", counting_build)
    originals = []  # the original's scoring, which writes its distributions for the variants
    real_scores = pipeline.streamed_scores

    def counting_scores(ckpt, windows, reference=None, keep=None, **kwargs):
        originals.extend([keep] if keep is not None else [])
        return real_scores(ckpt, windows, reference, keep, **kwargs)

    monkeypatch.setattr(pipeline, "streamed_scores", counting_scores)

    def run(changes: dict | None = None) -> dict:
        r = dict(recipe, variants=[dict(v, **(changes or {}).get(v["name"], {})) for v in variants])
        report = pipeline.run_recipe(load_recipe(write_recipe(tmp_path, r)), out, Console(quiet=True))
        return {row.name: row for row in report.rows}

    first = run()
    assert built == ["a", "b"]
    with monkeypatch.context() as m:  # nothing to do: no model is even loaded
        m.setattr(pipeline, "load_causal_lm", lambda ckpt: pytest.fail("the model was loaded"))
        again = run()
    assert built == ["a", "b"]
    assert {n: r.scores for n, r in again.items()} == {n: r.scores for n, r in first.items()}
    assert (out / "report.json").is_file()
    # a changed entry redoes that variant only
    changed = run({"b": {"weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 128}}})
    assert built == ["a", "b", "b"] and changed["b"].scores != first["b"].scores
    assert changed["a"].scores == first["a"].scores
    assert len(originals) == 1 and (out / ".reference").is_dir() and changed["original"].scores == first["original"].scores
    # so does a missing or damaged export
    shutil.rmtree(out / "a" / "safetensors")
    run({"b": {"weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 128}}})
    assert built == ["a", "b", "b", "a"]
    # and a change of quantbench's own code redoes everything
    import recipes.resume as resume

    monkeypatch.setattr(resume, "_source_digest", lambda: "another version")
    run({"b": {"weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 128}}})
    assert built == ["a", "b", "b", "a", "a", "b"] and len(originals) == 2  # the original's store too


def test_html_report_holds_the_table_and_a_point_per_variant(small_run):
    import xml.etree.ElementTree as ET

    out, report = small_run
    page = (out / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    root = ET.fromstring(page.split("\n", 1)[1])  # well-formed: tools can read it
    ns = {"h": "http://www.w3.org/1999/xhtml", "s": "http://www.w3.org/2000/svg"}
    rows = root.find(".//h:table", ns).findall("h:tbody/h:tr", ns)  # the first table: one row per model
    assert [r.find("h:td", ns).text for r in rows] == [v["name"] for v in report["variants"]]
    compared = [v for v in report["variants"] if v["kld"] is not None]
    circles = root.findall(".//s:svg/s:circle", ns)
    assert len(circles) == len(compared) == len(report["variants"]) - 1  # every variant but the original
    # larger KLD sits higher on the chart (SVG y grows downwards); sizes run left to right
    by_name = {c.find("s:title", ns).text.split(":")[0]: (float(c.get("cx")), float(c.get("cy"))) for c in circles}
    assert by_name["int8"][1] > by_name["int4-g64-asym"][1]
    assert by_name["q4_k_m-imatrix"][0] < by_name["f16"][0]


def test_every_variant_records_where_quantization_hurt(small_run):
    """Per decoder Linear: weight error without calibration, the output error on calibration inputs
    where GPTQ, AWQ or SmoothQuant gathered them; nothing where no weight was quantized; the worst
    listed and mapped."""
    out, report = small_run
    rows = {r["name"]: r for r in report["variants"]}
    for name in ("int8", "int4-g64-asym", "q4_k_m-imatrix", "int4-g64-outliers"):
        assert rows[name]["error_measure"] == "relative weight error" and len(rows[name]["linear_errors"]) == 7 * 6
    for name in ("gptq-int4-g64-asym", "awq-int4-g64", "w8a8-smoothquant"):
        assert rows[name]["error_measure"] == "relative output error on calibration inputs"
        assert len(rows[name]["linear_errors"]) == 7 * 6
    for name in ("kv-int4", "original"):
        assert rows[name]["linear_errors"] == {} and rows[name]["error_measure"] is None
    median = lambda r: sorted(r["linear_errors"].values())[21]  # noqa: E731
    assert 0 < median(rows["int8"]) < 0.02 < median(rows["int4-g64-asym"]) < 0.3
    assert median(rows["int4-g64-outliers"]) < median(rows["int4-g64-asym"])  # its fp16 columns are exact
    md = (out / "report.md").read_text()
    assert "## Where it hurts" in md and "| gptq-int4-g64-asym | relative output error on calibration inputs |" in md
    assert (out / "report.html").read_text().count('data-chart="heatmap"') == sum(bool(r["linear_errors"]) for r in rows.values()) == 9


def test_output_error_from_the_hessian_is_the_error_of_the_outputs():
    from quant.error import relative_error

    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=g, dtype=torch.float64)
    x = torch.randn(100, 16, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, 16, dtype=torch.float64)
    q = w + 0.1 * torch.randn(8, 16, generator=g, dtype=torch.float64)
    direct = ((x @ (q - w).T).norm() / (x @ w.T).norm()).item()
    assert relative_error(w, q, x.T @ x) == pytest.approx(direct, rel=1e-9)
    assert relative_error(w, q) == pytest.approx(((q - w).norm() / w.norm()).item(), rel=1e-9)
