"""The CPU's residual-add-and-RMSNorm kernel (runner/engine/kernels/cpu_norm.c) against torch's
``x + delta`` then ``weight * rms_norm(x)`` in each float dtype, and the engine using it."""

from __future__ import annotations

import pytest
import torch

from runner.engine.kernels import cpu_norm

pytestmark = [pytest.mark.check,  # the fast tier, `make check` (docs/testing.md)
              pytest.mark.skipif(not cpu_norm.available(torch.float32), reason="no C compiler built the CPU kernel")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows of 512: split over threads
@pytest.mark.parametrize("with_delta", [True, False])
def test_the_kernel_adds_and_norms_as_torch_does(dtype, rows, with_delta):
    """The sum is torch's exactly (one rounding to the storage type); the normed rows differ only
    where the float32 sum of squares, added in another order, moves a rounding: in a few elements
    of a thousand by a unit in the last place of bf16 or fp16, and in float32 (where the row's one
    scale moves every element) by a few units."""
    g = torch.Generator().manual_seed(rows)
    hidden = (torch.randn(rows, 512, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, 512, generator=g).to(dtype) if with_delta else None
    weight = (torch.rand(512, generator=g) + 0.5).to(dtype)
    summed = hidden + delta if with_delta else hidden.clone()
    expected = weight * torch.rms_norm(summed, (512,), eps=1e-5)
    ours = cpu_norm.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, summed)  # written in place
    assert ours.dtype == dtype and ours.shape == summed.shape
    ulp = torch.finfo(dtype).eps * expected.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((ours.float() - expected.float()).abs() <= (4 if dtype == torch.float32 else 2) * ulp).all()
    if dtype != torch.float32:  # in float32 the whole row moves with its one scale's last bit
        assert (ours != expected).float().mean() < 0.005


def test_the_engine_norms_with_the_kernel_and_keeps_transformers_tokens(tmp_path, monkeypatch):
    """On a CPU the engine's norms between blocks are the kernel's (torch's norm is made to fail
    for them here), and greedy tokens stay transformers' in float32."""
    from helpers.engine import greedy, prompts_from_text, random_model, transformers_greedy
    from runner.engine.model import DecoderModel

    calls = []
    kernel = cpu_norm.add_rms_norm
    monkeypatch.setattr(cpu_norm, "add_rms_norm", lambda *args: calls.append(1) or kernel(*args))
    monkeypatch.setattr(DecoderModel, "_norm", lambda *args: pytest.fail("torch's norm ran"))
    path = random_model(tmp_path / "llama", "llama")
    prompts = prompts_from_text([30, 5])
    assert greedy(path, prompts, 8)[0] == transformers_greedy(path, prompts, 8)
    assert calls
