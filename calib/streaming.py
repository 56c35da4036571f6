"""The layer-by-layer walk of ``calib.layerwise``, streamed from the checkpoint.

A conversion must not hold the whole float model (models larger than RAM convert), so the model is
built on the meta device (shapes, no storage) and only what the walk needs is read from the
checkpoint: the input embedding, to make decoder layer 0's inputs, and then one decoder layer at a
time, freed before the next is read. At its peak the walk holds one layer in float32, its inputs
and outputs ``[windows, tokens, hidden]``, and whatever the pass computes for that layer.

The work runs on CUDA when there is a GPU (the layer, its inputs and the statistics gathered from
them live there), else on the CPU.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import fields, is_dataclass, replace
from typing import Iterator, NamedTuple, TypeVar

import torch

from calib.layerwise import LayerInputs, decoder_layers, first_layer_inputs, layers_prefix, run_layer
from core.device import working_device
from core.tensors import GGMLTensor, TensorPayload, dequantized, float_rows
from formats.architecture import meta_model, transformers_config
from formats.hf import HFCheckpoint

T = TypeVar("T")


class LayerStep(NamedTuple):
    """One decoder layer of the walk, its float32 weights loaded, and the inputs it receives."""

    prefix: str  # the layer's weight-name prefix, e.g. "model.layers.3."
    layer: torch.nn.Module
    inputs: LayerInputs


def fast_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively, so that bf16 autocast speeds training up:
    CUDA GPUs, and CPUs with AVX512-BF16 or AMX (4-10x over float32 for matrix products here).
    Without them torch emulates bf16 on the CPU, slower than float32 (calib/layerwise.py)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def skeleton(ckpt: HFCheckpoint) -> torch.nn.Module:
    """The checkpoint's transformers model with every parameter on the meta device. Buffers that no
    checkpoint holds (the rotary embedding's frequencies) are computed from the config as usual.
    The checkpoint was checked against this model when it was opened, so a missing or misshapen
    tensor has stopped the run before any layer is worked on, not hours into it."""
    where = str(ckpt.path / "config.json")
    model = meta_model(transformers_config(ckpt.config, where), where).eval()
    decoder_layers(model)  # refuses models the walk does not know
    decoder = model.get_decoder()
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is not None:
        decoder.rotary_emb = type(rotary)(config=model.config).to(working_device())
    embedding = model.get_input_embeddings()
    if hasattr(embedding, "embed_scale"):  # Gemma's scaled embedding keeps its scale in a buffer, not the checkpoint
        embedding.embed_scale = torch.tensor(ckpt.arch.embedding_scale, device=working_device())
    return model


def walk_layers(ckpt: HFCheckpoint, model: torch.nn.Module, windows: torch.Tensor) -> Iterator[LayerStep]:
    """Yield each decoder layer of ``model`` (a ``skeleton``) with its weights read from ``ckpt``
    and its inputs for the token ``windows``. Whatever the consumer changes in the layer before
    asking for the next one (quantized weights, folded scales) is what the layer's outputs, the
    next layer's inputs, are computed with; then the layer returns to the meta device."""
    _map_large_allocations()
    device = working_device()
    embedding = model.get_input_embeddings()
    _load_embedding(ckpt, embedding, module_prefix(model, embedding), windows, device)
    inputs = first_layer_inputs(model, windows.to(device))
    embedding.to("meta")
    layers = decoder_layers(model)
    prefix = layers_prefix(model)
    for index, layer in enumerate(layers):
        base = f"{prefix}.{index}."
        load_weights(ckpt, layer, base, device)
        yield LayerStep(base, layer, inputs)
        if index + 1 < len(layers):  # the last layer's outputs feed nothing the walk needs
            inputs.hidden = run_layer(layer, inputs)
        layer.to("meta")
        _trim()


def float_logits(ckpt: HFCheckpoint, windows: torch.Tensor, chunk: int = 4,
                 model: torch.nn.Module | None = None) -> Iterator[torch.Tensor]:
    """The checkpoint's own next-token logits on the token ``windows``, ``chunk`` windows at a
    time (float32 ``[chunk, tokens, vocab]``), computed as the walk computes, one decoder layer in
    memory at a time: a distillation target that never needs the float model whole. ``model``, a
    ``skeleton`` of ``ckpt``, is the one to walk when the caller has hooked its modules (a
    variant's quantized activations or KV cache)."""
    model = skeleton(ckpt) if model is None else model
    last = len(decoder_layers(model)) - 1
    hidden = None
    for index, step in enumerate(walk_layers(ckpt, model, windows)):
        if index == last:
            hidden = run_layer(step.layer, step.inputs)
    device = working_device()
    norm, head, _, vocab = load_head(ckpt, model, device)
    step = max(1, HEAD_SLICE // hidden.shape[-1])
    cap = ckpt.arch.final_softcap
    with torch.inference_mode():
        for i in range(0, len(hidden), chunk):
            x = norm(hidden[i : i + chunk])
            logits = torch.empty(*x.shape[:-1], vocab, dtype=torch.float32, device=device)
            for start in range(0, vocab, step):
                logits[..., start : start + step] = x @ float_rows(head, slice(start, start + step)).to(device).T
            yield logits if cap is None else logits.div_(cap).tanh_().mul_(cap)  # Gemma 2's final soft-cap


# Weights of the output head converted to float32 at a time (64 MiB): 4096 of Llama 3's 128256 rows.
HEAD_SLICE = 2**24


class Head(NamedTuple):
    """The final norm (loaded) and the output head as the checkpoint stores it (``_head_payload``)."""

    norm: torch.nn.Module
    weight: TensorPayload
    name: str  # the head's weight name: the embedding's where they are tied
    vocab: int


def load_head(ckpt: HFCheckpoint, model: torch.nn.Module, device: torch.device) -> Head:
    """The final norm of ``model`` (a ``skeleton``) loaded from ``ckpt``, and the output head."""
    norm = model.get_decoder().norm
    load_weights(ckpt, norm, module_prefix(model, norm), device)
    name = module_prefix(model, model.get_input_embeddings() if ckpt.arch.tied_embeddings else model.get_output_embeddings())
    return Head(norm, _head_payload(ckpt, name + "weight", device), name + "weight", ckpt.shape(name + "weight")[0])


def _head_payload(ckpt: HFCheckpoint, name: str, device: torch.device) -> TensorPayload:
    """The output head as the checkpoint stores it (bfloat16, ggml blocks), for ``float_logits``
    to multiply by in float32 a slice of rows at a time: an 8B model's head is 2 GiB in float32,
    half that in bfloat16, a fifth as Q6_K. Payloads that decode only whole are decoded once."""
    payload = ckpt.payload(name)
    if isinstance(payload, GGMLTensor):
        return payload
    return payload.to(device) if isinstance(payload, torch.Tensor) else dequantized(payload).to(device)


@functools.cache
def _map_large_allocations() -> None:
    """Have glibc give every allocation over 8 MiB (a layer's weights, the windows' hidden states)
    its own mapping, returned to the system when freed; after each layer the heap's free pages go
    back too (``_trim``). By default glibc raises its mapping threshold as large blocks are freed
    and then carves the next layer's tensors, of other sizes, out of a heap whose holes it reuses
    poorly: the QAT walk over the 1B model grew by about 60 MiB a layer that way (3368 MiB after
    layer 0, 4468 after layer 13). A threshold of 128 KiB held it flat at 2909 MiB but made the
    small model's training 2.5x slower (every activation a fresh mapping); 8 MiB costs nothing
    there. A no-op off glibc."""
    if _glibc() is not None:
        _glibc().mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)


def _trim() -> None:
    if _glibc() is not None:
        _glibc().malloc_trim(0)


@functools.cache
def _glibc():
    """This process's C library if it is glibc (it has mallopt and malloc_trim), else None."""
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_THRESHOLD = 8 * 2**20


def load_weights(ckpt: HFCheckpoint, module: torch.nn.Module, prefix: str, device: torch.device) -> None:
    """Replace the module's meta parameters by the checkpoint's tensors, as float32 on ``device``."""
    state = {name: ckpt.tensor(prefix + name).to(device=device, dtype=torch.float32) for name, _ in module.named_parameters()}
    module.load_state_dict(state, strict=True, assign=True)


def _load_embedding(ckpt: HFCheckpoint, embedding: torch.nn.Module, prefix: str, windows: torch.Tensor,
                    device: torch.device) -> None:
    """The input embedding as ``_load`` gives it, but with only the rows of the tokens in ``windows``
    converted to float32 and written: the others are allocated and never touched, so their pages
    never become resident (an 8B model's embedding is 2 GiB in float32, and the evaluation's
    windows use a few thousand of its 128256 rows). Nothing but those rows is ever looked up."""
    name = prefix + "weight"
    ids = windows.unique()
    weight = torch.empty(ckpt.shape(name), dtype=torch.float32, device=device)
    weight[ids.to(device)] = float_rows(ckpt.payload(name), ids).to(device)
    embedding.load_state_dict({"weight": weight}, strict=True, assign=True)


def module_prefix(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module) + "."


def to_cpu(result: T) -> T:
    """A pass's result (a tensor, or a dataclass of tensors such as ``QuantizedTensor``, possibly
    nested) with its tensors moved to the CPU: results leave the working device as they are handed
    out."""
    if isinstance(result, torch.Tensor):
        return result.cpu()
    moved = {f.name: to_cpu(v) for f in fields(result) if isinstance(v := getattr(result, f.name), torch.Tensor) or is_dataclass(v)}
    return replace(result, **moved)
