"""The streamed layer walk: it holds one decoder layer at a time, feeds each layer what the whole
model would, and GPTQ over it gives exactly the codes of GPTQ over the loaded model."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from calib.layerwise import decoder_layers, first_layer_inputs, input_statistics, linear_groups, run_layer
from calib.streaming import skeleton, walk_layers
from core.errors import InputError
from core.schemes import QuantSpec
from formats.hf import HFCheckpoint, load_causal_lm
from quant.gptq import GPTQSettings, gptq_quantize
from quant.gptq_model import gptq_model

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0,
             tie_word_embeddings=False, initializer_range=0.2)


def make_checkpoint(folder, model_type="llama"):
    """A small random bfloat16 checkpoint, as real ones are stored."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # biases start at zero: make them matter
    model.save_pretrained(folder)
    return HFCheckpoint.open(folder)


def windows(count=10, length=48):  # more windows than one layer batch
    return torch.randint(0, SMALL["vocab_size"], (count, length), generator=torch.Generator().manual_seed(1))


def on_meta(module):
    return all(p.is_meta for p in module.parameters())


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_the_walk_holds_one_layer_and_feeds_it_what_the_whole_model_would(tmp_path, model_type):
    ckpt = make_checkpoint(tmp_path, model_type)
    ids = windows()
    with torch.inference_mode():
        reference = load_causal_lm(ckpt)(input_ids=ids, output_hidden_states=True).hidden_states
    model = skeleton(ckpt)
    layers = decoder_layers(model)
    seen = []
    for index, (prefix, layer, inputs) in enumerate(walk_layers(ckpt, model, ids)):
        assert prefix == f"model.layers.{index}." and layer is layers[index]
        assert [on_meta(l) for l in layers] == [i != index for i in range(len(layers))]
        assert on_meta(model.get_input_embeddings()) and on_meta(model.lm_head)
        torch.testing.assert_close(inputs.hidden, reference[index], rtol=1e-5, atol=1e-5)
        seen.append(index)
    assert seen == list(range(SMALL["num_hidden_layers"]))
    assert on_meta(model)  # the last layer was freed too


def gptq_in_memory(model, ids, spec, settings):
    """GPTQ over the loaded model, with the same per-layer steps: the reference for the streamed walk."""
    inputs = first_layer_inputs(model, ids)
    results = {}
    for index, layer in enumerate(decoder_layers(model)):
        modules = dict(layer.named_modules())
        for group in linear_groups(layer, inputs):
            stats = input_statistics(layer, inputs, group)
            for n in group:
                name = f"model.layers.{index}.{n}.weight"
                results[name] = gptq_quantize(modules[n].weight.data, stats[n].hessian, spec, settings, name=name).tensor
                modules[n].weight.data = results[name].dequantize()
        inputs.hidden = run_layer(layer, inputs)
    return results


def test_streamed_gptq_gives_the_codes_of_gptq_on_the_loaded_model(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    ids = windows()
    spec, settings = QuantSpec(4, False, "group", 32), GPTQSettings(act_order=True)
    reference = gptq_in_memory(load_causal_lm(ckpt), ids, spec, settings)
    layers = list(gptq_model(ckpt, ids, spec, settings))
    assert [sorted({n.split(".")[2] for n in layer}) for layer in layers] == [["0"], ["1"], ["2"]]  # one dict per layer
    streamed = {name: result.tensor for layer in layers for name, result in layer.items()}
    assert streamed.keys() == reference.keys()
    for name, ours in streamed.items():
        assert torch.equal(ours.codes, reference[name].codes), name
        assert torch.equal(ours.scales, reference[name].scales) and torch.equal(ours.zeros, reference[name].zeros), name
        assert torch.equal(ours.group_index, reference[name].group_index), name  # act-order: every tensor has one


def test_a_missing_or_misshapen_tensor_is_named_before_any_layer_is_worked_on(tmp_path):
    make_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    save_file({**state, "model.layers.2.mlp.up_proj.weight": state["model.layers.2.mlp.up_proj.weight"][:, :32].contiguous()}, path)
    with pytest.raises(InputError, match=r"tensor 'model.layers.2.mlp.up_proj.weight' has shape \[128, 32\], the config gives \[128, 64\]"):
        skeleton(HFCheckpoint.open(tmp_path))
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, path)
    with pytest.raises(InputError, match="no tensor 'model.layers.2.mlp.up_proj.weight' in the checkpoint"):
        skeleton(HFCheckpoint.open(tmp_path))
