"""GPTQ exports, loaded back by GPTQModel 7.6.0 (the maintained GPTQ loader) in its own virtualenv
(``bench/anchors/setup.sh gptqmodel``; ``make test`` creates it): every quantized module's
dequantized weight must equal ours rounded once to float16, the dtype of the file's scales."""

import json
import subprocess

import pytest

from conftest import REPO, SMALL_RECIPE, TINY, write_recipe
from formats.hf import HFCheckpoint
from quant.types import InputError
from recipes.schema import Variant, load_recipe
from recipes.variants import build_variant

GPTQMODEL = REPO / ".anchors" / "gptqmodel" / "bin" / "python"
needs_gptqmodel = pytest.mark.skipif(not GPTQMODEL.exists(), reason="GPTQModel's venv: bench/anchors/setup.sh gptqmodel (make test runs it)")

# Runs in GPTQModel's venv: loads FOLDER/gptq on the CPU with its torch kernel and compares each
# quantized module's dequantize_weight() with FOLDER/safetensors, our float32 weights as evaluated.
READ_BACK = r"""
import json, sys, torch
from pathlib import Path
from gptqmodel import BACKEND, GPTQModel
from safetensors.torch import load_file
folder = Path(sys.argv[1])
ours = load_file(str(folder / "safetensors" / "model.safetensors"))
model = GPTQModel.load(str(folder / "gptq"), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16).model
report = {"modules": 0, "equal": 0, "max_diff": 0.0}
for prefix, module in model.named_modules():
    if hasattr(module, "qweight") and hasattr(module, "dequantize_weight"):
        with torch.no_grad():
            theirs = module.dequantize_weight().t().float()
        expected = ours[prefix + ".weight"].half().float()
        report["modules"] += 1
        report["equal"] += int(torch.equal(theirs, expected))
        report["max_diff"] = max(report["max_diff"], float((theirs - expected).abs().max()))
print(json.dumps(report))
"""


def read_back(folder) -> dict:
    run = subprocess.run([str(GPTQMODEL), "-c", READ_BACK, str(folder)], capture_output=True, text=True, cwd=folder)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@needs_gptqmodel
@pytest.mark.parametrize("variant, checkpoint_format", [("int8", "gptq"), ("gptq-int4-g64-asym", "gptq_v2")])
def test_gptqmodel_reads_our_weights_back(small_run, variant, checkpoint_format):
    out, _ = small_run
    config = json.loads((out / variant / "gptq" / "quantize_config.json").read_text())
    # symmetric: v1, what every loader reads; asymmetric: v2, whose zero-points may be 0
    assert config["checkpoint_format"] == checkpoint_format
    assert config["desc_act"] == (variant == "gptq-int4-g64-asym")  # act-order groups travel as g_idx
    report = read_back(out / variant)
    assert report["modules"] == 7 * 6 and report["equal"] == report["modules"], report


@needs_gptqmodel
def test_three_bit_codes_straddle_words_as_autogptq_packs_them(tmp_path):
    weights = {"method": "rtn", "bits": 3, "granularity": "group", "group_size": 64}
    variant = Variant.model_validate({"name": "int3", "weights": weights, "exports": ["safetensors", "gptq"]})
    build_variant(HFCheckpoint.open(TINY), variant, tmp_path, keep_weights=False)
    report = read_back(tmp_path / "int3")
    assert report["modules"] == 7 * 6 and report["equal"] == report["modules"], report


@pytest.mark.parametrize("weights, activations, message", [
    ({"method": "gguf", "type": "Q8_0"}, None, "a gptq export needs rtn, gptq or awq weights"),
    ({"method": "rtn", "bits": 5, "granularity": "group", "group_size": 64}, None, "GPTQ holds int2, int3, int4 and int8"),
    ({"method": "rtn", "format": "fp8_e4m3"}, None, "GPTQ holds int2, int3, int4 and int8"),
    ({"method": "rtn", "bits": 4, "granularity": "tensor"}, None, "granularity 'tensor'"),
    ({"method": "rtn", "bits": 8}, {}, "GPTQ checkpoints are weight-only"),
])
def test_variants_a_gptq_file_cannot_hold_are_refused(tmp_path, weights, activations, message):
    variant = {"name": "v", "weights": weights, "exports": ["gptq"]}
    if activations is not None:
        variant["activations"] = activations
    with pytest.raises(InputError, match=message):
        load_recipe(write_recipe(tmp_path, dict(SMALL_RECIPE, variants=[variant])))
