"""bitsandbytes 4-bit exports against what transformers itself writes for the same model loaded
with ``BitsAndBytesConfig(load_in_4bit=True)``: the same tensors, byte for byte, and transformers
loads ours into bitsandbytes' Linear4bit with the same logits."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL_RECIPE, TINY, write_recipe
from core.errors import InputError
from formats.hf import HFCheckpoint
from formats.inspect import inspect_file
from recipes.schema import Variant, load_recipe
from recipes.variants import build_variant

pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the 'dev' extra (make test installs it)")


@pytest.mark.parametrize("fmt", ["nf4", "fp4"])
def test_export_is_what_transformers_writes_with_bitsandbytes(tmp_path, fmt):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    weights = {"method": "rtn", "format": fmt, "granularity": "group", "group_size": 64}
    built = build_variant(HFCheckpoint.open(TINY), Variant.model_validate({"name": "v", "weights": weights, "exports": ["bitsandbytes"]}),
                          tmp_path)
    folder = tmp_path / "v" / "bitsandbytes"
    summary = inspect_file(folder / "model.safetensors")  # two codes a byte, absmax and tables as cost
    assert summary.quantization == f"bitsandbytes {fmt}"
    assert summary.bits_per_weight == pytest.approx(built.bits_per_weight, rel=0.002)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=fmt, bnb_4bit_compute_dtype=torch.bfloat16)
    theirs_model = AutoModelForCausalLM.from_pretrained(TINY, quantization_config=config, device_map="cpu")
    theirs_model.save_pretrained(tmp_path / "theirs")
    ours, theirs = load_file(folder / "model.safetensors"), load_file(tmp_path / "theirs" / "model.safetensors")
    assert set(ours) == set(theirs)
    assert [name for name in theirs if not torch.equal(ours[name], theirs[name])] == []
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["bnb_4bit_quant_type"] == fmt

    loaded = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
    assert type(loaded.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    ids = torch.arange(64)[None] * 37 % 8000
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, theirs_model(ids).logits)


@pytest.mark.parametrize("weights, message", [
    ({"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64}, "bitsandbytes 4-bit holds nf4 and fp4"),
    ({"method": "rtn", "format": "nf4", "granularity": "channel"}, "bitsandbytes takes groups of"),
    ({"method": "rtn", "format": "nf4", "granularity": "group", "group_size": 48}, "bitsandbytes takes groups of"),
    ({"method": "gptq", "bits": 4, "format": "nf4", "group_size": 64, "act_order": True}, "act-order groups"),
])
def test_variants_a_bitsandbytes_file_cannot_hold_are_refused(tmp_path, weights, message):
    variant = {"name": "v", "weights": weights, "exports": ["bitsandbytes"]}
    with pytest.raises(InputError, match=message):
        load_recipe(write_recipe(tmp_path, dict(SMALL_RECIPE, variants=[variant])))
