"""A customer's quantized checkpoint as the source: GPTQ, AWQ and compressed-tensors folders are
dequantized one tensor at a time and converted to GGUF, which llama.cpp loads; its perplexity is
that of the dequantized source within what the conversion must lose."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import BUNDLED, EVAL_TEXT, REPO, TINY
from formats.hf import HFCheckpoint, load_tokenizer
from formats.quantized_checkpoint import QuantizedCheckpoint
from formats.sources import open_checkpoint
from helpers.llama_cpp_scores import llama_cpp_added_kld, llama_cpp_perplexity
from recipes.schema import Variant
from recipes.variants import build_variant, gguf_variant

SOURCES = {  # a source folder per layout, made by our writers from the bundled model: weights, export, activations
    "gptq": ({"method": "gptq", "bits": 4, "group_size": 64, "symmetric": False, "act_order": True}, "gptq", None),
    "awq": ({"method": "awq", "bits": 4, "group_size": 64}, "awq", None),
    "compressed-tensors": ({"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64}, "compressed-tensors", None),
    "int-quantized": ({"method": "rtn", "bits": 8}, "compressed-tensors", {"format": "int8"}),
    "float-quantized": ({"method": "rtn", "format": "fp8_e4m3", "granularity": "block", "group_size": 128},
                        "compressed-tensors", None),
}
FOUR_BIT = ["gptq", "awq", "compressed-tensors"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from calib.text import token_windows

    ckpt = HFCheckpoint.open(TINY)
    windows = token_windows(load_tokenizer(ckpt), BUNDLED / "calib.txt", 256, 8)
    out = tmp_path_factory.mktemp("sources")
    for layout, (weights, export, activations) in SOURCES.items():
        variant = Variant.model_validate({"name": layout, "weights": weights, "exports": ["safetensors", export],
                                          "activations": activations})
        build_variant(ckpt, variant, out, calibration=windows)
    return out


def source_folder(sources, layout):
    return sources / layout / SOURCES[layout][1]


@pytest.mark.parametrize("layout", SOURCES)
def test_a_quantized_folder_reads_as_the_weights_it_was_written_from(sources, layout):
    from safetensors.torch import load_file

    source = open_checkpoint(source_folder(sources, layout))
    assert isinstance(source, QuantizedCheckpoint) and source.layout in (layout, "pack-quantized")
    dense = load_file(sources / layout / "safetensors" / "model.safetensors")  # the weights as evaluated
    assert sorted(source.names) == sorted(HFCheckpoint.open(TINY).names)
    for name in source.names:
        # codes times the float16 scales they were chosen for give our weights exactly; the other
        # tensors are stored in float16
        expected = dense[name] if name in source.quantized else dense[name].half().float()
        assert torch.equal(source.tensor(name), expected), name
    assert len(source.quantized) == 7 * 6
    assert 4 < source.bits_per_weight < 11  # codes, scales and zero-points; embeddings in float16


@pytest.mark.parametrize("layout", FOUR_BIT)
def test_a_quantized_source_converts_to_q4_k_m_within_one_percent_of_its_perplexity(sources, tmp_path, layout):
    """As a user converts one: `quantize export SRC --gguf Q4_K_M --imatrix calib.txt`, the
    importance matrix computed on the dequantized source. (Without one, the bundled model's GPTQ
    source loses 1.15%, still less than its float original loses to Q4_K_M, 1.89%.) The KL
    divergence the conversion adds is at most what quantizing the dequantized weights again adds,
    and less where the source's grid is carried into Q4_K (not act-order GPTQ: its groups mix)."""
    source = open_checkpoint(source_folder(sources, layout))
    dense = HFCheckpoint.open(sources / layout / "safetensors")  # the same weights, unquantized
    converted = q4_k_m_against_requantized(source, dense, tmp_path)
    assert abs(converted["ppl"] / converted["source ppl"] - 1) < 0.01
    if layout == "gptq":
        assert converted["kld"] == pytest.approx(converted["requantized kld"], rel=1e-6)
    else:
        assert converted["kld"] < 0.8 * converted["requantized kld"]


def q4_k_m_against_requantized(source, dense, tmp_path) -> dict[str, float]:
    """llama.cpp's perplexity of ``source`` as F32 and as Q4_K_M, and the KL divergence Q4_K_M adds,
    converted from the quantized source and from ``dense``, its dequantized weights as a float
    checkpoint (the importance matrix of the dequantized source for both)."""
    from calib.text import token_windows
    from recipes.importance import model_imatrix

    tokenizer = load_tokenizer(source)
    imatrix = model_imatrix(source, token_windows(tokenizer, BUNDLED / "calib.txt", 512, 16))
    tokens = tokenizer(EVAL_TEXT.read_text(), add_special_tokens=False)["input_ids"][: 8 * 256]
    f32 = build_variant(source, gguf_variant("F32"), tmp_path, gguf_path=tmp_path / "f32.gguf").files[0]
    q4, requantized = (build_variant(ckpt, gguf_variant("Q4_K_M", True), tmp_path, imatrix=imatrix,
                                     gguf_path=tmp_path / f"{name}.gguf").files[0]
                       for name, ckpt in (("q4_k_m", source), ("requantized", dense)))
    scores = {"source ppl": llama_cpp_perplexity(f32, tokens), "ppl": llama_cpp_perplexity(q4, tokens),  # F32: the source itself
              "kld": llama_cpp_added_kld(f32, q4, tokens), "requantized kld": llama_cpp_added_kld(f32, requantized, tokens)}
    print(f"{source.label}: dequantized source {scores['source ppl']:.3f}, Q4_K_M {scores['ppl']:.3f} "
          f"({scores['ppl'] / scores['source ppl'] - 1:+.2%}), added KLD {scores['kld']:.5f} "
          f"(quantizing the dequantized weights again: {scores['requantized kld']:.5f})")
    return scores


@pytest.mark.parametrize("spec", [("group", 64, False), ("group", 128, True), ("channel", None, False)])
def test_an_int4_grid_carried_into_q4_k_moves_the_weights_far_less_than_quantizing_again(spec):
    """The source's codes kept as Q4_K's levels, its group scales and offsets approximated by
    6-bit multiples of fp16 super-block factors, against dequantizing and quantizing again."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from quant.ggml import encode
    from quant.ggml.regrid import q4_k_from_int4
    from quant.rtn import quantize_rtn
    from core.schemes import QuantSpec

    granularity, group, symmetric = spec
    weights = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 0.05
    source = quantize_rtn(weights, QuantSpec(4, symmetric, granularity, group), "w")
    values = source.dequantize()
    kept = torch.from_numpy(dequantize(q4_k_from_int4(source), GGMLQuantizationType.Q4_K).reshape(64, 512))
    again = encode(values, "Q4_K").dequantize()
    moved_kept, moved_again = ((t - values).norm() / values.norm() for t in (kept, again))
    assert moved_kept < moved_again / 3, (moved_kept, moved_again)


def test_grids_q4_k_cannot_hold_are_left_to_the_encoder():
    from quant.ggml.regrid import q4_k_from_int4
    from quant.rtn import quantize_rtn
    from core.schemes import QuantSpec

    weights = torch.randn(8, 512, generator=torch.Generator().manual_seed(0))
    assert q4_k_from_int4(quantize_rtn(weights, QuantSpec(8, False, "group", 64), "w")) is None  # 8 bits
    assert q4_k_from_int4(quantize_rtn(weights, QuantSpec(4, False, "group", 16), "w")) is None  # groups within a sub-block
    plain = quantize_rtn(weights, QuantSpec(4, False, "group", 64), "w")
    act_order = replace(plain, group_index=torch.randperm(512, generator=torch.Generator().manual_seed(1)).to(torch.int32) // 64)
    assert q4_k_from_int4(act_order) is None and q4_k_from_int4(plain) is not None


def test_a_recipe_takes_a_quantized_checkpoint_as_its_model(sources, tmp_path):
    from rich.console import Console

    from conftest import write_recipe
    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    recipe = {"model": str(sources / "awq" / "awq"),
              "evaluation": {"text": str(EVAL_TEXT), "window": 128, "max_windows": 4},
              "variants": [{"name": "q4_k_m", "weights": {"method": "gguf", "type": "Q4_K_M"}, "exports": ["gguf"]}]}
    report = run_recipe(load_recipe(write_recipe(tmp_path, recipe)), tmp_path / "out", Console(quiet=True))
    original, q4 = report.rows
    assert original.method == "source (awq int4-g64-asym)" and 4 < original.bits_per_weight < 8  # embeddings in float16
    assert 0 < q4.scores.kld < 0.05 and (tmp_path / "out" / "q4_k_m").is_dir()


def test_quantize_export_converts_a_gptq_folder(sources, tmp_path, monkeypatch, capsys):
    from gguf import GGUFReader

    from helpers.cli import quantize

    code, out, err = quantize(monkeypatch, capsys, "export", sources / "gptq" / "gptq", "--gguf", "Q4_K_M",
                              "-o", tmp_path / "m.gguf")
    assert code == 0, err
    assert "Q4_K_M" in out
    types = {t.tensor_type.name for t in GGUFReader(tmp_path / "m.gguf").tensors}
    assert {"Q4_K", "Q6_K", "F32"} <= types


@pytest.mark.parametrize("layout", ["int-quantized", "float-quantized"])
def test_an_eight_bit_source_converts_to_q8_0_within_one_percent_of_its_perplexity(sources, tmp_path, layout):
    source = open_checkpoint(source_folder(sources, layout))
    tokens = load_tokenizer(source)(EVAL_TEXT.read_text(), add_special_tokens=False)["input_ids"][: 8 * 256]
    ppl = {}
    for file_type in ("F32", "Q8_0"):
        path = build_variant(source, gguf_variant(file_type), tmp_path,
                             gguf_path=tmp_path / f"{file_type}.gguf").files[0]
        ppl[file_type] = llama_cpp_perplexity(path, tokens)
    print(f"{layout}: dequantized source {ppl['F32']:.3f}, Q8_0 {ppl['Q8_0']:.3f}")
    assert abs(ppl["Q8_0"] / ppl["F32"] - 1) < 0.01


def test_a_reference_makes_the_original_the_baseline_and_scores_the_model_beside_the_variants(sources, tmp_path):
    """The customer's AWQ checkpoint against the float original it came from: the original row is
    the reference, the model gets its own row, and a Q4_K_M converted from the model adds to the
    model's divergence from the original."""
    from rich.console import Console

    from conftest import write_recipe
    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    recipe = {"model": str(source_folder(sources, "awq")), "reference": str(TINY),
              "evaluation": {"text": str(EVAL_TEXT), "window": 128, "max_windows": 4},
              "variants": [{"name": "q4_k_m", "weights": {"method": "gguf", "type": "Q4_K_M"}, "exports": ["gguf"]}]}
    path = write_recipe(tmp_path, recipe)
    report = run_recipe(load_recipe(path), tmp_path / "out", Console(quiet=True))
    original, model, q4 = report.rows
    assert (original.name, original.method) == ("original", "source (bfloat16)")  # the bundled model, as stored
    assert model.name == "source" and model.method == "source (awq int4-g64-asym)"
    assert 0 < model.scores.kld < q4.scores.kld  # the conversion adds to what AWQ lost
    assert model.ppl_delta == pytest.approx(model.scores.ppl - original.scores.ppl)
    again = run_recipe(load_recipe(path), tmp_path / "out", Console(quiet=True))  # resumed: nothing to redo
    assert [r.scores.kld for r in again.rows] == [r.scores.kld for r in report.rows]


BNB = {  # what transformers + bitsandbytes write for the bundled model
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def bnb_sources(tmp_path_factory):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the 'dev' extra (make test installs it)")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    out = tmp_path_factory.mktemp("bnb")
    models = {}
    for name, settings in BNB.items():
        model = AutoModelForCausalLM.from_pretrained(TINY, quantization_config=BitsAndBytesConfig(**settings), device_map="cpu")
        model.save_pretrained(out / name)
        for side in ("tokenizer.json", "tokenizer_config.json"):
            (out / name / side).write_bytes((TINY / side).read_bytes())
        models[name] = model
    return out, models


@pytest.mark.parametrize("name", BNB)
def test_a_bitsandbytes_folder_reads_as_bitsandbytes_dequantizes_it(bnb_sources, name):
    import bitsandbytes.functional as bnb_functional

    out, models = bnb_sources
    source = open_checkpoint(out / name)
    assert source.method == "bitsandbytes" and len(source.quantized) == 7 * 6
    modules = dict(models[name].named_modules())
    for weight in sorted(source.quantized):
        module = modules[weight.removesuffix(".weight")]
        ours = source.tensor(weight)
        if name == "int8":  # LLM.int8: int8 rows times their absmax / 127
            theirs = module.weight.data.float() * module.weight.SCB.float()[:, None] / 127
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0, msg=weight)
        else:  # bitsandbytes returns the model's dtype: ours, rounded to it once, is what it computes
            theirs = bnb_functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            assert torch.equal(ours.to(theirs.dtype), theirs), weight


@pytest.mark.parametrize("name, target", [("nf4", "Q4_K_M"), ("int8", "Q8_0")])
def test_a_bitsandbytes_source_converts_to_gguf_within_one_percent_of_its_perplexity(bnb_sources, tmp_path, name, target):
    """nf4's levels are no affine grid: its weights are quantized again, with the importance
    matrix of the dequantized source (without one: +0.82% on the bundled model)."""
    from calib.text import token_windows
    from recipes.importance import model_imatrix

    out, _ = bnb_sources
    source = open_checkpoint(out / name)
    tokenizer = load_tokenizer(source)
    tokens = tokenizer(EVAL_TEXT.read_text(), add_special_tokens=False)["input_ids"][: 8 * 256]
    imatrix = model_imatrix(source, token_windows(tokenizer, BUNDLED / "calib.txt", 512, 16))
    ppl = {}
    for file_type in ("F32", target):
        path = build_variant(source, gguf_variant(file_type, file_type == "Q4_K_M"), tmp_path,
                             imatrix=imatrix if file_type == "Q4_K_M" else None, gguf_path=tmp_path / f"{file_type}.gguf").files[0]
        ppl[file_type] = llama_cpp_perplexity(path, tokens)
    print(f"bitsandbytes {name}: dequantized source {ppl['F32']:.3f}, {target} {ppl[target]:.3f}")
    assert abs(ppl[target] / ppl["F32"] - 1) < 0.01


# torch's threads and seeds pinned (GPTQMODEL_CPU_WORKERS=2 below sizes GPTQModel's own pool): the
# same file on every run of one machine. Another CPU still writes another file (its bfloat16
# kernels change the calibration activations, hence the Hessians and the rounding): what the tests
# below assert of it must not depend on which file.
GPTQMODEL_QUANTIZE = r"""
import json, random, sys, torch
torch.set_num_threads(2)
torch.manual_seed(0)
random.seed(0)
from gptqmodel import GPTQModel, QuantizeConfig
from transformers import AutoTokenizer
source, dest, text, settings = sys.argv[1], sys.argv[2], open(sys.argv[3]).read(), json.loads(sys.argv[4])
ids = AutoTokenizer.from_pretrained(source)(text)["input_ids"]
calibration = [{"input_ids": torch.tensor([ids[i:i + 256]]), "attention_mask": torch.ones(1, 256, dtype=torch.long)}
               for i in range(0, 256 * 16, 256)]
model = GPTQModel.load(source, QuantizeConfig(bits=4, **settings), device="cpu")
model.quantize(calibration, batch_size=1)
model.save(dest)
"""
GPTQMODEL_SETTINGS = {  # GPTQModel's defaults (contiguous groups of 128, its group-aware order), and act-order
    "default": {"group_size": 128},
    "act-order": {"group_size": 64, "desc_act": True, "sym": True},
}


@pytest.fixture(scope="module", params=GPTQMODEL_SETTINGS)
def gptqmodel_source(request, tmp_path_factory):
    """The bundled model quantized by GPTQModel itself, in its own virtualenv, with our dequantized
    reading of it beside: ``folder/gptq``, ``folder/safetensors``."""
    import json
    import os
    import subprocess

    from helpers.gptqmodel import GPTQMODEL

    if not GPTQMODEL.exists():
        pytest.skip("GPTQModel's venv: bench/anchors/setup.sh gptqmodel (make test runs it)")
    folder = tmp_path_factory.mktemp("gptqmodel") / "gptqmodel"
    run = subprocess.run([str(GPTQMODEL), "-c", GPTQMODEL_QUANTIZE, str(TINY), str(folder / "gptq"), str(BUNDLED / "calib.txt"),
                          json.dumps(GPTQMODEL_SETTINGS[request.param])],
                         capture_output=True, text=True, env=os.environ | {"GPTQMODEL_CPU_WORKERS": "2", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                                               "PYTHONHASHSEED": "0"})
    assert run.returncode == 0, run.stderr[-2000:]
    source = open_checkpoint(folder / "gptq")
    build_variant(source, Variant.model_validate({"name": "gptqmodel", "weights": {"method": "none"}, "exports": ["safetensors"]}),
                  folder.parent)
    return request.param, folder


@pytest.mark.anchor
def test_a_gptq_file_gptqmodel_wrote_reads_as_gptqmodel_reads_it(gptqmodel_source):
    from helpers.gptqmodel import assert_read_back_exactly, read_back

    settings, folder = gptqmodel_source
    source = open_checkpoint(folder / "gptq")
    assert source.label == {"default": "gptq int4-g128-sym", "act-order": "gptq int4-g64-sym"}[settings]
    assert len(source.quantized) == 7 * 6
    # GPTQModel's own dequantization of every module equals ours rounded to float16, and its model
    # computes what our dequantized weights compute
    assert_read_back_exactly(read_back(folder, "gptq"))


@pytest.mark.anchor
def test_a_gptq_file_gptqmodel_wrote_converts_to_q4_k_m_as_closely_as_its_grid_allows(gptqmodel_source, tmp_path):
    """Over the whole evaluation text (128 windows; 8 windows swing by half a percent). GPTQModel's
    default groups are contiguous: carried into Q4_K, within 1% of the source. Act-order groups mix
    within Q4_K's sub-blocks, so no grid can be kept: the file must convert to exactly the Q4_K_M of
    its dequantized weights as a float checkpoint, byte for byte (what is guaranteed, on any machine).

    What that costs in perplexity is not ours to bound tightly: it depends on the file GPTQModel
    wrote, which differs by CPU even with threads and seeds pinned (act-order: +1.31% on an AMD EPYC
    on 2026-12-03, +0.89% on another machine, +1.67% on a fresh clone's run on 2026-12-04, against
    the float original's +1.55% on the same text; the test once asserted "less than the
    original's", which the +1.67% file broke). Only a gross-failure guard is kept: more than nothing, and under twice
    what the float original loses (rounding 4-bit weights again costs about what rounding float
    ones does: 0.57 to 1.08 times it so far)."""
    settings, folder = gptqmodel_source
    source = open_checkpoint(folder / "gptq")
    tokens = load_tokenizer(source)(EVAL_TEXT.read_text(), add_special_tokens=False)["input_ids"]

    def convert(ckpt, name):
        return [build_variant(ckpt, gguf_variant(t), tmp_path, gguf_path=tmp_path / f"{name}-{t}.gguf").files[0]
                for t in ("F32", "Q4_K_M")]

    files = convert(source, "source")
    dequantized, converted = (llama_cpp_perplexity(f, tokens) for f in files)
    print(f"GPTQModel's gptq ({settings}): dequantized source {dequantized:.3f}, Q4_K_M {converted:.3f} "
          f"({converted / dequantized - 1:+.2%})")
    if settings == "default":
        assert abs(converted / dequantized - 1) < 0.01
        return
    # folder/safetensors: our dequantized reading of the file, float32 (equal to GPTQModel's own)
    _, requantized = convert(HFCheckpoint.open(folder / "safetensors"), "dequantized")
    assert same_tensors(files[1], requantized)
    original, original_q4 = (llama_cpp_perplexity(f, tokens) for f in convert(HFCheckpoint.open(TINY), "original"))
    print(f"the float original: {original:.3f}, Q4_K_M {original_q4:.3f} ({original_q4 / original - 1:+.2%})")
    assert 0 < converted / dequantized - 1 < 2 * (original_q4 / original - 1)


def same_tensors(a, b) -> bool:
    """Two GGUF files hold the same tensors: names, types, shapes and bytes (metadata aside)."""
    from gguf import GGUFReader

    def tensors(path):
        return {t.name: (t.tensor_type, tuple(t.shape), bytes(np.asarray(t.data).view(np.uint8)))
                for t in GGUFReader(path).tensors}

    return tensors(a) == tensors(b)


def test_an_act_order_file_converts_to_the_q4_k_m_of_its_dequantized_weights(sources, tmp_path):
    """The guarantee the GPTQModel test above rests on, on our own act-order file (no anchor venv
    needed): its groups cannot keep their grid, so its Q4_K_M is that of its dequantized weights
    written as a float checkpoint, byte for byte."""
    source = open_checkpoint(source_folder(sources, "gptq"))
    build_variant(source, Variant.model_validate({"name": "dequantized", "weights": {"method": "none"},
                                                  "exports": ["safetensors"]}), tmp_path)
    a, b = (build_variant(ckpt, gguf_variant("Q4_K_M"), tmp_path, gguf_path=tmp_path / f"{name}.gguf").files[0]
            for name, ckpt in (("source", source), ("dense", HFCheckpoint.open(tmp_path / "dequantized" / "safetensors"))))
    assert same_tensors(a, b)


LLMCOMPRESSOR = REPO / ".anchors" / "llmcompressor" / "bin" / "python"


@pytest.fixture(scope="module")
def llmcompressor_source(tmp_path_factory):
    """The bundled model quantized by llm-compressor's AWQ in its own virtualenv (W4A16_ASYM: 4-bit,
    groups of 128, asymmetric, 16 calibration windows of 256 tokens): ``folder/compressed`` as its
    oneshot saves it (compressed-tensors pack-quantized), ``folder/dense`` compressed-tensors' own
    dequantization of it as a float folder."""
    import subprocess

    from safetensors.torch import save_file

    from calib.text import token_windows

    if not LLMCOMPRESSOR.exists():
        pytest.skip("llm-compressor's venv: bench/anchors/setup.sh llmcompressor (make test runs it)")
    folder = tmp_path_factory.mktemp("llmcompressor")
    windows = token_windows(load_tokenizer(HFCheckpoint.open(TINY)), BUNDLED / "calib.txt", 256, 16)
    save_file({"input_ids": windows.contiguous()}, folder / "windows.safetensors")
    run = subprocess.run([str(LLMCOMPRESSOR), str(REPO / "bench" / "anchors" / "llmcompressor_awq.py"), "--model", str(TINY),
                          "--windows", str(folder / "windows.safetensors"), "--bits", "4", "--group-size", "128",
                          "--out", str(folder), "--threads", "2"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return folder


@pytest.mark.anchor
def test_a_compressed_tensors_folder_llm_compressor_wrote_reads_as_compressed_tensors_dequantizes_it(llmcompressor_source):
    from safetensors.torch import load_file

    source = open_checkpoint(llmcompressor_source / "compressed")
    assert source.layout == "pack-quantized" and source.label == "compressed-tensors int4-g128-asym"
    assert len(source.quantized) == 7 * 6
    dense = load_file(llmcompressor_source / "dense" / "model.safetensors")
    assert sorted(source.names) == sorted(dense)
    for name in source.names:  # the norms AWQ rescaled included
        assert torch.equal(source.tensor(name), dense[name].float()), name


@pytest.mark.anchor
def test_a_compressed_tensors_folder_llm_compressor_wrote_converts_to_q4_k_m_within_one_percent(llmcompressor_source, tmp_path):
    """Its groups of 128 are carried into Q4_K's sub-blocks of 32, so the conversion adds less than
    quantizing compressed-tensors' dequantization again."""
    source = open_checkpoint(llmcompressor_source / "compressed")
    converted = q4_k_m_against_requantized(source, HFCheckpoint.open(llmcompressor_source / "dense"), tmp_path)
    assert abs(converted["ppl"] / converted["source ppl"] - 1) < 0.01
    assert converted["kld"] < 0.8 * converted["requantized kld"]


@pytest.mark.parametrize("quantization, fragment", [
    ({"quant_method": "hqq", "nbits": 4}, "quant_method 'hqq': the readable quantized checkpoints are gptq, awq"),
    ({"quant_method": "awq", "version": "exllama", "bits": 4, "group_size": 64}, "a awq quantization_config this reader does not take .version 'exllama'"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}},
     "format 'marlin-24' with 4-bit int weights by group"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64, "dynamic": {"+:model.(layers": {"bits": 8}}},
     "a gptq quantization_config this reader does not take .dynamic: a regex that does not compile"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"targets": ["re:model.(layers"], "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 64}}}},
     "targets .'re:model.\\(layers'.: missing"),
])
def test_a_quantization_config_no_reader_takes_is_refused_in_one_line(sources, tmp_path, quantization, fragment):
    import json
    import shutil

    from core.errors import InputError

    folder = tmp_path / "m"
    shutil.copytree(source_folder(sources, "awq"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    with pytest.raises(InputError, match=fragment):
        open_checkpoint(folder)
