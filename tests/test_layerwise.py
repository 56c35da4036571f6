"""Layer-by-layer calibration: the walk reproduces the model, groups follow the data flow, and
Hessians are those of the modules' real inputs."""

import pytest
import torch

from calib.layerwise import decoder_layers, first_layer_inputs, input_statistics, linear_groups, run_layer
from calib.text import token_windows
from conftest import BUNDLED, TINY
from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)


def _tiny(windows=4, length=128):
    ckpt = HFCheckpoint.open(TINY)
    model = load_causal_lm(ckpt)
    return model, token_windows(load_tokenizer(ckpt), BUNDLED / "calib.txt", length, windows)


def test_walking_the_layers_gives_the_models_logits():
    model, windows = _tiny(windows=10)  # more than one batch of windows
    inputs = first_layer_inputs(model, windows)
    for layer in decoder_layers(model):
        inputs.hidden = run_layer(layer, inputs)
    with torch.inference_mode():
        ours = model.lm_head(model.model.norm(inputs.hidden))
        ref = model(input_ids=windows).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_linear_groups_follow_the_data_flow_of_a_llama_block():
    model, windows = _tiny()
    groups = linear_groups(decoder_layers(model)[0], first_layer_inputs(model, windows))
    assert groups == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                      ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


def test_input_statistics_are_those_of_the_modules_real_inputs():
    model, windows = _tiny()
    inputs = first_layer_inputs(model, windows)
    layer = decoder_layers(model)[0]
    seen = []
    handle = layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    run_layer(layer, inputs)
    handle.remove()
    x = torch.cat(seen).double()
    stats = input_statistics(layer, inputs, ["mlp.down_proj"])["mlp.down_proj"]
    assert stats.tokens == len(x)
    torch.testing.assert_close(stats.hessian.double(), 2 * x.T @ x / len(x), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(stats.abs_mean.double(), x.abs().mean(0), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats.abs_max.double(), x.abs().amax(0))


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "phi3", "qwen3"])
def test_the_walk_gives_the_logits_of_models_whose_layers_differ(tmp_path, name):
    """Gemma's sliding and global layers get their own masks and rope: each layer is called with
    what the model itself passes it (Gemma 3's seven layers: five sliding ones, one global)."""
    from helpers.model_zoo import zoo_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(zoo_model(tmp_path / "m", name), dtype=torch.float32).eval()
    windows = torch.randint(0, 8192, (3, 96), generator=torch.Generator().manual_seed(0))  # three 32-token windows
    inputs = first_layer_inputs(model, windows)
    for layer in decoder_layers(model):
        inputs.hidden = run_layer(layer, inputs)
    with torch.inference_mode():
        ours = model.lm_head(model.model.norm(inputs.hidden))
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:
            ours = torch.tanh(ours / cap) * cap
        ref = model(input_ids=windows).logits
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
