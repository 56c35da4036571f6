"""QAT's second phase, end to end (EfficientQAT's E2E-QP): every Linear's integer codes stay where
the layer phase left them, and the scales and the norms of the whole quantized model are trained
so that its next-token distribution matches the float model's (KL divergence on the calibration
windows). The layer phase fits each block to its float twin; this phase fixes what those local
fits add up to at the output.

The teacher is the float model's distribution, computed once while its layers stream from the
checkpoint (``calib.streaming.float_logits``) and kept per position as its ``TOP_K`` largest
log-probabilities plus the probability of all the rest (``calib.distributions.TopK``). The loss is
the KL divergence over those ``TOP_K + 1`` outcomes, which never exceeds the full one.

The student holds the codes as uint8 and dequantizes one decoder layer's weights at a time: each
layer is recomputed in the backward pass (activation checkpointing), so the phase holds the codes,
the embedding and the head rather than a float copy of the model.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from calib.distributions import TopK
from calib.streaming import float_logits, skeleton
from core.device import working_device
from core.tensors import GGMLTensor, LayerResult, QuantizedTensor
from formats.hf import HFCheckpoint
from quant.qat_checkpoint import QATCheckpoint
from quant.qat_grids import fixed_codes

TOP_K = 128


class _CodesLinear(torch.nn.Module):
    """A Linear whose weight is fixed codes on trainable fp16 scales (quant/qat_grids.py)."""

    def __init__(self, tensor, bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.codes = fixed_codes(tensor, device)
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(device, torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.codes().to(x.dtype), bias)


def train_end_to_end(ckpt: HFCheckpoint, windows: torch.Tensor, layers: list[LayerResult], steps: int, lr: float,
                     batch: int, accumulate: int, seed: int, bf16: bool, checkpoint: QATCheckpoint | None = None,
                     on_step: Callable[[int, float], None] | None = None, save_seconds: float = 300.0) -> list[LayerResult]:
    """The layer phase's ``layers`` with their scales and norms trained end to end for ``steps``
    AdamW steps of ``batch`` x ``accumulate`` windows (cosine schedule from ``lr``, in relative
    units for the scales). The state is saved to ``checkpoint`` every ``save_seconds`` and at the
    end, and a saved state is taken up where it stopped. ``on_step(step, loss)`` follows training."""
    device = working_device()
    teacher = _teacher(ckpt, windows)
    model, linears = _student(ckpt, layers, device)
    norms = {n: p for n, p in model.named_parameters() if _is_norm(n)}
    trained = [*(p for m in linears.values() for p in m.codes.parameters()), *norms.values()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    start = 0
    saved = checkpoint.end_to_end() if checkpoint else None
    if saved is not None:
        state, start = saved
        order = _restore(state, trained, optimizer, generator)
    model.train()  # transformers recomputes layers in the backward pass only in training mode
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable  # its name before 5.2x
    enable({"use_reentrant": False})
    ids = windows.to(device)
    last_save = time.monotonic()
    for i in range(start, steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * i / steps))
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(accumulate):
            if len(order) < batch:  # every window once before any twice
                order = torch.cat([order, torch.randperm(len(ids), generator=generator)])
            chosen, order = order[:batch], order[batch:]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=ids[chosen], use_cache=False).logits
            loss = teacher[chosen].to(device).kl(torch.log_softmax(logits.float(), -1)).mean() / accumulate
            loss.backward()
            total += loss.item()
        optimizer.step()
        if on_step:
            on_step(i, total)
        if checkpoint and (i + 1 == steps or time.monotonic() - last_save >= save_seconds):
            checkpoint.save_end_to_end(_state(trained, optimizer, generator, order), i + 1)
            last_save = time.monotonic()
    return _results(layers, linears, norms)


@torch.no_grad()
def _teacher(ckpt: HFCheckpoint, windows: torch.Tensor) -> TopK:
    """Per position: the float model's top-k tokens and the probability left to the others."""
    return TopK.cat([TopK.of(torch.log_softmax(logits.float(), -1), TOP_K).to("cpu") for logits in float_logits(ckpt, windows)])


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _student(ckpt: HFCheckpoint, layers: list[LayerResult], device: torch.device) -> tuple[torch.nn.Module, dict]:
    """The quantized model in transformers: the layer phase's tensors, the rest from the
    checkpoint, and every quantized Linear a ``_CodesLinear`` on its codes."""
    tensors = {n: t for layer in layers for n, t in layer.tensors.items()}
    model = skeleton(ckpt)
    modules = dict(model.named_modules())
    linears = {}  # in the model's order, whatever the order of the results: the optimizer's order
    for module in list(modules):
        t = tensors.get(f"{module}.weight")
        if isinstance(t, (QuantizedTensor, GGMLTensor)):
            parent, _, child = module.rpartition(".")
            bias = None
            if modules[module].bias is not None:
                bias = tensors[f"{module}.bias"] if f"{module}.bias" in tensors else ckpt.tensor(f"{module}.bias")
            linears[module] = _CodesLinear(t, bias, device)
            setattr(modules[parent], child, linears[module])
    state = {}
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            source = tensors.get(name)
            state[name] = (source if source is not None else ckpt.tensor(name)).to(device, torch.float32)
    model.load_state_dict(state, strict=False, assign=True)
    if ckpt.arch.tied_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model, linears


def _results(layers: list[LayerResult], linears: dict[str, _CodesLinear], norms: dict) -> list[LayerResult]:
    """The layers' results with the trained scales and norms; the final norm goes with the last layer."""
    out = []
    for layer in layers:
        tensors = dict(layer.tensors)
        for name in tensors:
            module = name.removesuffix(".weight")
            if module in linears:
                tensors[name] = linears[module].codes.quantized()
            elif name in norms:
                tensors[name] = norms[name].detach().cpu().clone()
        out.append(LayerResult(tensors, layer.statistics, layer.errors))
    placed = {n for layer in out for n in layer.tensors}
    out[-1].tensors.update({n: p.detach().cpu().clone() for n, p in norms.items() if n not in placed})
    return out


def _state(trained: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, generator: torch.Generator,
           order: torch.Tensor) -> dict[str, torch.Tensor]:
    state = {f"param.{i}": p.detach() for i, p in enumerate(trained)}
    for i, p in enumerate(trained):
        for key, value in optimizer.state.get(p, {}).items():
            state[f"adam.{i}.{key}"] = value
    state["generator"] = generator.get_state()
    state["order"] = order
    return state


def _restore(state: dict[str, torch.Tensor], trained: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
             generator: torch.Generator) -> torch.Tensor:
    with torch.no_grad():
        for i, p in enumerate(trained):
            p.copy_(state[f"param.{i}"])
            moments = {k.rsplit(".", 1)[1]: v if k.endswith(".step") else v.to(p.device)  # AdamW keeps its step on the CPU
                       for k, v in state.items() if k.startswith(f"adam.{i}.")}
            if moments:
                optimizer.state[p] = moments
    generator.set_state(state["generator"])
    return state["order"]
