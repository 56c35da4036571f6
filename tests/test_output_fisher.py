"""The Fisher diagonals of calib/output_fisher.py: the streamed walk down gives what autograd gives
on the whole transformers model for the same drawn tokens, and the second-order estimate it makes
of a tensor's added KL divergence follows the measured one (``sensitivity: fisher``)."""

from __future__ import annotations

import pytest
import torch

from calib.output_fisher import output_fisher
from formats.hf import HFCheckpoint


def _autograd_fisher(path, windows: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """The same diagonals from the whole model with autograd: one token drawn per position from
    its distribution, as output_fisher draws them (one generator, windows in order)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sums: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}

    def collect(name):
        def hook(module, grad_input, grad_output):
            g = grad_output[0].detach().double().square().sum(tuple(range(grad_output[0].dim() - 1)))
            sums[name] = sums.get(name, 0) + g
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_full_backward_hook(collect(name + ".weight"))
            module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, a[0].detach()))
    embedding = model.get_input_embeddings()
    embedded = []
    embedding.register_forward_hook(lambda m, a, out: (out.retain_grad(), embedded.append(out))[0])
    generator = torch.Generator().manual_seed(seed)
    inputs, grads = 0, []
    for window in windows:
        logits = model(input_ids=window[None]).logits[0]
        drawn = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=generator)
        torch.log_softmax(logits, -1).gather(1, drawn).sum().backward()
        head_name = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
        inputs = inputs + seen[head_name][0].double().square().sum(0)
        # per position, the gradient at the row it read: Gemma's embedding module may scale its rows itself
        scale = (embedded[-1][0] / embedding.weight[window]).detach().double().abs().median(1, keepdim=True).values
        grads.append(embedded[-1].grad[0].double() * scale)
    positions = windows.numel()
    out = {n: s / positions for n, s in sums.items()}
    out["head inputs"] = inputs / positions
    out["embedding"] = torch.cat(grads).square()
    return out


@pytest.mark.check
@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: a scaled embedding, a soft-capped head
def test_the_streamed_walk_down_gives_autograds_diagonals(tmp_path, arch):
    from helpers.engine import random_model

    path = random_model(tmp_path / arch, arch, **({"sliding_window": 8} if arch == "gemma2" else {}))
    windows = torch.randint(0, 8192, (3, 24), generator=torch.Generator().manual_seed(1))
    ours = output_fisher(HFCheckpoint.open(path), windows)
    expected = _autograd_fisher(path, windows)
    linears = {n: v for n, v in expected.items() if n.startswith("model.layers.")}
    assert set(ours.linears) == set(linears) and len(linears) == 14
    for name, values in linears.items():
        torch.testing.assert_close(ours.linears[name], values, rtol=1e-4, atol=1e-12)
    head = "lm_head.weight"
    torch.testing.assert_close(ours.head, expected[head], rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(ours.head_inputs, expected["head inputs"], rtol=1e-4, atol=1e-12)
    # per position, not summed: where a gradient's sum cancels, float32's rounding shows, so at the tensor's scale
    torch.testing.assert_close(ours.embedding, expected["embedding"], rtol=1e-4, atol=1e-4 * float(expected["embedding"].max()))
    assert ours.head_name == head and ours.embedding_name == "model.embed_tokens.weight"
    assert all(v.gt(0).any() for v in ours.linears.values())


@pytest.mark.check
def test_the_estimate_is_half_the_fisher_weighted_squared_error():
    """By hand on a made-up diagonal: a Linear's rows weighted by its output Fisher and its columns
    by the importance; the head's by its input; the embedding's by the rows the positions read."""
    from calib.output_fisher import OutputFisher

    f = OutputFisher({"w": torch.tensor([2.0, 0.0], dtype=torch.float64)}, torch.tensor([1.0, 3.0], dtype=torch.float64),
                     torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([[1.0, 1.0], [0.0, 4.0]], dtype=torch.float64),
                     torch.tensor([1, 1]), "head", "head")
    error = torch.tensor([[1.0, 2.0], [3.0, 1.0]])
    assert f.kld("w", error, torch.tensor([1.0, 0.5])) == pytest.approx(0.5 * 2 * (1 + 4 * 0.5))
    assert f.kld("other", error, None) == 0.0
    # tied: the head's term (rows weighted 1 and 3, columns 1 and 2) and the embedding's (positions read row 1)
    head = 1 * (1 + 4 * 2) + 3 * (9 + 1 * 2)
    embedding = ((9 + 1) + (0 + 4 * 1)) / 2
    assert f.kld("head", error, None) == pytest.approx(0.5 * (head + embedding))
