"""Scores of a checkpoint computed as the layer walk computes them (``calib.streaming``): the
hidden states of every evaluation window go through one decoder layer at a time and the output
head runs on a few windows at a time, so scoring holds one layer, the windows' hidden states and a
chunk of logits, never the model. The original's distributions go to a reference store on the
way (evalsuite/reference.py), which the variants are then compared with."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from calib.streaming import float_logits
from evalsuite.metrics import Accumulator, Scores
from evalsuite.reference import ReferenceStore, ReferenceWriter
from formats.outputs import Outputs
from formats.sources import Source


def streamed_scores(ckpt: Source, windows: torch.Tensor, reference: ReferenceStore | None = None,
                    keep: Path | None = None, top_k: int | None = None, key: str = "", chunk: int = 4,
                    on_window: Callable[[], None] | None = None, model: torch.nn.Module | None = None) -> Scores:
    """Score ``ckpt`` on ``windows`` (against ``reference`` where given) as its layers stream, and
    with ``keep`` write its own distributions there, a reference store for the variants (``top_k``
    tokens per position, by default all where they fit; ``key`` names the model for resuming).
    ``model`` is the ``calib.streaming.skeleton`` of ``ckpt`` to walk, where its modules carry
    hooks (a variant's simulated activations or KV cache)."""
    acc = Accumulator()
    with Outputs() as outputs:
        writer = ReferenceWriter(outputs, keep, windows, ckpt.arch.vocab, top_k, key) if keep is not None else None
        index = 0
        for logits in float_logits(ckpt, windows, chunk, model):
            for window in logits:  # one window's log-probabilities at a time: [tokens - 1, vocab]
                logp = torch.log_softmax(window[:-1].float(), -1)
                acc.add(logp, windows[index, 1:].to(logp.device), reference.window(index).to(logp.device) if reference else None)
                if writer is not None:
                    writer.add(index, logp)
                index += 1
                if on_window:
                    on_window()
        if writer is not None:
            writer.finish()
        outputs.commit()
    return acc.scores(compare=reference is not None)
