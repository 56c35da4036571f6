"""The engine's quantized layers on a CPU (runner/engine/linear.py): int8 codes by output channel
multiplied by oneDNN's integer kernel through exact 7-bit digit rows of the input, against the
product of the dequantized weights; torch's int8pack where there is no oneDNN; a tied output head
as a packed copy of the embedding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import runner.engine.linear as linear
from core.schemes import QuantSpec
from quant.rtn import quantize_rtn
from runner import LLM
from helpers.engine import TINY

pytestmark = [pytest.mark.check,  # the fast tier: about a second
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's layers")]


def _weight(symmetric: bool, n_out: int = 96, n_in: int = 520) -> torch.Tensor:
    w = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(1)) * 0.02
    return quantize_rtn(w, QuantSpec(8, symmetric, "channel"))


def _inputs(rows: int, n_in: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(2))
    x[:, 7] *= 60  # an outlier channel, as real activations have: the digits' scale is the row's largest
    return x.to(dtype)


def _error(ours: torch.Tensor, x: torch.Tensor, q, bias) -> float:
    expected = F.linear(x.double(), q.dequantize().double(), None if bias is None else bias.double())
    return ((ours.double() - expected).norm() / expected.norm()).item()


@pytest.mark.skipif(not linear.DIGIT_KERNEL, reason="this torch has no oneDNN integer kernel (not an x86 build)")
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_digit_rows_give_the_dequantized_product(symmetric, rows):
    """fp32 inputs as 4 digits (28 bits) come within 1e-5 of the exact product (oneDNN returns each
    digit's product in float32, and the digits' offset, 2^27 times the codes' sum, cancels after);
    bf16 inputs as 2 digits (14 bits) stray no further than bf16's own rounding of the output."""
    q = _weight(symmetric)
    bias = torch.randn(q.shape[0], generator=torch.Generator().manual_seed(3)) * 0.1
    fp32 = linear.Int8Linear(q, bias, torch.float32, torch.device("cpu"))
    assert fp32.digits == 4 and fp32.kind == "int8"
    x = _inputs(rows, q.shape[1], torch.float32)
    assert _error(fp32(x), x, q, bias) < 1e-5

    bf16 = linear.Int8Linear(q, bias.bfloat16(), torch.bfloat16, torch.device("cpu"))
    xb = _inputs(rows, q.shape[1], torch.bfloat16)
    ours = bf16(xb)
    assert ours.dtype == torch.bfloat16 and bf16.digits == 2
    bf16_rounding = _error(F.linear(xb.double(), q.dequantize().double(), bias.double()).bfloat16(), xb, q, bias)
    assert _error(ours, xb, q, bias) < 2 * bf16_rounding


@pytest.mark.skipif(not linear.DIGIT_KERNEL, reason="this torch has no oneDNN integer kernel (not an x86 build)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 300])  # 300 rows of 520: split over threads
def test_the_c_digit_rows_are_torchs(dtype, rows):
    """The C kernel's digit rows and row scales (kernels/cpu_digits.c) equal the torch path's bit for
    bit, a zero column and an outlier included."""
    from runner.engine.kernels import cpu_digits

    if not cpu_digits.available():
        pytest.skip("no C compiler built the kernel")
    layer = linear.Int8Linear(_weight(False), None, dtype, torch.device("cpu"))
    x = _inputs(rows, 520, dtype)
    x[:, 3] = 0
    ours = torch.empty(layer.digits, rows, 520, dtype=torch.uint8), torch.empty(rows, 1, dtype=layer.wide)
    torch_path = torch.empty_like(ours[0]), torch.empty_like(ours[1])
    cpu_digits.input_digits(x, *ours)
    layer._torch_digits(x, *torch_path)
    assert torch.equal(ours[0], torch_path[0]) and torch.equal(ours[1], torch_path[1])
    assert ours[0].max() <= 127 and ours[0][-1].gt(0).any()


@pytest.mark.skipif(not linear.DIGIT_KERNEL, reason="this torch has no oneDNN integer kernel (not an x86 build)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rows", [1, 300])
def test_the_c_digit_sums_are_torchs(dtype, symmetric, rows):
    """The C kernel's output from the digits' products equals the torch path's bit for bit, bias
    included; with a zero-point's offset, whose row sums C adds in another order, within one
    rounding of the output's dtype."""
    from runner.engine.kernels import cpu_digits

    if not cpu_digits.available():
        pytest.skip("no C compiler built the kernel")
    q = _weight(symmetric)
    bias = torch.randn(q.shape[0], generator=torch.Generator().manual_seed(3)).to(dtype)
    layer = linear.Int8Linear(q, bias, dtype, torch.device("cpu"))
    assert (layer.offset is None) == symmetric
    x = _inputs(rows, q.shape[1], dtype)
    digits, scale = layer._digit_rows(rows, q.shape[1])
    cpu_digits.input_digits(x, digits, scale)
    out = torch.ops.onednn.qlinear_pointwise(digits.view(-1, q.shape[1]), 1.0, 0, layer.packed, layer.weight_scales,
                                             layer.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
    out = out.view(layer.digits, rows, -1)
    ours = torch.empty(rows, q.shape[0], dtype=dtype)
    cpu_digits.digit_sums(out, layer.digit_offset, scale, x, layer.offset, layer.bias, ours)
    torch_path = layer._torch_sums(out, x, scale)
    if symmetric:
        assert torch.equal(ours, torch_path)
    else:
        torch.testing.assert_close(ours, torch_path, rtol=torch.finfo(dtype).eps, atol=torch.finfo(dtype).eps)
    assert torch.equal(layer(x), ours)


def test_int8_without_onednn_runs_on_int8pack(monkeypatch):
    q = _weight(False, n_in=512)  # int8pack's bf16 kernel wants inputs in multiples of 32
    monkeypatch.setattr(linear, "DIGIT_KERNEL", False)
    layer = linear.Int8Linear(q, None, torch.float32, torch.device("cpu"))
    assert not hasattr(layer, "packed")
    x = _inputs(3, 512, torch.float32)
    assert _error(layer(x), x, q, None) < 2e-6


def test_a_tied_head_is_a_packed_copy_of_the_embedding_on_a_cpu():
    llm = LLM(TINY, dtype="bf16", kv_memory=8 * 2**20)
    model = llm.engine.model
    assert isinstance(model.lm_head, linear.PackedLinear) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    x = torch.randn(3, model.embed.shape[1], generator=torch.Generator().manual_seed(4)).bfloat16()
    torch.testing.assert_close(model.lm_head(x).float(), F.linear(x, model.embed).float(), rtol=2e-2, atol=2e-2)
