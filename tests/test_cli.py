"""The `quantize` command: its forms, and one clear line with exit status 2 for every bad input."""

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SMALL_RECIPE, TINY, write_recipe
from helpers.cli import assert_user_error, quantize


def recipe_with(tmp_path, **changes):
    recipe = copy.deepcopy(SMALL_RECIPE)
    recipe["evaluation"]["max_windows"] = 1
    recipe["variants"] = recipe["variants"][:1]
    recipe.update(changes)
    return recipe


def run_bad(monkeypatch, capsys, tmp_path, recipe_text: str | dict, *fragments: str):
    path = tmp_path / "bad.yaml"
    if isinstance(recipe_text, dict):
        path = write_recipe(tmp_path, recipe_text, "bad.yaml")
    else:
        path.write_text(recipe_text)
    out = tmp_path / "out"
    assert_user_error(quantize(monkeypatch, capsys, path, "--out", out), *fragments)
    assert not out.exists() or not any(out.rglob("*")), "a failed run left files behind"


@pytest.mark.check
def test_help_shows_the_recipe_form(monkeypatch, capsys):
    code, out, _ = quantize(monkeypatch, capsys, "--help")
    assert code == 0
    assert "quantize RECIPE.yaml" in out and "inspect" in out


@pytest.mark.check
def test_missing_recipe_file(monkeypatch, capsys, tmp_path):
    assert_user_error(quantize(monkeypatch, capsys, tmp_path / "nope.yaml"), "nope.yaml", "not found")


@pytest.mark.check
def test_malformed_yaml(monkeypatch, capsys, tmp_path):
    run_bad(monkeypatch, capsys, tmp_path, "model: [unclosed\nvariants: {", "bad.yaml", "malformed YAML", "line")


@pytest.mark.check
def test_recipe_nested_too_deeply(monkeypatch, capsys, tmp_path):
    run_bad(monkeypatch, capsys, tmp_path, "model: " + "[" * 5000 + "]" * 5000 + "\n", "bad.yaml", "nested too deeply")


@pytest.mark.check
def test_recipe_that_is_not_a_mapping(monkeypatch, capsys, tmp_path):
    run_bad(monkeypatch, capsys, tmp_path, "- just\n- a list\n", "bad.yaml", "mapping")


@pytest.mark.check
def test_unknown_top_level_field(monkeypatch, capsys, tmp_path):
    run_bad(monkeypatch, capsys, tmp_path, recipe_with(tmp_path, modle="x"), "unknown field 'modle'")


@pytest.mark.check
def test_unknown_field_in_a_variant(monkeypatch, capsys, tmp_path):
    recipe = recipe_with(tmp_path)
    recipe["variants"][0]["weights"]["bitz"] = 4
    run_bad(monkeypatch, capsys, tmp_path, recipe, "unknown field 'variants[0](int8).weights.bitz'")


@pytest.mark.check
@pytest.mark.parametrize(
    "weights, fragment",
    [
        ({"method": "rtn", "bits": 9}, "variants[0](int8).weights.bits"),
        ({"method": "sparsegpt", "bits": 4}, "variants[0](int8).weights"),
        ({"method": "gguf", "type": "Q9_9"}, "variants[0](int8).weights.type"),
        ({"method": "rtn", "bits": 4, "granularity": "group"}, "needs group_size"),
        ({"method": "rtn", "bits": 4, "granularity": "group", "group_size": 96}, "group_size 96 does not divide"),
        ({"method": "rtn", "format": "fp8_e4m3", "bits": 4}, "field 'variants[0](int8).weights.bits': format 'fp8_e4m3' is 8 bits wide"),
        ({"method": "rtn", "format": "nf4", "symmetric": False}, "field 'variants[0](int8).weights.symmetric'"),
        ({"method": "rtn", "bits": 8, "granularity": "block", "group_size": 96},
         "variant 'int8': block size 96 does not divide the shape 256x768 of tensor 'model.layers.0.mlp.down_proj.weight'"),
    ],
)
def test_unknown_or_invalid_values(monkeypatch, capsys, tmp_path, weights, fragment):
    recipe = recipe_with(tmp_path)
    recipe["variants"][0].update(weights=weights, exports=["safetensors"])
    run_bad(monkeypatch, capsys, tmp_path, recipe, fragment)


@pytest.mark.check
@pytest.mark.parametrize(
    "variant, fragment",
    [
        ({"weights": {"method": "awq", "bits": 4}, "activations": {}}, "activations need rtn or gptq weights, not awq"),
        ({"weights": {"method": "rtn", "bits": 8}, "activations": {"format": "int4"}}, "variants[0](int8).activations.format"),
        ({"weights": {"method": "rtn", "bits": 8}, "activations": {"smoothquant": 1.5}}, "variants[0](int8).activations.smoothquant"),
        ({"weights": {"method": "none"}, "kv_cache": {"format": "q8_0"}}, "variants[0](int8).kv_cache.format"),
        ({"weights": {"method": "none"}, "exports": ["gptq"]}, "a gptq export needs rtn, gptq, awq or qat weights, not none"),
        ({"weights": {"method": "rtn", "bits": 4, "outliers": {}}, "activations": {}}, "outliers (16-bit weight columns) are for weight-only"),
        ({"weights": {"method": "rtn", "bits": 4, "outliers": {"threshold": -1}}}, "variants[0](int8).weights.outliers.threshold"),
    ],
)
def test_invalid_activations_and_outliers(monkeypatch, capsys, tmp_path, variant, fragment):
    recipe = recipe_with(tmp_path)
    recipe["variants"] = [{"name": "int8", **variant}]
    run_bad(monkeypatch, capsys, tmp_path, recipe, fragment)


@pytest.mark.check
def test_outliers_without_calibration_text(monkeypatch, capsys, tmp_path):
    recipe = recipe_with(tmp_path)
    recipe.pop("calibration")
    recipe["variants"] = [{"name": "o", "weights": {"method": "rtn", "bits": 4, "outliers": {}}}]
    run_bad(monkeypatch, capsys, tmp_path, recipe, "variant 'o' is fitted on calibration text")


@pytest.mark.check
def test_gguf_export_of_an_rtn_variant_is_refused(monkeypatch, capsys, tmp_path):
    recipe = recipe_with(tmp_path)
    recipe["variants"][0]["exports"] = ["gguf"]
    run_bad(monkeypatch, capsys, tmp_path, recipe, "gguf export needs")


@pytest.mark.check
def test_imatrix_without_calibration_text(monkeypatch, capsys, tmp_path):
    recipe = recipe_with(tmp_path)
    recipe.pop("calibration")
    recipe["variants"] = [{"name": "k", "weights": {"method": "gguf", "type": "Q4_K_M", "imatrix": True}}]
    run_bad(monkeypatch, capsys, tmp_path, recipe, "variant 'k' is fitted on calibration text", "calibration")


@pytest.mark.check
def test_gptq_target_pattern_that_matches_no_module(monkeypatch, capsys, tmp_path):
    recipe = recipe_with(tmp_path)
    recipe["variants"] = [{"name": "g", "weights": {"method": "gptq", "bits": 4, "targets": ["*.mlp.gate"]}}]
    run_bad(monkeypatch, capsys, tmp_path, recipe, "variant 'g'", "pattern '*.mlp.gate' matches no Linear module",
            "e.g. 'model.layers.0.")


@pytest.mark.check
def test_calibration_text_shorter_than_a_window(monkeypatch, capsys, tmp_path):
    recipe = recipe_with(tmp_path)
    short = tmp_path / "short.txt"
    short.write_text("Only a few words of calibration text.")
    recipe["calibration"] = {"text": str(short)}
    recipe["variants"] = [{"name": "g", "weights": {"method": "gptq", "bits": 4}}]
    run_bad(monkeypatch, capsys, tmp_path, recipe, "short.txt", "shorter than one window of 512 tokens")


@pytest.mark.check
def test_duplicate_variant_names(monkeypatch, capsys, tmp_path):
    recipe = recipe_with(tmp_path)
    recipe["variants"] = recipe["variants"] * 2
    run_bad(monkeypatch, capsys, tmp_path, recipe, "repeated: int8")


@pytest.mark.check
def test_a_matrix_expands_a_variant_template_into_one_variant_per_combination(tmp_path):
    from recipes.schema import load_recipe

    recipe = recipe_with(tmp_path)
    recipe["variants"] = [
        {"name": "gptq", "weights": {"method": "gptq", "symmetric": False}, "matrix": {"bits": [2, 3, 4], "group_size": [32, 128]},
         "exports": ["gptq"]},
        recipe["variants"][0],
    ]
    variants = load_recipe(write_recipe(tmp_path, recipe)).variants
    assert [v.name for v in variants] == ["gptq-w2-g32", "gptq-w2-g128", "gptq-w3-g32", "gptq-w3-g128",
                                          "gptq-w4-g32", "gptq-w4-g128", "int8"]
    assert [(v.weights.bits, v.weights.group_size, v.weights.symmetric) for v in variants[:2]] == [(2, 32, False), (2, 128, False)]
    assert all(v.exports == ["gptq"] for v in variants[:6])


@pytest.mark.check
@pytest.mark.parametrize(
    "matrix, fragment",
    [
        ([4, 8], "field 'variants[0](gptq).matrix': a mapping of weights fields"),
        ({"bits": []}, "field 'variants[0](gptq).matrix.bits': a non-empty list"),
        ({"damp": [0.01], "method": ["rtn"]}, "field 'variants[0](gptq).matrix.method': also set in 'weights'"),
        ({"bits": [4], "bitz": [4]}, "unknown field 'variants[0](gptq-w4-bitz4).weights.bitz'"),
        ({"bits": [4, 9]}, "variants[1](gptq-w9).weights.bits"),
    ],
)
def test_a_bad_matrix_is_refused_with_the_field(monkeypatch, capsys, tmp_path, matrix, fragment):
    recipe = recipe_with(tmp_path)
    recipe["variants"] = [{"name": "gptq", "weights": {"method": "gptq", "group_size": 64}, "matrix": matrix}]
    run_bad(monkeypatch, capsys, tmp_path, recipe, fragment)


def model_copy(tmp_path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(TINY, dest)
    for p in dest.iterdir():
        p.chmod(0o644)
    return dest


@pytest.mark.check
def test_model_folder_without_config(monkeypatch, capsys, tmp_path):
    model = model_copy(tmp_path)
    (model / "config.json").unlink()
    run_bad(monkeypatch, capsys, tmp_path, recipe_with(tmp_path, model=str(model)), "model", "no config.json")


@pytest.mark.check
def test_model_folder_without_weights(monkeypatch, capsys, tmp_path):
    model = model_copy(tmp_path)
    (model / "model.safetensors").unlink()
    run_bad(monkeypatch, capsys, tmp_path, recipe_with(tmp_path, model=str(model)), "no *.safetensors weights")


@pytest.mark.check
def test_missing_model_folder(monkeypatch, capsys, tmp_path):
    run_bad(monkeypatch, capsys, tmp_path, recipe_with(tmp_path, model=str(tmp_path / "absent")), "absent", "not found")


@pytest.mark.check
def test_truncated_safetensors(monkeypatch, capsys, tmp_path):
    model = model_copy(tmp_path)
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    run_bad(monkeypatch, capsys, tmp_path, recipe_with(tmp_path, model=str(model)), "model.safetensors", "truncated")


@pytest.mark.check
def test_nan_weights_leave_no_partial_files(monkeypatch, capsys, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    model = model_copy(tmp_path)
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.3.mlp.up_proj.weight"][5, 7] = float("nan")
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    recipe = recipe_with(tmp_path, model=str(model))
    recipe["variants"] = [{"name": "q8", "weights": {"method": "gguf", "type": "Q8_0"}, "exports": ["gguf"]},
                          {"name": "d", "weights": {"method": "rtn", "bits": 8}, "exports": ["safetensors"]}]
    path = write_recipe(tmp_path, recipe, "nan.yaml")
    out = tmp_path / "out"
    assert_user_error(quantize(monkeypatch, capsys, path, "--out", out), "model.layers.3.mlp.up_proj.weight", "NaN")
    assert not [p for p in out.rglob("*") if p.is_file()]
    assert torch.isnan(tensors["model.layers.3.mlp.up_proj.weight"]).any()


@pytest.mark.check
def test_missing_evaluation_text(monkeypatch, capsys, tmp_path):
    recipe = recipe_with(tmp_path)
    recipe["evaluation"]["text"] = str(tmp_path / "missing.txt")
    run_bad(monkeypatch, capsys, tmp_path, recipe, "missing.txt", "not found")


def test_inspect_gguf_and_safetensors(monkeypatch, capsys, small_run):
    out, _ = small_run
    code, text, _ = quantize(monkeypatch, capsys, "inspect", out / "q8_0" / "tiny-Q8_0.gguf")
    assert code == 0
    assert "general.architecture" in text and "blk.0.attn_q.weight" in text and "Q8_0" in text
    code, text, _ = quantize(monkeypatch, capsys, "inspect", TINY / "model.safetensors")
    assert code == 0
    assert "model.layers.0.self_attn.q_proj.weight" in text and "BF16" in text and "256x256" in text


def test_inspect_counts_packed_weights_of_quantized_checkpoints(monkeypatch, capsys, small_run):
    out, report = small_run
    row = next(r for r in report["variants"] if r["name"] == "int4-g64-asym")
    code, text, _ = quantize(monkeypatch, capsys, "inspect", out / "int4-g64-asym" / "compressed-tensors" / "model.safetensors")
    assert code == 0 and "(compressed-tensors pack-quantized int4 g64)" in text
    # the file's bytes over the weights its int32 words hold: what the report counted for the variant
    bits = float(text.split(" bits per weight")[0].split()[-1])
    assert bits == pytest.approx(row["bits_per_weight"], rel=0.005)
    code, text, _ = quantize(monkeypatch, capsys, "inspect", out / "gptq-int4-g64-asym" / "gptq" / "model.safetensors")
    assert code == 0 and "(gptq int4 g64)" in text


def test_inspect_bad_files(monkeypatch, capsys, tmp_path, small_run):
    out, _ = small_run
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 100)
    assert_user_error(quantize(monkeypatch, capsys, "inspect", junk), "junk.bin", "neither a GGUF nor a safetensors")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((out / "q8_0" / "tiny-Q8_0.gguf").read_bytes()[:5000])
    assert_user_error(quantize(monkeypatch, capsys, "inspect", cut), "cut.gguf")
    assert_user_error(quantize(monkeypatch, capsys, "inspect", tmp_path / "none.gguf"), "none.gguf", "not found")


def test_console_script_exits_2_without_a_traceback(tmp_path):
    """The installed `quantize` entry point itself, in a fresh process."""
    exe = Path(sys.executable).with_name("quantize")
    if not exe.exists():
        pytest.skip("quantize console script not installed in this environment (pip install -e .)")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\nvariants: [\n")
    proc = subprocess.run([str(exe), str(bad)], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error: ") and "bad.yaml" in proc.stderr


@pytest.mark.check
def test_usage_errors_exit_2(monkeypatch, capsys):
    code, _, err = quantize(monkeypatch, capsys, "inspect")
    assert code == 2 and "Missing argument" in err and "Traceback" not in err
    code, _, err = quantize(monkeypatch, capsys, "recipes/demo.yaml", "--bogus")
    assert code == 2 and "No such option" in err
