"""Decode steps replayed from CUDA graphs: on a GPU a step of few sequences is bound by launching its
hundreds of small kernels, not by reading the weights, and a graph launches them all at once.

At engine start one graph is captured per bucket of ``static_decode.buckets`` (the largest first,
all in one memory pool: a smaller one fits in what the larger left), each over the static
buffers' first rows, after one eager run that compiles the Triton kernels and settles the
allocator. A decode-only step fills the buffers and replays its bucket's graph; prefill and mixed
steps, and verify steps, run eagerly (engine.py). The logits land in one buffer the graphs share,
read before the next step replays.
"""

from __future__ import annotations

import torch

from runner.engine.sequence import Sequence
from runner.engine.static_decode import StaticDecode


class CudaGraphs:
    @torch.inference_mode()
    def __init__(self, decode: StaticDecode):
        self.decode, self.replays = decode, 0
        model, pool = decode.model, decode.pool
        self.logits = torch.empty(decode.buckets[-1], model.arch.vocab, dtype=torch.float32, device=pool.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        memory = None
        for bucket in reversed(decode.buckets):
            decode.fill([], bucket)  # padding rows only: they write the scratch block
            self.logits[:bucket] = model.forward(decode.step(bucket), pool)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, memory):
                self.logits[:bucket] = model.forward(decode.step(bucket), pool)
            memory = memory or graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Next-token logits of ``seqs`` (each decoding its last token), from the bucket's graph."""
        bucket = self.decode.bucket(len(seqs))
        self.decode.fill(seqs, bucket)
        self.graphs[bucket].replay()
        self.replays += 1
        return self.logits[: len(seqs)]
