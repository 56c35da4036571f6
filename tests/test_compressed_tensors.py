"""compressed-tensors exports, read back by the compressed-tensors package (an independent decoder
of the packing) and by transformers, which loads them as vLLM's users would write them."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL_RECIPE, TINY, write_recipe
from core.errors import InputError
from formats.hf import HFCheckpoint
from formats.packing import pack_codes
from recipes.schema import Variant, load_recipe
from recipes.variants import build_variant

compressed_tensors = pytest.importorskip("compressed_tensors", reason="compressed-tensors is the 'interop' extra (make test installs it)")
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402

EXPORTED = {"int8": "pack-quantized", "int4-g64-asym": "pack-quantized", "awq-int4-g64": "pack-quantized",
            "w8a8-smoothquant": "int-quantized"}


@pytest.mark.parametrize("bits", range(2, 9))
def test_packing_is_what_compressed_tensors_unpacks(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (5, 200), generator=gen, dtype=torch.uint8)  # 200: not a multiple of 32
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (5, -(-200 * bits // 32))
    # compressed-tensors' codes are signed: level - 2**(bits-1)
    signed = unpack_from_int32(packed, bits, torch.Size((5, 200)))
    assert torch.equal(signed.to(torch.int16) + 2 ** (bits - 1), codes.to(torch.int16))


def test_zero_points_pack_along_the_output_dimension():
    zeros = torch.randint(0, 16, (40, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_codes(zeros.T.contiguous(), 4).T
    assert packed.shape == (5, 3)
    signed = unpack_from_int32(packed.contiguous(), 4, torch.Size((40, 3)), packed_dim=0)
    assert torch.equal(signed.to(torch.int16) + 8, zeros.to(torch.int16))


@pytest.mark.parametrize("variant", EXPORTED)
def test_transformers_dequantizes_the_export_to_our_weights(small_run, variant):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out, _ = small_run
    folder = out / variant / "compressed-tensors"
    config = json.loads((folder / "config.json").read_text())
    quantization = config["quantization_config"]
    assert quantization["format"] == EXPORTED[variant] and config["dtype"] == "float16"
    assert quantization["ignore"] == ["lm_head"]
    inputs = quantization["config_groups"]["group_0"]["input_activations"]
    assert (inputs is not None) == (variant == "w8a8-smoothquant")  # W8A8: int8 per-token dynamic activations
    dense = load_file(out / variant / "safetensors" / "model.safetensors")  # our float32 weights, as evaluated
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    state = model.state_dict()
    assert set(dense) <= set(state)
    for name, weights in dense.items():
        # the file's float16 scales, zero-points and codes give our weights, rounded once to float16
        assert torch.equal(state[name], weights.half().float()), name


def test_transformers_runs_the_packed_weights_without_unpacking_them_first(small_run):
    from transformers import AutoModelForCausalLM

    from formats.hf import HFCheckpoint, load_causal_lm

    out, _ = small_run
    packed = AutoModelForCausalLM.from_pretrained(out / "int8" / "compressed-tensors", dtype=torch.float32).eval()
    assert "model.layers.0.mlp.down_proj.weight_packed" in packed.state_dict()
    dense = load_causal_lm(HFCheckpoint.open(out / "int8" / "safetensors"))
    ids = torch.arange(96)[None] * 37 % 8000
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, dense(ids).logits, rtol=0, atol=1e-3)


@pytest.mark.parametrize("granularity, group_size", [("channel", None), ("block", 128)])
def test_fp8_weights_export_as_float_quantized(tmp_path, granularity, group_size):
    """FP8 weights per channel (vLLM's FP8 W8A16, FP8_DYNAMIC with fp8 activations) and in
    128x128 blocks (FP8_BLOCK, DeepSeek-V3's): float8_e4m3fn codes with float32 scales, so
    transformers' dequantization gives our weights exactly."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    weights = {"method": "rtn", "format": "fp8_e4m3", "granularity": granularity, "group_size": group_size}
    variant = Variant.model_validate({"name": "fp8", "weights": weights, "exports": ["compressed-tensors"]})
    kept = build_variant(HFCheckpoint.open(TINY), variant, tmp_path, keep=tmp_path / "kept").weights
    folder = tmp_path / "fp8" / "compressed-tensors"
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quantization["format"] == "float-quantized"
    assert quantization["config_groups"]["group_0"]["weights"]["block_structure"] == ([128, 128] if group_size else None)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    state = model.state_dict()
    quantized = [n for n in kept.names if n.endswith("proj.weight")]
    assert len(quantized) == 7 * 6
    for name in quantized:
        assert torch.equal(state[name], kept.tensor(name)), name


@pytest.mark.parametrize("weights, activations, message", [
    ({"method": "gguf", "type": "Q4_K_M"}, None, "needs rtn, gptq, awq or qat weights"),
    ({"method": "rtn", "bits": 4, "format": "nf4", "granularity": "group", "group_size": 64}, None, "nf4 weights"),
    ({"method": "rtn", "bits": 8, "granularity": "block", "group_size": 32}, None, "granularity 'block' integer weights"),
    ({"method": "rtn", "format": "fp8_e4m3", "granularity": "group", "group_size": 64}, None, "fp8 weights by group"),
    ({"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64}, {}, "int8 activations with int4-g64-sym weights"),
    ({"method": "rtn", "bits": 8}, {"format": "fp8"}, "fp8 activations take fp8_e4m3 weights"),
    ({"method": "gptq", "bits": 4, "act_order": True}, None, "use static_groups: true"),
    ({"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64, "outliers": {}}, None, "outlier columns"),
])
def test_variants_a_compressed_tensors_file_cannot_hold_are_refused(tmp_path, weights, activations, message):
    variant = {"name": "v", "weights": weights, "exports": ["compressed-tensors"]}
    if activations is not None:
        variant["activations"] = activations
    recipe = dict(SMALL_RECIPE, variants=[variant])
    with pytest.raises(InputError, match=message):
        load_recipe(write_recipe(tmp_path, recipe))
