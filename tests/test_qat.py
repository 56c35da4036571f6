"""QAT: training moves the model closer to the original than the grid it starts from, the
end-to-end phase moves it closer still, a stopped run takes up where it was to the same weights,
the export holds exactly the trained grid (read back by transformers through compressed-tensors,
and by llama.cpp), and bad settings stop the job in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calib.text import sample_windows, token_windows
from conftest import BUNDLED, EVAL_TEXT, TINY, write_recipe
from core.schemes import QuantSpec
from core.tensors import QuantizedTensor, dequantized
from evalsuite.metrics import causal_lm_logprobs, score
from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer, model_from_state
from quant.qat import QATSettings, qat_model
from quant.rtn import quantize_rtn

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
                            on_step=lambda layer, step, steps, loss: losses.setdefault(layer, []).append(loss)))
    training = {phase: trace for phase, trace in losses.items() if "held out" not in phase}
    assert len(layers) == 6 and len(training) == 6 and all(len(v) == 30 for v in training.values())
    assert all(len(losses[f"{phase} held out"]) == 4 for phase in training)  # the start, and every 10 steps
    assert all(len(losses[f"{phase} held out gptq"]) == 1 for phase in training)  # GPTQ's solution, after training
    for trace in training.values():  # each layer's loss falls
        assert sum(trace[-5:]) < sum(trace[:5])
    trained = {n: p for layer in layers for n, p in layer.tensors.items()}
    quantized = [p for p in trained.values() if isinstance(p, QuantizedTensor)]
    assert len(quantized) == 7 * 6 and all(p.spec == SPEC and p.codes.max() <= 3 for p in quantized)
    assert all(0 < e < 1 for layer in layers for e in layer.errors.values()) and len(layers[0].errors) == 7
    rtn = {n: quantize_rtn(ckpt.tensor(n).float(), SPEC, n) for n in trained if isinstance(trained[n], QuantizedTensor)}
    reference = causal_lm_logprobs(model)
    kld = lambda tensors: score(causal_lm_logprobs(_model(model, tensors)), evaluation, reference).kld  # noqa: E731
    assert kld(trained) < 0.8 * kld(rtn)


def test_the_end_to_end_phase_brings_the_output_distribution_closer_to_the_original(tiny):
    ckpt, model, calib, evaluation = tiny
    layer_phase = list(qat_model(ckpt, calib, SPEC, QATSettings(steps=10)))
    losses = []
    both = list(qat_model(ckpt, calib, SPEC, QATSettings(steps=10, e2e_steps=40),
                          on_step=lambda phase, step, steps, loss: losses.append(loss) if phase == "end to end" else None))
    assert len(losses) == 40 and sum(losses[-5:]) < sum(losses[:5])
    before = {n: t for layer in layer_phase for n, t in layer.tensors.items()}
    after = {n: t for layer in both for n, t in layer.tensors.items()}
    assert set(after) == set(before) | {"model.norm.weight"}  # the final norm is trained too
    quantized = [n for n, t in before.items() if isinstance(t, QuantizedTensor)]
    for n in quantized:  # the codes stay where the layer phase put them; the scales move
        assert torch.equal(after[n].codes, before[n].codes) and torch.equal(after[n].zeros, before[n].zeros), n
        assert torch.equal(after[n].scales, after[n].scales.half().float()), n  # storable as fp16
    assert not all(torch.equal(after[n].scales, before[n].scales) for n in quantized)
    assert not torch.equal(after["model.layers.2.input_layernorm.weight"], before["model.layers.2.input_layernorm.weight"])
    errors = {m: e for layer in both for m, e in layer.errors.items()}  # measured again, on the final weights
    assert len(errors) == 42 and all(0 < e < 1 for e in errors.values())
    assert errors != {m: e for layer in layer_phase for m, e in layer.errors.items()}
    reference = causal_lm_logprobs(model)
    kld = lambda tensors: score(causal_lm_logprobs(_model(model, tensors)), evaluation, reference).kld  # noqa: E731
    assert kld(after) < 0.97 * kld(before)


@pytest.mark.parametrize("lr", [0.02, 0.05])
def test_training_made_to_overfit_keeps_its_best_grid_on_the_held_out_windows(tiny, lr):
    """Few windows and many steps: at a rate of 0.02 the training loss falls far below the loss on
    the held-out windows, which turns up; at 0.05 (too large) the parameters' held-out loss is
    above the starting grid's at every look. Each look scores the parameters and their moving average; the
    layer keeps the best grid of all looks, the starting grid where none was better, and training
    stops at the first look worse than the starting grid once half its steps are done."""
    from calib.layerwise import run_layer
    from calib.streaming import skeleton, walk_layers
    from quant.qat import _split, qat_layer

    ckpt, _, calib, _ = tiny
    windows = calib[:4, :64]  # 192 positions to train a layer's 200K weights on
    settings = QATSettings(steps=200, lr=lr, holdout=0.25, check_every=5, keep_gptq=False)
    trained, held = [], []
    step = next(iter(walk_layers(ckpt, skeleton(ckpt), windows)))
    targets = run_layer(step.layer, step.inputs)  # the float layer's outputs
    looks = []
    qat_layer(step, SPEC, settings, on_step=lambda i, loss: trained.append(loss),
              on_held=lambda grid, done, loss: looks.append((grid, done, loss)))
    held = [(done, loss) for grid, done, loss in looks if grid == "training"]
    averaged = [(done, loss) for grid, done, loss in looks if grid == "average"]
    start = held[0][1]
    best = min(range(len(held)), key=lambda i: held[i][1])
    assert [done for done, _ in held] == list(range(0, len(trained) + 1, 5))  # a look every 5 steps
    assert [done for done, _ in averaged] == [done for done, _ in held[1:]]  # and at each, the moving average
    if lr == 0.02:
        assert min(trained[-5:]) < 0.5 * held[best][1]  # memorising the windows it trains on
        assert 0 < best < len(held) - 1 and held[best][1] < start and held[-1][1] > held[best][1]
    else:
        # no look of the parameters beats the starting grid (their moving average may: it is kept then)
        assert len(trained) == 100 and best == 0 and all(loss > start for _, loss in held[1:])
    if len(trained) < settings.steps:  # stopped at its first look past half the steps worse than the start
        assert len(trained) >= 100 and held[-1][1] >= start
        assert all(loss < start for done, loss in held[1:-1] if done >= 100)
    # the layer computes with the kept grid: its loss on the held-out windows is the best look's
    _, held_out = _split(len(windows), settings.holdout, torch.Generator().manual_seed(settings.seed))
    mse = torch.nn.functional.mse_loss(run_layer(step.layer, step.inputs)[held_out], targets[held_out]).item()
    assert mse == pytest.approx(min(loss for _, _, loss in looks), rel=0.03)


@pytest.mark.parametrize("lr, tokens", [(0.01, 256), (0.05, 64)])
def test_a_layer_keeps_gptqs_solution_where_it_is_better_on_the_held_out_windows(tiny, lr, tokens):
    """From RTN's grid, the layer ends on the best of the grid training kept and GPTQ's two
    solutions (every Hessian from the float layer, and group by group as a GPTQ variant makes
    it), judged on the held-out windows: a GPTQ solution at a rate too large to improve on the
    start, on short windows (0.05, 64 tokens), the trained grid at 0.01 on 256-token windows."""
    from calib.layerwise import input_statistics, run_layer
    from calib.streaming import skeleton, walk_layers
    from quant.gptq import GPTQSettings, gptq_quantize
    from quant.gptq_model import gptq_layer
    from quant.qat import _copy, _split, qat_layer

    ckpt, _, calib, _ = tiny
    windows = calib[:8, :tokens]
    settings = QATSettings(steps=60, lr=lr, holdout=0.25, check_every=5)
    step = next(iter(walk_layers(ckpt, skeleton(ckpt), windows)))
    targets = run_layer(step.layer, step.inputs)
    linears = {n: m for n, m in step.layer.named_modules() if isinstance(m, torch.nn.Linear)}
    hessians = {n: s.hessian for n, s in input_statistics(step.layer, step.inputs, list(linears)).items()}
    solutions = {"gptq": {n: gptq_quantize(m.weight.data, hessians[n], SPEC, GPTQSettings(), n).tensor.dequantize()
                          for n, m in linears.items()}}
    groups = gptq_layer(_copy(step), SPEC, GPTQSettings(), {step.prefix + n for n in linears})
    solutions["gptq groups"] = {n: groups[f"{step.prefix}{n}.weight"].tensor.dequantize() for n in linears}
    assert any(not torch.equal(solutions["gptq"][n], solutions["gptq groups"][n]) for n in linears)  # two rivals
    held = []
    qat_layer(step, SPEC, settings, on_held=lambda grid, done, loss: held.append((grid, loss)))
    trained = min(loss for grid, loss in held if grid in ("training", "average"))
    theirs = {grid: loss for grid, loss in held if grid in solutions}
    assert [grid for grid, _ in held[-2:]] == ["gptq", "gptq groups"]  # each judged once, after training
    _, held_out = _split(len(windows), settings.holdout, torch.Generator().manual_seed(settings.seed))
    mse = torch.nn.functional.mse_loss(run_layer(step.layer, step.inputs)[held_out], targets[held_out]).item()
    assert mse == pytest.approx(min(trained, *theirs.values()), rel=0.03)
    kept = [grid for grid, weights in solutions.items()
            if all(torch.equal(linears[n].weight.data, weights[n].to(linears[n].weight.dtype)) for n in linears)]
    best = min(theirs, key=theirs.get)
    assert kept == ([best] if theirs[best] < trained else [])
    assert bool(kept) == (lr == 0.05)


def test_training_from_gptqs_grid_starts_on_its_codes_off_the_grid_points(tiny):
    """``init: gptq`` starts each weight where GPTQ's updates left it before rounding, off the grid
    points (tests/test_gptq.py), where the straight-through rounding can move them: those weights
    must still round to GPTQ's codes on the stored fp16 scales, so the layer computes GPTQ's
    solution before any step."""
    from calib.layerwise import input_statistics
    from calib.streaming import skeleton, walk_layers
    from quant.gptq import GPTQSettings, gptq_quantize
    from quant.qat import qat_layer

    ckpt, _, calib, _ = tiny
    step = next(iter(walk_layers(ckpt, skeleton(ckpt), calib[:8, :64])))
    linears = {n: m for n, m in step.layer.named_modules() if isinstance(m, torch.nn.Linear)}
    hessians = {n: s.hessian for n, s in input_statistics(step.layer, step.inputs, list(linears)).items()}
    gptq = {n: gptq_quantize(m.weight.data, hessians[n], SPEC, GPTQSettings(), n).tensor for n, m in linears.items()}
    result = qat_layer(step, SPEC, QATSettings(steps=1, lr=1e-9, init="gptq", holdout=0))
    for n, theirs in gptq.items():
        ours = result.tensors[f"{step.prefix}{n}.weight"]
        assert (ours.codes == theirs.codes).float().mean() > 0.999, n  # fp16 scales may move a rare tie


class _Stop(Exception):
    pass


def test_a_stopped_training_takes_up_from_its_last_layer_and_step_to_the_same_weights(tiny, tmp_path):
    ckpt, _, calib, _ = tiny
    settings = QATSettings(steps=4, e2e_steps=4, save_seconds=0)

    def run(folder, stop=None):
        seen = []

        def on_step(phase, step, steps, loss):
            if phase.endswith("held out"):
                return
            seen.append((phase, step))
            if (phase, step) == stop:
                raise _Stop

        try:
            return list(qat_model(ckpt, calib, SPEC, settings, on_step=on_step, checkpoint=folder)), seen
        except _Stop:
            return None, seen

    whole, _ = run(tmp_path / "whole")
    folder = tmp_path / "stopped"
    assert run(folder, ("layer 3/6", 1))[0] is None
    assert sorted(p.name for p in folder.iterdir()) == ["layer-0000.safetensors", "layer-0001.safetensors"]
    stopped, seen = run(folder, ("end to end", 2))
    assert stopped is None and seen[0] == ("layer 3/6", 0)  # layers 1 and 2 were not trained again
    resumed, seen = run(folder)
    assert seen == [("end to end", 2), ("end to end", 3)]  # from the last saved step
    assert len(resumed) == len(whole) == 6
    for a, b in zip(whole, resumed):
        assert a.tensors.keys() == b.tensors.keys() and a.errors == b.errors
        for name in a.tensors:
            assert torch.equal(dequantized(a.tensors[name]), dequantized(b.tensors[name])), name


def test_a_recipe_killed_mid_training_resumes_to_the_same_files(tmp_path):
    import os
    import time

    recipe = {"model": str(TINY), "evaluation": {"text": str(EVAL_TEXT), "window": 128, "max_windows": 2},
              "calibration": {"text": str(BUNDLED / "calib.txt"), "window": 128, "max_windows": 4},
              "variants": [{"name": "qat", "weights": {"method": "qat", "bits": 2, "group_size": 64, "steps": 40,
                                                       "e2e_steps": 5}, "exports": ["safetensors"]}]}
    path = write_recipe(tmp_path, recipe)
    quantize = str(Path(sys.executable).with_name("quantize"))
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert subprocess.run([quantize, str(path), "--out", str(whole)], capture_output=True).returncode == 0
    job = subprocess.Popen([quantize, str(path), "--out", str(resumed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not list((resumed / "qat").glob(".training-*/layer-0002.safetensors")) and job.poll() is None:
            assert time.monotonic() < deadline, "no layer saved"
            time.sleep(0.01)
        assert job.poll() is None, job.stderr.read().decode()
        os.kill(job.pid, 9)
        job.wait()
    finally:
        job.kill()
    rerun = subprocess.run([quantize, str(path), "--out", str(resumed)], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert not list((resumed / "qat").glob(".training-*"))  # removed once the variant is done
    model = Path("qat/safetensors/model.safetensors")
    assert (whole / model).read_bytes() == (resumed / model).read_bytes()


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
    ({"method": "qat"}, "bits is required (or gguf: Q4_0 | Q4_K_S | Q4_K_M)"),
    ({"method": "qat", "gguf": "Q4_K_M", "init": "gptq"}, "gguf: Q4_K_M starts from llama.cpp's own Q4_K: leave out init: gptq"),
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


@pytest.mark.parametrize("file_type, e2e_steps", [("Q4_0", 0), ("Q4_K_M", 3)])
def test_a_gguf_qat_file_holds_the_trained_blocks_and_runs_in_llama_cpp(tmp_path, file_type, e2e_steps):
    import math

    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from rich.console import Console
    from safetensors.torch import load_file

    from formats.gguf import gguf_name
    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    recipe = {"model": str(TINY), "evaluation": {"text": str(EVAL_TEXT), "window": 128, "max_windows": 4},
              "calibration": {"text": str(BUNDLED / "calib.txt"), "window": 128, "max_windows": 4},
              "variants": [{"name": "qat", "weights": {"method": "qat", "gguf": file_type, "steps": 10, "e2e_steps": e2e_steps},
                            "exports": ["gguf", "safetensors"]}]}
    out = tmp_path / "out"
    report = run_recipe(load_recipe(write_recipe(tmp_path, recipe)), out, Console(quiet=True))
    row = report.rows[1]
    assert row.method == f"qat {file_type} from rtn, 10 steps" + (f" + {e2e_steps} end to end" if e2e_steps else "")
    trained_type = file_type[:4]  # Q4_0, Q4_K
    gguf_file = out / "qat" / f"tiny-{file_type}.gguf"
    evaluated = load_file(out / "qat" / "safetensors" / "model.safetensors")  # the weights as scored
    tensors = {t.name: t for t in GGUFReader(gguf_file).tensors}
    trained = 0
    for hf_name, weights in evaluated.items():
        name = gguf_name(hf_name, HFCheckpoint.open(TINY).arch)
        if name is None or ".attn_q." in name or ".attn_k." in name:
            continue  # not stored, or stored with llama.cpp's rows permuted
        t = tensors[name]
        stored = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(weights.shape)
        assert torch.equal(stored, weights), name  # the trained grid block for block; the trained norms
        trained += t.tensor_type.name == trained_type
    assert trained >= 3 * 6  # o, gate, up (at least) of every layer on the trained grid
    if e2e_steps:
        original = HFCheckpoint.open(TINY)
        assert not torch.equal(evaluated["model.norm.weight"], original.tensor("model.norm.weight").float())
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
