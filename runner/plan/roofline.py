"""The time of one serving step, by the roofline: a step reads the weights and the KV cache it
attends over once, and computes two FLOPs per active parameter per token plus attention; it takes
the longer of the two at the device's reachable bandwidth and FLOPs, plus tensor-parallel
all-reduces and a fixed per-step cost (scheduler, sampler, kernel launches).

Decode is bandwidth-bound (a batch of ``d`` sequences reads the weights once and each sequence's
cache), prefill compute-bound (a chunk of ``c`` prompt tokens is ``c`` tokens of matrix work on the
same weight read). A step of continuous batching holds both: the decode tokens of every running
sequence and, with chunked prefill, one chunk of a prompt (Sarathi-Serve's mixed batch); its time
is what the chunk adds to every other user's TPOT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from runner.fit.gpus import GPU
from runner.fit.memfit import active_weights_bytes, batch_weights_bytes
from runner.fit.model_shape import ModelShape

# Shares of the datasheet a serving engine reaches, as bounds (not benchmarks): decode kernels read
# weights and cache at about 80% of peak bandwidth (llama.cpp 0.67-0.84 on CPU, bench/fit_speed.py;
# vLLM's decode on H100 is reported at 70-85%); large matrix products reach about half of peak
# FLOPs (runner/fit/memfit.py PREFILL_UTILISATION).
BANDWIDTH_UTILISATION = 0.8
FLOPS_UTILISATION = 0.5
STEP_OVERHEAD = 0.002  # seconds per step outside the kernels: scheduling, sampling, launches (CUDA graphs)
# Seconds per running sequence per step outside the kernels (its slot in the batch's layout, its
# sampler row, its streamed chunk): negligible beside a GPU's kernels, so 0 by default; a CPU
# engine's Python bookkeeping, calibrated by bench/plan_validation.py, is not (docs/plan.md).
SEQUENCE_OVERHEAD = 0.0
ALLREDUCE_LATENCY = 10e-6  # seconds per all-reduce on NVLink-class links, whatever its size


@dataclass(frozen=True)
class Device:
    """One model copy's hardware: ``tp`` GPUs of one type with tensor parallelism, and the shares
    of their peaks it reaches. bench/plan_validation.py builds one from a CPU's measured numbers,
    with an engine's constants calibrated there."""

    gpu: GPU
    tp: int = 1
    bandwidth_utilisation: float = BANDWIDTH_UTILISATION
    flops_utilisation: float = FLOPS_UTILISATION
    step_overhead: float = STEP_OVERHEAD
    sequence_overhead: float = SEQUENCE_OVERHEAD
    # (tokens in a step, share of peak FLOPs) measured at two or more step sizes, where matrix
    # products run at a rate that grows with the rows they multiply (a CPU's do: bench/
    # plan_validation.py calibrates two points); between them the share is interpolated in
    # log(tokens), outside them held at the nearest. Empty: flops_utilisation at every size.
    flops_curve: tuple[tuple[float, float], ...] = ()

    @property
    def bandwidth(self) -> float:
        """Reachable bytes per second on one GPU."""
        return self.gpu.bandwidth * self.bandwidth_utilisation

    @property
    def flops(self) -> float:
        """Reachable FLOP/s on one GPU (the GPU's dense BF16 peak must be known)."""
        if not self.gpu.flops:
            raise ValueError(f"{self.gpu.name}: no FLOPs known")
        return self.gpu.flops * self.flops_utilisation

    def flops_at(self, tokens: float) -> float:
        """Reachable FLOP/s on one GPU in a step of ``tokens`` tokens (``flops_curve``)."""
        if not self.flops_curve:
            return self.flops
        points = sorted(self.flops_curve)
        x, xs = math.log(max(tokens, 1.0)), [math.log(t) for t, _ in points]
        if x <= xs[0]:
            share = points[0][1]
        elif x >= xs[-1]:
            share = points[-1][1]
        else:
            i = next(i for i in range(1, len(xs)) if x <= xs[i])
            share = points[i - 1][1] + (points[i][1] - points[i - 1][1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return replace(self, flops_utilisation=share, flops_curve=()).flops


@dataclass(frozen=True)
class ModelWork:
    """What one step of a model costs per token and per byte, for a variant's weights and KV dtype.
    Bytes are per GPU of a ``tp``-way tensor-parallel copy."""

    shape: ModelShape
    weights_bytes: float  # all GPUs together, as stored
    kv_bits: float  # bits per cached value
    tp: int = 1

    @cached_property
    def _active(self) -> float:
        return active_weights_bytes(self.shape, int(self.weights_bytes))

    @cached_property
    def _active_parameters(self) -> float:
        """Parameters a token multiplies by: the active ones, less an untied embedding table,
        which is looked up, not multiplied (a tied one is the output head too)."""
        names = [n for n, _ in self.shape.tensors]
        embedding = sum(math.prod(s) for n, s in self.shape.tensors if "embed_tokens" in n or n.startswith("token_embd"))
        untied = any("lm_head" in n or n.startswith("output.weight") for n in names)
        return self.shape.active_parameters - (embedding if untied else 0)

    @cached_property
    def _layers(self) -> list[tuple[float, int | None]]:
        """(values per token on one GPU, window) per layer."""
        return [(layer.values_per_token_on(self.tp), layer.window) for layer in self.shape.layers]

    def weights_read(self, batch: int) -> float:
        """Weight bytes one GPU reads in a step of ``batch`` tokens (a mixture of experts: the
        union of the experts the tokens chose)."""
        return batch_weights_bytes(self.shape, int(self.weights_bytes), self._active, max(batch, 1)) / self.tp

    def kv_read(self, context: float) -> float:
        """KV bytes one GPU reads for one sequence attending over ``context`` tokens (sliding-window
        layers stop at their window)."""
        return sum(values * min(context, window or context) for values, window in self._layers) * self.kv_bits / 8

    def kv_bytes(self, tokens: float) -> float:
        """KV bytes of one sequence of ``tokens`` tokens, whole model (what a disaggregated
        prefill hands to decode)."""
        return ModelWork(self.shape, self.weights_bytes, self.kv_bits, 1).kv_read(tokens)

    def linear_flops(self, tokens: float) -> float:
        """Matrix FLOPs of ``tokens`` tokens on one GPU: two per active parameter."""
        return 2 * self._active_parameters * tokens / self.tp

    def attention_flops(self, queries: float, context: float) -> float:
        """QKᵀ and the weighted sum of ``queries`` tokens attending over ``context`` tokens each
        (sliding windows capped), on one GPU: heads are split across it."""
        a = self.shape.arch
        heads = -(-a.heads // self.tp)
        spans = sum(min(context, window or context) for _, window in self._layers)
        return 4 * heads * a.head_dim * queries * spans


def step_seconds(work: ModelWork, device: Device, decode: float, decode_context: float, chunk: float = 0.0,
                 chunk_context: float = 0.0, prompts: float = 1.0) -> float:
    """One step: ``decode`` sequences each adding a token over ``decode_context`` cached tokens,
    and prefill chunks of ``chunk`` tokens in all, from ``prompts`` prompts, whose queries see
    ``chunk_context`` tokens on average (what came before in the prompt, the prefix cache's
    included, plus half the chunk: causal)."""
    tokens = decode + chunk
    read = work.weights_read(int(round(tokens))) + decode * work.kv_read(decode_context) + (prompts * work.kv_read(chunk_context) if chunk else 0.0)
    flops = work.linear_flops(tokens) + work.attention_flops(decode, decode_context) + work.attention_flops(chunk, chunk_context)
    kernels = max(read / device.bandwidth, flops / device.flops_at(tokens))
    sequences = decode + (prompts if chunk else 0.0)
    return kernels + allreduce_seconds(work, device, tokens) + device.step_overhead + device.sequence_overhead * sequences


def allreduce_seconds(work: ModelWork, device: Device, tokens: float) -> float:
    """Two all-reduces per layer of ``tokens`` hidden states in 16-bit (after attention and after
    the MLP), ring algorithm: each GPU sends and receives 2(tp-1)/tp of the buffer."""
    if device.tp == 1:
        return 0.0
    link = device.gpu.interconnect or device.gpu.network
    if not link:
        raise ValueError(f"{device.gpu.name}: no link between GPUs for tensor parallelism")
    size = tokens * work.shape.arch.hidden * 2
    per = ALLREDUCE_LATENCY + 2 * (device.tp - 1) / device.tp * size / link
    return 2 * work.shape.arch.layers * per
