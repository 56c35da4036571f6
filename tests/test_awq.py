"""AWQ: folding the scales leaves the float model unchanged, and the quantized model beats RTN."""

import copy

import torch

from calib.text import sample_windows, token_windows
import pytest

from conftest import BUNDLED, EVAL_TEXT, TINY, output_change
from core.schemes import QuantSpec
from core.tensors import QuantizedTensor, dequantized
from evalsuite.metrics import causal_lm_logprobs, score
from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer, model_from_state
from quant.awq import awq_model
from quant.rtn import quantize_rtn

SPEC = QuantSpec(4, False, "group", 128)


def _setup():
    ckpt = HFCheckpoint.open(TINY)
    tok = load_tokenizer(ckpt)
    return ckpt, load_causal_lm(ckpt), sample_windows(tok, BUNDLED / "calib.txt", 512, 16), token_windows(tok, EVAL_TEXT, 512, 4)


def _with(model, layers):
    """A copy of ``model`` whose decoder-layer tensors are the ones the streamed pass handed out."""
    state = {n: p.detach().clone() for n, p in model.state_dict().items()}
    for results in layers:
        state.update({n: dequantized(p) for n, p in results.tensors.items()})
    return model_from_state(model.config, state)


def test_folded_scales_leave_the_float_model_unchanged():
    ckpt, model, calib, evaluation = _setup()
    folded = _with(model, awq_model(ckpt, calib[:4], SPEC, quantize=False))
    moved = max((a - b).abs().max().item() for a, b in zip(folded.parameters(), model.parameters()))
    assert moved > 0.1  # the norms and Linear weights really were rescaled
    with torch.inference_mode():
        torch.testing.assert_close(folded(input_ids=evaluation).logits, model(input_ids=evaluation).logits, rtol=0, atol=1e-4)


def test_awq_moves_the_model_less_than_rtn_on_the_same_grid():
    ckpt, model, calib, evaluation = _setup()
    reference = causal_lm_logprobs(model)
    rtn = copy.deepcopy(model)
    for name, module in rtn.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = quantize_rtn(module.weight.data, SPEC).dequantize()
    layers = list(awq_model(ckpt, calib, SPEC))
    assert len(layers) == len(model.model.layers)  # one dict per decoder layer, in order
    quantized = [n for results in layers for n, p in results.tensors.items() if isinstance(p, QuantizedTensor)]
    assert len(quantized) == 7 * len(model.model.layers) and all(n.endswith("_proj.weight") for n in quantized)
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(layers[0].tensors[norm], dict(model.named_parameters())[norm])  # the norm absorbed the scales
    awq = _with(model, layers)
    kld = lambda m: score(causal_lm_logprobs(m), evaluation, reference).kld
    assert kld(awq) < 0.95 * kld(rtn)


def test_awq_records_each_linears_output_error_against_the_float_model():
    """The first layer's inputs are the same in both models, so the error AWQ records there from
    its scaled weights and inputs is the change of the Linear's outputs a user's model sees."""
    ckpt, model, calib, _ = _setup()
    layers = list(awq_model(ckpt, calib[:4], SPEC))
    assert all(len(layer.errors) == 7 for layer in layers)
    assert all(0 < e < 0.5 for layer in layers for e in layer.errors.values())
    awq = _with(model, layers)
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"):
        assert layers[0].errors[module] == pytest.approx(output_change(model, awq, module, calib[:4]), rel=1e-3)
