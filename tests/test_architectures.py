"""Gemma 2, Gemma 3, Qwen3, Phi-3 and Llama 3.2 through GGUF export and the engine, on random models
of each shape (tests/helpers/model_zoo.py): llama.cpp's own quantizer gives the same bytes as ours from
our F32 file, llama.cpp computes what transformers computes, and the engine decodes what
transformers' generate decodes."""

from __future__ import annotations

import json

import pytest
import torch

from formats.hf import HFCheckpoint
from helpers.model_zoo import ZOO, llama_cpp_and_transformers, make_model, zoo_model
from core.errors import InputError
from recipes.variants import build_variant, gguf_variant
from helpers.engine import greedy, prompts_from_text, transformers_greedy

NAMES = list(ZOO)
# Q3_K_M and Q4_K_M give attn_v (and Phi-3's fused attn_qkv, which llama.cpp counts as one) more
# bits in some layers; Q6_K and Q8_0 cover the rest. IQ4_XS and TQ2_0 (Q4_K embedding where untied)
# check the newer types' rules on each family's tensor names.
FILE_TYPES = ["Q4_K_M", "Q3_K_M", "Q6_K", "Q8_0", "IQ4_XS", "TQ2_0"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    # The folder is not named after the architecture: llama.cpp sets token attributes by model
    # name ("phi3" looks up Phi-3's own special tokens, which the bundled tokenizer lacks).
    return {name: zoo_model(root / f"m{i}", name) for i, name in enumerate(NAMES)}


def test_every_architecture_reads_its_conventions(zoo):
    arch = {name: HFCheckpoint.open(path).arch for name, path in zoo.items()}
    assert arch["gemma2"].windows == (32, None, 32, None) and arch["gemma2"].attn_softcap == 50.0
    assert arch["gemma3"].windows == (32,) * 5 + (None, 32) and arch["gemma3"].local_rope.theta == 10000.0
    assert arch["gemma3"].rope.theta == 1e6 and arch["gemma3"].qk_norm and arch["gemma3"].norm_offset == 1.0
    assert arch["qwen3"].qk_norm and not arch["qwen3"].post_norms and arch["qwen3"].head_dim == 64
    assert arch["phi3"].fused_projections and arch["llama3.2"].tied_embeddings
    assert arch["llama3.2"].rope.scaling == "llama3"


@pytest.mark.parametrize("file_type", FILE_TYPES)
@pytest.mark.parametrize("name", NAMES)
def test_gguf_bytes_equal_llama_quantize_of_our_f32_file(zoo, tmp_path, name, file_type):
    ggml_oracle = pytest.importorskip("helpers.ggml_oracle")
    if not ggml_oracle.available():
        pytest.skip("llama-cpp-python is the 'interop' extra (make test installs it)")
    from gguf import GGUFReader

    from core.file_types import FILE_TYPES as TYPES

    ckpt = HFCheckpoint.open(zoo[name])
    f32 = build_variant(ckpt, gguf_variant("F32"), tmp_path, gguf_path=tmp_path / "f32.gguf").files[0]
    ours = build_variant(ckpt, gguf_variant(file_type), tmp_path, gguf_path=tmp_path / "ours.gguf").files[0]
    theirs = tmp_path / "theirs.gguf"
    ggml_oracle.llama_quantize_file(f32, theirs, TYPES[file_type].id)
    a = {t.name: (t.tensor_type.name, bytes(t.data)) for t in GGUFReader(ours).tensors}
    b = {t.name: (t.tensor_type.name, bytes(t.data)) for t in GGUFReader(theirs).tensors}
    assert list(a) == list(b)
    assert {k: a[k][0] for k in a} == {k: b[k][0] for k in b}
    assert [k for k in b if a[k][1] != b[k][1]] == []
    if name == "phi3" and file_type == "Q4_K_M":  # the last layer's fused projection takes attn_v's Q6_K
        assert [a[f"blk.{i}.attn_qkv.weight"][0] for i in (0, 1)] == ["Q4_K", "Q6_K"]


@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_computes_what_transformers_computes(zoo, tmp_path, name):
    ours, ref = llama_cpp_and_transformers(zoo[name], tmp_path)
    diff = (ours - ref).abs()
    entropy = -(ref.exp() * ref).sum(-1).mean()
    print(f"{name}: mean |dlogp| {diff.mean():.2e}, max {diff.max():.2e}, entropy {entropy:.2f} nats")
    # A wrong norm offset, soft-cap, window pattern, rope or scale costs whole nats somewhere in 128
    # tokens that cross four 32-token windows; Gemma's larger activations leave ~1e-4 of rounding.
    assert diff.mean() < 3e-4 and diff.max() < 5e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.98
    assert 0.5 < entropy < 8.0  # neither one certain token nor near uniform: the check has teeth


@pytest.mark.parametrize("name", NAMES)
def test_a_gguf_file_of_every_architecture_is_a_source_that_gives_the_model_back(zoo, tmp_path, name):
    """Our F32 file (llama.cpp's converter's, test above) read as a source: the config made of its
    metadata is the model's (Gemma's attention scale and layer pattern, Llama 3's rope recovered
    from rope_freqs), every tensor the original's (Gemma's norms within their float32 offset), and
    converting it to F32 again writes the same file."""
    from formats.sources import open_checkpoint

    original = HFCheckpoint.open(zoo[name])
    f32 = build_variant(original, gguf_variant("F32"), tmp_path, gguf_path=tmp_path / "a.gguf").files[0]
    source = open_checkpoint(f32)
    assert source.arch == original.arch
    assert sorted(source.names) == sorted(original.names)
    for n in original.names:
        torch.testing.assert_close(source.tensor(n), original.tensor(n), rtol=0, atol=6e-8 if source.arch.norm_offset else 0)
    again = build_variant(source, gguf_variant("F32"), tmp_path, gguf_path=tmp_path / "b.gguf").files[0]
    assert again.read_bytes() == f32.read_bytes()


def test_the_gemma_conventions_matter_to_the_random_models(zoo, tmp_path):
    """Each Gemma 2 convention llama.cpp takes from metadata or knows by itself (soft-caps, the
    sliding windows) changes these models' outputs by far more than the parity tolerance."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([list(range(100, 228))])
    config = json.loads((zoo["gemma2"] / "config.json").read_text())
    variants = {"no soft-caps": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
                "no windows": {"sliding_window": 4096}}
    with torch.inference_mode():
        base = AutoModelForCausalLM.from_pretrained(zoo["gemma2"]).eval()(input_ids=ids).logits.log_softmax(-1)
        for label, change in variants.items():
            folder = tmp_path / label.replace(" ", "-")
            folder.mkdir()
            for f in zoo["gemma2"].iterdir():
                (folder / f.name).write_bytes(f.read_bytes())
            (folder / "config.json").write_text(json.dumps(config | change))
            other = AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=ids).logits.log_softmax(-1)
            assert (other - base).abs().mean() > 3e-2, label


@pytest.mark.parametrize("name", NAMES)
def test_the_streamed_layer_walk_computes_what_transformers_computes(zoo, name):
    """The logits the streamed evaluation scores and QAT's end-to-end phase distils from, one
    decoder layer in memory at a time: Gemma's sliding layers (windows longer than theirs) and
    Gemma 2's final soft-cap included."""
    from calib.streaming import float_logits
    from formats.hf import load_causal_lm

    ckpt = HFCheckpoint.open(zoo[name])
    windows = torch.randint(0, ckpt.arch.vocab, (3, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = load_causal_lm(ckpt)(input_ids=windows).logits
    torch.testing.assert_close(torch.cat(list(float_logits(ckpt, windows, chunk=2))), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_the_streamed_importance_matrix_is_the_whole_models(zoo, name):
    """One layer in memory, the same per-column mean squares as hooks on the whole model give,
    under the checkpoint's tensor names (Phi-3's fused projections too), the head left out."""
    import numpy as np

    from calib.imatrix import streamed_importance_matrix
    from formats.hf import load_causal_lm

    ckpt = HFCheckpoint.open(zoo[name])
    windows = torch.randint(0, ckpt.arch.vocab, (3, 48), generator=torch.Generator().manual_seed(1))
    model, whole = load_causal_lm(ckpt), {}
    hooks = [m.register_forward_pre_hook(lambda m, args, name=n: whole.setdefault(f"{name}.weight", []).append(args[0]))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.inference_mode():
        model(input_ids=windows)
    for hook in hooks:
        hook.remove()
    streamed = streamed_importance_matrix(ckpt, windows)
    assert sorted(streamed) == sorted(whole) and set(streamed) <= set(ckpt.names)
    for key, inputs in whole.items():
        expected = torch.cat(inputs).double().pow(2).reshape(-1, inputs[0].shape[-1]).mean(0).numpy()
        np.testing.assert_allclose(streamed[key], expected, rtol=1e-4, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("name", NAMES)
def test_engine_greedy_tokens_equal_transformers_generate(zoo, name):
    prompts = prompts_from_text()
    reference = transformers_greedy(zoo[name], prompts)
    assert greedy(zoo[name], prompts)[0] == reference
    # prefill in 8-token chunks beside decoding sequences, 7-token blocks: windows cut across both
    assert greedy(zoo[name], prompts, max_num_batched_tokens=8, block_size=7)[0] == reference


@pytest.mark.parametrize("model_type, change, fragment", [
    ("gemma2", {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
     "llama.cpp's gemma2 pattern"),
    ("gemma2", {"query_pre_attn_scalar": 100}, "query_pre_attn_scalar 100 is not the 64"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "sliding layers' rope .theta 20000"),
])
def test_what_llama_cpp_would_run_differently_is_refused(tmp_path, model_type, change, fragment):
    extra = dict(ZOO["gemma2" if model_type == "gemma2" else "gemma3"][1]) | change
    folder = make_model(tmp_path / "m", model_type, **extra)
    with pytest.raises(InputError, match=fragment):
        build_variant(HFCheckpoint.open(folder), gguf_variant("Q8_0"), tmp_path)
    assert not list(tmp_path.glob("**/*.gguf*"))


@pytest.mark.parametrize("name, context", [("gemma2", 1024), ("gemma3", 4096), ("gemma3", 512), ("phi3", 2048)])
def test_fit_sizes_the_kv_cache_llama_cpp_allocates_for_a_gguf_file(zoo, tmp_path, capfd, name, context):
    """llama.cpp reads only the window from a GGUF file; which layers slide (Gemma's pattern, none
    at all for Phi-3) and how big it makes their cache it decides itself. The fit calculator's
    cache for the file equals the cells llama.cpp reports at load, layer group by layer group."""
    import re

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the 'interop' extra")
    from runner.fit.gguf_shape import gguf_model_shape
    from runner.fit.memfit import ENGINES, kv_bytes_total

    folder = zoo[name]
    if name == "phi3":  # a window in the file, which llama.cpp switches off
        folder = make_model(tmp_path / "m", "phi3", sliding_window=64)
    path = build_variant(HFCheckpoint.open(folder), gguf_variant("F16"), tmp_path,
                         gguf_path=tmp_path / "m.gguf").files[0]
    capfd.readouterr()
    llama_cpp.Llama(model_path=str(path), n_ctx=context, verbose=True, swa_full=False)  # as llama-server runs it
    log = capfd.readouterr().err
    groups = [(int(c), int(n)) for c, n in re.findall(r"llama_kv_cache: size =.*?\(\s*(\d+) cells,\s*(\d+) layers", log)]
    shape = gguf_model_shape(path)
    per_token = shape.layers[0].values_per_token * 2  # f16 keys and values, equal in every layer here
    theirs = sum(cells * layers for cells, layers in groups) * per_token
    assert kv_bytes_total(shape, "fp16", context, 1, ENGINES["llamacpp"]) == theirs
    assert sum(layers for _, layers in groups) == shape.arch.layers
    if name.startswith("gemma"):
        assert len({cells for cells, _ in groups}) == (2 if context > 768 else 1)  # the windows' cache is smaller


@pytest.mark.parametrize("name", NAMES)
def test_scales_folded_as_awq_and_smoothquant_fold_them_change_no_output(zoo, name):
    """Every fold of every layer (Gemma's offset norms and pre-feedforward norm, Phi-3's fused
    rows) divides what feeds the Linears by the scales their columns are multiplied by."""
    from transformers import AutoModelForCausalLM

    from quant.folding import fold_scales, layer_mappings

    model = AutoModelForCausalLM.from_pretrained(zoo[name], dtype=torch.float64).eval()
    arch = HFCheckpoint.open(zoo[name]).arch
    ids = torch.tensor([list(range(100, 196))])
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    folds = 0
    for layer in model.model.layers:
        modules = dict(layer.named_modules())
        for fold in layer_mappings(modules, arch, "test"):
            width = modules[fold.targets[0]].in_features
            fold_scales(modules, fold, (torch.rand(width, generator=generator, dtype=torch.float64) * 3 + 0.2))
            folds += 1
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    assert folds >= 3 * arch.layers
    # float64 throughout, but Gemma's norms compute in float32: 1e-5 of rounding; a wrong fold moves units
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def calibrated(zoo, tmp_path_factory):
    """Per architecture, a GPTQ (act-order, asymmetric) and an AWQ variant fitted on the bundled
    calibration text, each with our float32 weights as evaluated beside its exports."""
    from calib.text import token_windows
    from conftest import BUNDLED
    from formats.hf import load_tokenizer
    from recipes.schema import Variant

    variants = [
        {"name": "gptq", "weights": {"method": "gptq", "bits": 4, "group_size": 64, "symmetric": False, "act_order": True},
         "exports": ["safetensors", "gptq"]},
        {"name": "awq", "weights": {"method": "awq", "bits": 4, "group_size": 64}, "exports": ["safetensors", "awq", "compressed-tensors"]},
    ]
    built = {}
    for name, folder in zoo.items():
        ckpt = HFCheckpoint.open(folder)
        windows = token_windows(load_tokenizer(ckpt), BUNDLED / "calib.txt", 128, 8)
        out = tmp_path_factory.mktemp(f"calibrated-{name}")
        for v in variants:
            build_variant(ckpt, Variant.model_validate(v), out, calibration=windows)
        built[name] = out
    return built


@pytest.mark.anchor
@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("name", NAMES)
def test_gptqmodel_reads_our_gptq_and_awq_files_of_every_architecture_back(zoo, calibrated, name, method):
    from helpers.gptqmodel import GPTQMODEL, assert_read_back_exactly, read_back

    if not GPTQMODEL.exists():
        pytest.skip("GPTQModel's venv: bench/anchors/setup.sh gptqmodel (make test runs it)")
    arch = HFCheckpoint.open(zoo[name]).arch
    linears = 5 if arch.fused_projections else 7  # Phi-3: qkv_proj, o_proj, and gate_up_proj as gate_proj and up_proj
    assert_read_back_exactly(read_back(calibrated[name] / method, method), modules=linears * arch.layers)


@pytest.mark.parametrize("name", NAMES)
def test_transformers_dequantizes_the_compressed_tensors_export_of_every_architecture(calibrated, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder = calibrated[name] / "awq"
    dense = load_file(folder / "safetensors" / "model.safetensors")  # our float32 weights, AWQ's folded norms included
    model = AutoModelForCausalLM.from_pretrained(folder / "compressed-tensors", dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    state = model.state_dict()
    assert set(dense) <= set(state)
    for tensor, weights in dense.items():
        assert torch.equal(state[tensor], weights.half().float()), tensor


def test_a_model_with_a_vision_tower_is_refused_in_one_line(tmp_path, zoo):
    import shutil

    folder = tmp_path / "gemma3-vision"
    shutil.copytree(zoo["gemma3"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": config,
                                                    "vision_config": {"model_type": "siglip_vision_model"}}))
    with pytest.raises(InputError, match="config.json: a gemma3 model with a vision tower .*Gemma3ForCausalLM"):
        HFCheckpoint.open(folder)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_phi3_gptq_and_awq_folders_read_back_with_gate_up_proj_fused_again(calibrated, method):
    """Our reader (a quantized source, the engine) takes Phi-3's split gate_proj and up_proj back
    into the one gate_up_proj the model has."""
    from safetensors.torch import load_file

    from formats.quantized_checkpoint import QuantizedCheckpoint

    folder = calibrated["phi3"] / method
    source = QuantizedCheckpoint.open(folder / method)
    dense = load_file(folder / "safetensors" / "model.safetensors")
    assert sorted(source.names) == sorted(dense)
    fused = "model.layers.1.mlp.gate_up_proj.weight"
    assert fused in source.quantized and source.shape(fused) == tuple(dense[fused].shape)
    for name in source.quantized:
        assert torch.equal(source.tensor(name), dense[name]), name

