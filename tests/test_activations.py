"""Simulated activation quantization: per-token int8 within half a step, fp8 exactly as torch casts,
and hooks that act only inside their block."""

import pytest
import torch

from core.errors import InputError
from core.schemes import ActivationSpec
from quant.activations import fake_quantize, simulated_activations

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)


def _tokens() -> torch.Tensor:
    """Tokens of very different sizes, one all-zero, a few channels much larger than the rest."""
    x = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0))
    x[:, :, 7] *= 30.0
    x *= torch.logspace(-3, 2, 40).view(1, 40, 1)
    x[1, 5] = 0.0
    return x


def test_int8_is_per_token_round_to_nearest_within_half_a_step():
    x = _tokens()
    q = fake_quantize(x, ActivationSpec("int8"))
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((q - x).abs() <= step / 2 * (1 + 1e-5)).all()  # a per-tensor scale would break this for small tokens
    codes = q / step.clamp(min=1e-30)
    torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-3)  # on each token's own grid
    assert codes.abs().max() <= 127 + 1e-3
    torch.testing.assert_close(q.abs().amax(-1), x.abs().amax(-1))  # each token's largest entry is exact
    assert torch.equal(q[1, 5], torch.zeros(96))


def test_fp8_codes_are_torchs_e4m3_cast_of_the_token_scaled_input():
    x = _tokens()
    q = fake_quantize(x, ActivationSpec("fp8"))
    scale = (x.abs().amax(-1, keepdim=True) / 448).clamp(min=torch.finfo(torch.float32).tiny)
    cast = (x / scale).to(torch.float8_e4m3fn).to(torch.float32)
    torch.testing.assert_close(q / scale, cast, rtol=1e-6, atol=0)
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q.abs().amax(-1), x.abs().amax(-1))  # 448 itself is an e4m3 value
    normal = (x / scale).abs() >= 2.0**-6  # e4m3: 3 mantissa bits, relative error at most 2^-4 when normal
    assert ((q - x).abs()[normal] <= x.abs()[normal] * 2.0**-4 * (1 + 1e-6)).all()


def test_hooks_quantize_only_the_named_linears_and_only_inside_the_block():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(5, 32)
    plain = model(x)
    with simulated_activations(model, ActivationSpec("int8"), ["2"]):
        inside = model(x)
    expected = model[2](fake_quantize(model[1](model[0](x)), ActivationSpec("int8")))
    torch.testing.assert_close(inside, expected, rtol=0, atol=0)
    assert not torch.equal(inside, plain)
    torch.testing.assert_close(model(x), plain, rtol=0, atol=0)  # hooks removed


def test_naming_a_module_that_is_not_a_linear_is_an_input_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(InputError, match=r"^activation quantization: '1' is not a Linear module of the model$"):
        with simulated_activations(model, ActivationSpec("fp8"), ["1"]):
            pass
