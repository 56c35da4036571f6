"""GPTQ and AWQ exports, loaded back by GPTQModel 7.6.0 (the maintained loader of both layouts) in
its own virtualenv (``bench/anchors/setup.sh gptqmodel``; ``make test`` creates it): every
quantized module's weight must equal ours rounded once to float16, the dtype of the file's scales,
and the loaded model must compute what our weights compute."""

import json

import pytest

from conftest import SMALL_RECIPE, TINY, write_recipe
from core.errors import InputError
from formats.hf import HFCheckpoint
from helpers.gptqmodel import assert_read_back_exactly, needs_gptqmodel, read_back
from recipes.schema import Variant, load_recipe
from recipes.variants import build_variant

@needs_gptqmodel
@pytest.mark.parametrize("variant, checkpoint_format", [("int8", "gptq"), ("gptq-int4-g64-asym", "gptq_v2")])
def test_gptqmodel_reads_our_gptq_files_back(small_run, variant, checkpoint_format):
    out, _ = small_run
    config = json.loads((out / variant / "gptq" / "quantize_config.json").read_text())
    # symmetric: v1, what every loader reads; asymmetric: v2, whose zero-points may be 0
    assert config["checkpoint_format"] == checkpoint_format
    assert config["desc_act"] == (variant == "gptq-int4-g64-asym")  # act-order groups travel as g_idx
    assert_read_back_exactly(read_back(out / variant, "gptq"))


@needs_gptqmodel
def test_three_bit_codes_straddle_words_as_autogptq_packs_them(tmp_path):
    weights = {"method": "rtn", "bits": 3, "granularity": "group", "group_size": 64}
    variant = Variant.model_validate({"name": "int3", "weights": weights, "exports": ["safetensors", "gptq"]})
    build_variant(HFCheckpoint.open(TINY), variant, tmp_path)
    assert_read_back_exactly(read_back(tmp_path / "int3", "gptq"))


@needs_gptqmodel
def test_gptqmodel_reads_a_gptq_file_whose_ignored_linears_stay_16_bit(tmp_path):
    """Linears a variant leaves unquantized are named in GPTQModel's ``dynamic`` as ``-:`` overrides:
    without them GPTQModel looks for their codes and refuses the folder. k_proj alone is part of a
    product vLLM fuses (qkv_proj), so its override names only the Linear."""
    weights = {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64, "ignore": ["*.mlp.down_proj", "*.k_proj"]}
    variant = Variant.model_validate({"name": "int4", "weights": weights, "exports": ["safetensors", "gptq"]})
    build_variant(HFCheckpoint.open(TINY), variant, tmp_path)
    dynamic = json.loads((tmp_path / "int4" / "gptq" / "quantize_config.json").read_text())["dynamic"]
    assert dynamic["-:model\\.layers\\.3\\.mlp\\.down_proj$"] == {} and len(dynamic) == 2 * 6
    assert "-:model\\.layers\\.3\\.self_attn\\.k_proj$" in dynamic  # not qkv_proj: q and v are quantized
    assert_read_back_exactly(read_back(tmp_path / "int4", "gptq"), modules=5 * 6)


@needs_gptqmodel
def test_gptqmodel_reads_our_awq_file_back_with_its_folded_norms(small_run):
    out, _ = small_run
    config = json.loads((out / "awq-int4-g64" / "awq" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "awq" and config["version"] == "gemm" and config["group_size"] == 64
    assert_read_back_exactly(read_back(out / "awq-int4-g64", "awq"))


@pytest.mark.parametrize("export, weights, activations, message", [
    ("gptq", {"method": "gguf", "type": "Q8_0"}, None, "a gptq export needs rtn, gptq, awq or qat weights"),
    ("gptq", {"method": "rtn", "bits": 5, "granularity": "group", "group_size": 64}, None, "GPTQ holds int2, int3, int4 and int8"),
    ("gptq", {"method": "rtn", "format": "fp8_e4m3"}, None, "GPTQ holds int2, int3, int4 and int8"),
    ("gptq", {"method": "rtn", "bits": 4, "granularity": "tensor"}, None, "granularity 'tensor'"),
    ("gptq", {"method": "rtn", "bits": 8}, {}, "its checkpoints are weight-only"),
    ("awq", {"method": "rtn", "bits": 8}, None, "AWQ holds int4"),
    ("awq", {"method": "rtn", "bits": 4}, None, "granularity 'channel' \\(AWQ takes groups\\)"),
    ("awq", {"method": "gptq", "bits": 4, "act_order": True}, None, "act-order groups"),
])
def test_variants_a_gptq_or_awq_file_cannot_hold_are_refused(tmp_path, export, weights, activations, message):
    variant = {"name": "v", "weights": weights, "exports": [export]}
    if activations is not None:
        variant["activations"] = activations
    with pytest.raises(InputError, match=message):
        load_recipe(write_recipe(tmp_path, dict(SMALL_RECIPE, variants=[variant])))
