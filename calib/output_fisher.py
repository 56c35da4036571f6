"""How much each weight tensor's outputs matter to the model's next-token distribution: the diagonal
of the Fisher information with respect to every Linear's outputs, per output channel, from one
forward and one backward walk over the calibration windows, a layer in memory at a time.

Why: ``type: auto`` and ``bits: auto`` need the KL divergence that each tensor's rounding adds to
the model's distributions, on one scale across tensors (recipes/kld_gains.py). Measuring it costs
one evaluation pass of the model per tensor, about 226 passes for a 7B Llama. To second order,
perturbing a Linear's outputs ``y`` by ``δ`` adds KL ≈ ½ δᵀ F δ, with F the Fisher information of
the model's own next-token distribution with respect to ``y`` (its Hessian of the KL at δ = 0).
Kept to its diagonal, as BRECQ (Li et al., 2021) weights its block reconstructions, and with a
weight error ΔW adding δ_t = ΔW x_t at token t, the KL per token is about

    ½ Σ_j F_jj Σ_k ΔW_jk² E[x_k²]

where E[x_k²] is the importance matrix's mean squared input per column. ``F_jj`` is estimated per
output channel as the mean over the windows' positions of (∂ log p(ŷ) / ∂y_j)², where ``ŷ`` is one
token drawn at every position from the model's own distribution (the true Fisher; the text's own
next tokens would give the empirical Fisher, a worse approximation of it: Kunstner et al., 2019),
and log p(ŷ) is summed over the window. All of it costs one forward walk, keeping each decoder
layer's inputs, and one walk back down that recomputes each layer with autograd: about three
passes of the model, whatever its number of tensors.

The output head's gradient is written out (``onehot(ŷ) - p``, through Gemma's soft-cap), a slice of
its rows at a time, so its logits never need autograd; the token embedding's is the gradient at
decoder layer 0's inputs, kept per position since each position reads one row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from calib.layerwise import decoder_layers, layers_prefix, ordinary, run_layer
from calib.streaming import HEAD_SLICE, load_head, load_weights, module_prefix, skeleton, walk_layers
from core.device import working_device
from core.tensors import float_rows
from formats.hf import HFCheckpoint

# windows per layer call in the walk back down: the layer's activations are kept for its backward pass
_BATCH = 4


@dataclass
class OutputFisher:
    """Mean squared gradients of the windows' sampled log-likelihood, float64 on the CPU."""

    linears: dict[str, torch.Tensor]  # a decoder Linear's weight name -> [outputs]
    head: torch.Tensor  # [vocab]: per row of the output head, with respect to its logits
    head_inputs: torch.Tensor  # [hidden]: the head's mean squared input per column (the normed hidden states)
    embedding: torch.Tensor  # [positions, hidden]: per position, with respect to the embedding row it read
    tokens: torch.Tensor  # [positions]: the row each position read
    head_name: str  # the weight names of the head and the embedding (one tensor where they are tied)
    embedding_name: str

    def kld(self, name: str, error: torch.Tensor, importance: np.ndarray | torch.Tensor | None) -> float:
        """The KL divergence per token that a weight error ``error`` (weight - decoded) in tensor
        ``name`` adds, to second order: ``importance`` is a Linear's mean squared input per column
        (None: 1), as the importance matrix holds it; 0 for a tensor the walk saw no output of."""
        rows = error.reshape(-1, error.shape[-1])
        total = 0.0
        if name in self.linears:
            total += float(self.linears[name] @ _weighted_rows(rows, None if importance is None else torch.as_tensor(importance)))
        if name == self.head_name:
            total += float(self.head @ _weighted_rows(rows, self.head_inputs))
        if name == self.embedding_name:  # only the rows the positions read
            total += float((self.embedding * rows[self.tokens].double().square()).sum(1).mean())
        return 0.5 * total


def _weighted_rows(rows: torch.Tensor, columns: torch.Tensor | None, chunk: int = 16384) -> torch.Tensor:
    """Per row, ``Σ_k columns[k] · rows[:, k]²`` (float64; columns None: 1), a chunk of rows at a
    time: a 128256-row head squared whole in float64 would take 4 GiB."""
    out = torch.empty(rows.shape[0], dtype=torch.float64)
    weights = None if columns is None else columns.double()
    for start in range(0, rows.shape[0], chunk):
        squares = rows[start : start + chunk].double().square()
        out[start : start + chunk] = squares.sum(1) if weights is None else squares @ weights
    return out


def output_fisher(ckpt: HFCheckpoint, windows: torch.Tensor, seed: int = 0) -> OutputFisher:
    """The Fisher diagonals of ``ckpt`` on the token ``windows`` ``[windows, tokens]``; the tokens
    drawn from the model's distributions by a generator seeded with ``seed``."""
    device = working_device()
    model = skeleton(ckpt)
    layers = decoder_layers(model)
    inputs_of, kwargs_of = [], []
    top = None
    for index, step in enumerate(walk_layers(ckpt, model, windows)):
        inputs_of.append(step.inputs.hidden)
        kwargs_of.append(step.inputs.kwargs(step.layer))
        if index == len(layers) - 1:
            top = run_layer(step.layer, step.inputs)
    grad, head, head_inputs, head_name = _head_gradients(ckpt, model, ordinary(top), seed, device)
    linears: dict[str, torch.Tensor] = {}
    prefix = layers_prefix(model)
    for index in reversed(range(len(layers))):
        grad = _layer_backward(ckpt, layers[index], f"{prefix}.{index}.", inputs_of[index], kwargs_of[index], grad, linears)
        inputs_of[index] = None  # what the walk kept for this layer is no longer needed
    positions = grad.shape[0] * grad.shape[1]
    embedding = (grad.double() * ckpt.arch.embedding_scale).square().reshape(positions, -1).cpu()
    embedding_name = module_prefix(model, model.get_input_embeddings()) + "weight"
    return OutputFisher({n: s / positions for n, s in linears.items()}, head, head_inputs, embedding,
                        windows.reshape(-1).cpu(), head_name, embedding_name)


def _head_gradients(ckpt: HFCheckpoint, model: torch.nn.Module, hidden: torch.Tensor, seed: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """The gradient of each window's sampled log-likelihood at the last decoder layer's outputs,
    the head's Fisher diagonal per row and its mean squared input per column, and its weight's name."""
    norm, weight, name, vocab = load_head(ckpt, model, device)
    step = max(1, HEAD_SLICE // hidden.shape[-1])
    cap = ckpt.arch.final_softcap
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = torch.zeros(vocab, dtype=torch.float64, device=device)
    columns = torch.zeros(hidden.shape[-1], dtype=torch.float64, device=device)
    grads = []
    for window in hidden:
        h = window.detach().requires_grad_()
        x = norm(h)
        columns += x.detach().double().square().sum(0)
        logits = torch.empty(x.shape[0], vocab, dtype=torch.float32, device=device)
        for start in range(0, vocab, step):
            logits[:, start : start + step] = x.detach() @ float_rows(weight, slice(start, start + step)).to(device).T
        if cap is not None:
            squashed = torch.tanh(logits / cap)
            logits = squashed * cap
        p = torch.softmax(logits, -1)
        drawn = torch.multinomial(p, 1, generator=generator)
        g = -p
        g.scatter_add_(1, drawn, torch.ones_like(drawn, dtype=g.dtype))  # d log p(drawn) / d logits
        if cap is not None:
            g *= 1 - squashed.square()
        rows += g.double().square().sum(0)
        grad_x = torch.zeros_like(x)
        for start in range(0, vocab, step):
            grad_x += g[:, start : start + step] @ float_rows(weight, slice(start, start + step)).to(device)
        x.backward(grad_x)
        grads.append(h.grad)
    positions = hidden.shape[0] * hidden.shape[1]
    norm.to("meta")
    return torch.stack(grads), (rows / positions).cpu(), (columns / positions).cpu(), name


def _layer_backward(ckpt: HFCheckpoint, layer: torch.nn.Module, prefix: str, inputs: torch.Tensor, kwargs: dict,
                    grad: torch.Tensor, sums: dict[str, torch.Tensor]) -> torch.Tensor:
    """The gradient at the layer's inputs, given the one at its outputs, the layer recomputed from
    its inputs with autograd; each Linear's squared output gradients summed into ``sums``."""
    load_weights(ckpt, layer, prefix, grad.device)

    def collect(name: str):
        def hook(module, grad_input, grad_output):
            total = grad_output[0].detach().double().square().sum(tuple(range(grad_output[0].dim() - 1)))
            sums[name] = sums[name] + total.cpu() if name in sums else total.cpu()
        return hook

    hooks = [m.register_full_backward_hook(collect(f"{prefix}{n}.weight")) for n, m in layer.named_modules()
             if isinstance(m, torch.nn.Linear)]
    kwargs = ordinary(kwargs)
    out = torch.empty_like(grad)
    try:
        for start in range(0, len(inputs), _BATCH):
            x = ordinary(inputs[start : start + _BATCH]).requires_grad_()
            y = layer(x, **kwargs)
            (y[0] if isinstance(y, tuple) else y).backward(grad[start : start + _BATCH])
            out[start : start + _BATCH] = x.grad
    finally:
        for hook in hooks:
            hook.remove()
        layer.to("meta")
    return out
