"""The engine on quantized variants' real low-bit weights (compressed-tensors and GPTQ exports, read
back by formats/quantized_checkpoint.py): torch's int8 and int4 weight-only kernels give the greedy
tokens, and the log-probabilities within float tolerance, of the variant's dense dequantized export."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from core.errors import InputError
from runner import LLM, SamplingParams
from helpers.engine import VARIANTS, prompts_from_text, variants  # noqa: F401  (variants: a fixture)

def expected_kind(kind: str, llm) -> str:
    """What the layers' kind starts with on this machine: on CUDA without Triton, int8, and int4
    outside bf16, run dequantized (runner/engine/linear.py and cuda_linear.py say why)."""
    from runner.engine import cuda_linear

    cuda = llm.engine.device.type == "cuda"
    if cuda and cuda_linear.lowbit_gemm is None and (kind == "int8" or (kind == "int4" and llm.engine.model.dtype != torch.bfloat16)):
        return f"dequantized {kind}"
    return kind


def run(path, prompts):
    llm = LLM(path, dtype="fp32", kv_memory=16 * 2**20)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0))
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    return llm, outs


@pytest.mark.parametrize("name", VARIANTS)
def test_low_bit_kernels_give_the_dense_exports_tokens(variants, name):
    prompts = prompts_from_text()[:8]
    _, dense = run(variants / name / "safetensors", prompts)
    for export in VARIANTS[name][1]:
        llm, ours = run(variants / name / export, prompts)
        kinds = {linear.kind for layer in llm.engine.model.layers for m in ("qkv", "o", "gate_up", "down") for linear in layer[m]}
        assert len(kinds) == 1 and kinds.pop().startswith(expected_kind(VARIANTS[name][2], llm))
        if name == "gptq-int4-actorder" and llm.engine.device.type == "cpu":  # g_idx groups: the kernel reads the inputs in group order
            assert all(layer["qkv"][0].order is not None for layer in llm.engine.model.layers)
        assert [o.token_ids for o in ours] == [o.token_ids for o in dense]
        for a, b in zip(ours, dense):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_a_recipe_variant_folder_runs_its_compressed_tensors_export(variants):
    llm = LLM(variants / "int4-g64", dtype="fp32", kv_memory=16 * 2**20)
    assert llm.engine.ckpt.path == variants / "int4-g64" / "compressed-tensors"
    assert llm.engine.model.layers[0]["qkv"][0].kind.startswith(expected_kind("int4", llm))


def test_the_low_bit_weights_are_what_the_engine_holds(variants):
    """An int4 variant's layers keep packed codes (half a byte a weight), not a float copy."""
    llm = LLM(variants / "int4-g64", dtype="bf16", kv_memory=16 * 2**20)
    qkv = llm.engine.model.layers[0]["qkv"]  # q, k and v of the tiny model: 256 + 128 + 128 rows of 256 inputs
    codes = getattr(qkv[0].packed, "codes", qkv[0].packed)  # the Triton kernel's codes on CUDA, tinygemm's otherwise
    assert len(qkv) == 1 and codes.numel() * codes.element_size() == 512 * 256 // 2
    assert not hasattr(qkv[0], "weight")


@pytest.mark.parametrize("damage, fragment", [
    (lambda folder: _drop(folder, "model.layers.0.self_attn.q_proj.weight_scale"), "no tensor 'model.layers.0.self_attn.q_proj.weight_scale'"),
    (lambda folder: _config(folder, lambda q: q.update(format="float-quantized")), "does not take (format 'float-quantized'"),
    (lambda folder: _config(folder, lambda q: q.update(quant_method="hqq")), "quant_method 'hqq'"),
])
def test_a_damaged_quantized_folder_gets_one_line(variants, tmp_path, damage, fragment):
    folder = tmp_path / "ct"
    shutil.copytree(variants / "int4-g64" / "compressed-tensors", folder)
    damage(folder)
    with pytest.raises(InputError) as e:
        LLM(folder, kv_memory=16 * 2**20)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def _drop(folder, name):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    del state[name]
    save_file(state, folder / "model.safetensors")


def _config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
