"""QAT: training moves the model closer to the original than the grid it starts from, the export
holds exactly the trained grid (read back by transformers through compressed-tensors), and bad
settings stop the job in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from calib.text import sample_windows, token_windows
from conftest import BUNDLED, EVAL_TEXT, TINY, write_recipe
from evalsuite.metrics import causal_lm_logprobs, score
from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer, model_from_state
from quant.qat import QATSettings, qat_model
from quant.rtn import quantize_rtn
from quant.types import QuantizedTensor, QuantSpec, dequantized

SPEC = QuantSpec(2, False, "group", 64)


@pytest.fixture(scope="module")
def tiny():
    ckpt = HFCheckpoint.open(TINY)
    tok = load_tokenizer(ckpt)
    return ckpt, load_causal_lm(ckpt), sample_windows(tok, BUNDLED / "calib.txt", 256, 8), token_windows(tok, EVAL_TEXT, 256, 4)


def _model(model, tensors):
    state = {n: p.detach().clone() for n, p in model.state_dict().items()}
    state.update({n: dequantized(p) for n, p in tensors.items()})
    return model_from_state(model.config, state)


def test_training_brings_the_layers_closer_to_the_original_than_their_starting_grid(tiny):
    ckpt, model, calib, evaluation = tiny
    losses: dict[str, list[float]] = {}
    layers = list(qat_model(ckpt, calib, SPEC, QATSettings(steps=30, batch=2),
                            on_step=lambda layer, step, loss: losses.setdefault(layer, []).append(loss)))
    assert len(layers) == 6 and all(len(v) == 30 for v in losses.values())
    for trace in losses.values():  # each layer's loss falls
        assert sum(trace[-5:]) < sum(trace[:5])
    trained = {n: p for layer in layers for n, p in layer.tensors.items()}
    quantized = [p for p in trained.values() if isinstance(p, QuantizedTensor)]
    assert len(quantized) == 7 * 6 and all(p.spec == SPEC and p.codes.max() <= 3 for p in quantized)
    assert all(0 < e < 1 for layer in layers for e in layer.errors.values()) and len(layers[0].errors) == 7
    rtn = {n: quantize_rtn(ckpt.tensor(n).float(), SPEC, n) for n in trained if isinstance(trained[n], QuantizedTensor)}
    reference = causal_lm_logprobs(model)
    kld = lambda tensors: score(causal_lm_logprobs(_model(model, tensors)), evaluation, reference).kld  # noqa: E731
    assert kld(trained) < 0.8 * kld(rtn)


def test_the_export_holds_exactly_the_trained_grid(tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from rich.console import Console

    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    recipe = {"model": str(TINY), "evaluation": {"text": str(EVAL_TEXT), "window": 128, "max_windows": 2},
              "calibration": {"text": str(BUNDLED / "calib.txt"), "window": 128, "max_windows": 4},
              "variants": [{"name": "qat", "weights": {"method": "qat", "bits": 3, "group_size": 64, "steps": 5, "init": "gptq"},
                            "exports": ["compressed-tensors", "safetensors"]}]}
    out = tmp_path / "out"
    report = run_recipe(load_recipe(write_recipe(tmp_path, recipe)), out, Console(quiet=True))
    row = report.rows[1]
    assert row.method == "qat int3-g64-asym from gptq, 5 steps"
    assert row.error_measure == "relative output error on calibration inputs" and len(row.linear_errors) == 42
    folder = out / "qat" / "compressed-tensors"
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    from safetensors.torch import load_file

    evaluated = load_file(out / "qat" / "safetensors" / "model.safetensors")  # the trained weights, as evaluated
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(dequantize=True)).state_dict()
    for name, weights in evaluated.items():
        assert torch.equal(loaded[name], weights.half().float()), name


@pytest.mark.parametrize("weights, message", [
    ({"method": "qat", "bits": 2, "steps": 0}, "weights.steps': Input should be greater than or equal to 1"),
    ({"method": "qat", "bits": 4, "group_size": 100}, "group_size 100 does not divide the input size"),
    ({"method": "qat", "gguf": "Q4_0", "bits": 4}, "gguf: Q4_0 fixes the grid (4 bits, symmetric, blocks of 32): leave out bits"),
    ({"method": "qat"}, "bits is required (or gguf: Q4_0)"),
])
def test_bad_qat_settings_stop_the_job_in_one_line(tmp_path, weights, message):
    recipe = {"model": str(TINY), "evaluation": {"text": str(EVAL_TEXT)}, "calibration": {"text": str(BUNDLED / "calib.txt")},
              "variants": [{"name": "q", "weights": weights}]}
    run = subprocess.run([sys.executable, "-m", "recipes.cli", str(write_recipe(tmp_path, recipe)), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_a_gguf_export_of_qat_weights_is_refused(tmp_path):
    recipe = {"model": str(TINY), "evaluation": {"text": str(EVAL_TEXT)}, "calibration": {"text": str(BUNDLED / "calib.txt")},
              "variants": [{"name": "q", "weights": {"method": "qat", "bits": 4}, "exports": ["gguf"]}]}
    run = subprocess.run([sys.executable, "-m", "recipes.cli", str(write_recipe(tmp_path, recipe))], capture_output=True, text=True)
    assert run.returncode == 2 and "a gguf export needs 'weights: {method: gguf" in run.stderr


def test_a_q4_0_qat_file_holds_the_trained_blocks_and_runs_in_llama_cpp(tmp_path):
    import math

    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from rich.console import Console
    from safetensors.torch import load_file

    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    recipe = {"model": str(TINY), "evaluation": {"text": str(EVAL_TEXT), "window": 128, "max_windows": 4},
              "calibration": {"text": str(BUNDLED / "calib.txt"), "window": 128, "max_windows": 4},
              "variants": [{"name": "qat-q4_0", "weights": {"method": "qat", "gguf": "Q4_0", "steps": 10},
                            "exports": ["gguf", "safetensors"]}]}
    out = tmp_path / "out"
    report = run_recipe(load_recipe(write_recipe(tmp_path, recipe)), out, Console(quiet=True))
    row = report.rows[1]
    assert row.method == "qat Q4_0 from rtn, 10 steps" and len(row.linear_errors) == 42
    gguf_file = out / "qat-q4_0" / "tiny-Q4_0.gguf"
    evaluated = load_file(out / "qat-q4_0" / "safetensors" / "model.safetensors")
    tensors = {t.name: t for t in GGUFReader(gguf_file).tensors}
    for gguf_name, hf_name in [("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                               ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
                               ("blk.5.attn_output.weight", "model.layers.5.self_attn.o_proj.weight")]:
        t = tensors[gguf_name]
        assert t.tensor_type.name == "Q4_0"
        blocks = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(evaluated[hf_name].shape)
        assert torch.equal(blocks, evaluated[hf_name]), gguf_name  # the trained grid, block for block
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the 'interop' extra (make test installs it)")
    windows = token_windows(load_tokenizer(HFCheckpoint.open(TINY)), EVAL_TEXT, 128, 4).numpy()
    llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=128, n_batch=128, logits_all=True, verbose=False, n_threads=2)
    nll = 0.0
    for w in windows:
        llm.reset()
        llm.eval(w.tolist())
        logits = torch.tensor(np.asarray(llm.scores[: len(w) - 1]), dtype=torch.float64)
        nll -= torch.log_softmax(logits, -1)[torch.arange(len(w) - 1), torch.from_numpy(w[1:])].sum().item()
    assert math.exp(nll / (windows.shape[0] * (windows.shape[1] - 1))) == pytest.approx(row.scores.ppl, rel=0.02)
