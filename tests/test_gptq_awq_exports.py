"""GPTQ and AWQ exports, loaded back by GPTQModel 7.6.0 (the maintained loader of both layouts) in
its own virtualenv (``bench/anchors/setup.sh gptqmodel``; ``make test`` creates it): every
quantized module's weight must equal ours rounded once to float16, the dtype of the file's scales,
and the loaded model must compute what our weights compute."""

import json
import subprocess

import pytest

from conftest import REPO, SMALL_RECIPE, TINY, write_recipe
from core.errors import InputError
from formats.hf import HFCheckpoint
from recipes.schema import Variant, load_recipe
from recipes.variants import build_variant

GPTQMODEL = REPO / ".anchors" / "gptqmodel" / "bin" / "python"
needs_gptqmodel = pytest.mark.skipif(not GPTQMODEL.exists(), reason="GPTQModel's venv: bench/anchors/setup.sh gptqmodel (make test runs it)")

# Runs in GPTQModel's venv: loads FOLDER/FORMAT on the CPU with GPTQModel's torch kernels, compares
# each quantized module's dequantized weight with FOLDER/safetensors (our float32 weights as
# evaluated), and the float16 model's logits with transformers' on those float32 weights.
READ_BACK = r"""
import json, sys, torch
from pathlib import Path
from gptqmodel import BACKEND, GPTQModel
from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
folder, fmt = Path(sys.argv[1]), sys.argv[2]
ours = load_file(str(folder / "safetensors" / "model.safetensors"))
model = GPTQModel.load(str(folder / fmt), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16).model.eval()
report = {"modules": 0, "equal": 0, "max_diff": 0.0}
for prefix, module in model.named_modules():
    if not hasattr(module, "qweight"):
        continue
    with torch.no_grad():
        if fmt == "gptq":
            theirs = module.dequantize_weight().t().float()
        else:
            theirs = dequantize_gemm(module.qweight, module.qzeros, module.scales, module.bits, module.group_size).t().float()
    name = prefix + ".weight"
    if name not in ours:  # Phi-3's gate_up_proj, stored as the gate_proj and up_proj GPTQModel reads
        fused = ours[prefix.rsplit(".", 1)[0] + ".gate_up_proj.weight"]
        name, half = None, fused.shape[0] // 2
        expected = (fused[:half] if prefix.endswith("gate_proj") else fused[half:]).half().float()
    else:
        expected = ours[name].half().float()
    report["modules"] += 1
    report["equal"] += int(torch.equal(theirs, expected))
    report["max_diff"] = max(report["max_diff"], float((theirs - expected).abs().max()))
reference = AutoModelForCausalLM.from_pretrained(str(folder / "safetensors"), dtype=torch.float32).eval()
half = AutoModelForCausalLM.from_pretrained(str(folder / "safetensors"), dtype=torch.float16).eval()
ids = torch.arange(128)[None] * 37 % 8000
with torch.no_grad():
    a, b, c = model(input_ids=ids).logits.float(), reference(input_ids=ids).logits, half(input_ids=ids).logits.float()
report["logits_max_diff"] = float((a - b).abs().max())
report["logits_max"] = float(b.abs().max())
report["float16_logits_max_diff"] = float((c - b).abs().max())  # the same weights in float16, through transformers
print(json.dumps(report))
"""


def read_back(folder, fmt: str) -> dict:
    run = subprocess.run([str(GPTQMODEL), "-c", READ_BACK, str(folder), fmt], capture_output=True, text=True, cwd=folder)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def assert_read_back_exactly(report: dict, modules: int = 7 * 6) -> None:
    assert report["modules"] == modules and report["equal"] == report["modules"], report
    # float16 arithmetic against float32 on the same weights: no further than transformers' own
    # float16 run of them, or 1% of the largest logit (a missing folded norm moves it by units)
    assert report["logits_max_diff"] < 0.01 * report["logits_max"] + 2 * report["float16_logits_max_diff"], report


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
