"""compressed-tensors exports, read back by the compressed-tensors package (an independent decoder
of the packing) and by transformers, which loads them as vLLM's users would write them."""

import json

import pytest
import torch
from safetensors.torch import load_file

from formats.compressed_tensors import pack_codes
from recipes.schema import load_recipe
from conftest import SMALL_RECIPE, write_recipe
from quant.types import InputError

compressed_tensors = pytest.importorskip("compressed_tensors", reason="compressed-tensors is the 'interop' extra (make test installs it)")
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402

EXPORTED = ["int8", "int4-g64-asym", "awq-int4-g64"]


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
    assert config["quantization_config"]["format"] == "pack-quantized" and config["dtype"] == "float16"
    assert config["quantization_config"]["ignore"] == ["lm_head"]
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


@pytest.mark.parametrize("weights, message", [
    ({"method": "gguf", "type": "Q4_K_M"}, "needs rtn, gptq or awq weights"),
    ({"method": "rtn", "bits": 4, "format": "nf4", "granularity": "group", "group_size": 64}, "nf4 weights are not integer codes"),
    ({"method": "rtn", "bits": 8, "granularity": "block", "group_size": 32}, "granularity 'block'"),
    ({"method": "gptq", "bits": 4, "act_order": True}, "use static_groups: true"),
    ({"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64, "outliers": {}}, "outlier columns"),
])
def test_variants_a_compressed_tensors_file_cannot_hold_are_refused(tmp_path, weights, message):
    recipe = dict(SMALL_RECIPE, variants=[{"name": "v", "weights": weights, "exports": ["compressed-tensors"]}])
    with pytest.raises(InputError, match=message):
        load_recipe(write_recipe(tmp_path, recipe))
