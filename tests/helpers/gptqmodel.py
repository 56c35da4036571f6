"""GPTQModel 7.6.0, the maintained loader of GPTQ and AWQ files, in its own virtualenv
(``bench/anchors/setup.sh gptqmodel``; ``make test`` creates it): its read-back of our files."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import REPO

GPTQMODEL = REPO / ".anchors" / "gptqmodel" / "bin" / "python"


_missing = pytest.mark.skipif(not GPTQMODEL.exists(), reason="GPTQModel's venv: bench/anchors/setup.sh gptqmodel (make test runs it)")


def needs_gptqmodel(test):
    """A test that runs GPTQModel: in the anchor tier, skipped where its venv is missing."""
    return pytest.mark.anchor(_missing(test))


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
