"""Before/after accuracy: perplexity, KL divergence from the original, top-1 agreement.

Perplexity alone hides damage (errors can cancel); KL divergence against the original model's
next-token distribution and the share of positions where both pick the same top token show how far
a variant has moved, token by token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from calib.distributions import TopK
from evalsuite.reference import ReferenceStore


@dataclass
class Scores:
    ppl: float
    kld: float | None = None  # mean KL(original || variant) per token, nats
    top1: float | None = None  # share of positions where argmax agrees with the original
    tokens: int = 0
    # per evaluation window, for paired intervals (evalsuite/paired.py): "nll" and "kld" summed
    # over its tokens, "agree" (positions where the argmax is the original's), "tokens"
    per_window: dict[str, list[float]] | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class Accumulator:
    """Scores summed window by window, against the original's full log-probabilities or its
    ``TopK`` (the streamed evaluation's reference store)."""

    def __init__(self) -> None:
        self.nll = 0.0
        self.kld = 0.0
        self.agree = 0
        self.count = 0
        self.per_window: dict[str, list[float]] = {"nll": [], "kld": [], "agree": [], "tokens": []}

    def add(self, logp: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor | TopK | None) -> None:
        nll = -logp.gather(-1, targets.unsqueeze(-1)).sum().item()
        kld = agree = 0.0
        if isinstance(reference, TopK):
            kld = reference.kl(logp).sum().item()
            agree = (reference.top1() == logp.argmax(-1)).sum().item()
        elif reference is not None:
            kld = (reference.exp() * (reference - logp)).sum().item()
            agree = (reference.argmax(-1) == logp.argmax(-1)).sum().item()
        self.nll += nll
        self.kld += kld
        self.agree += agree
        self.count += targets.numel()
        for key, value in (("nll", nll), ("kld", kld), ("agree", agree), ("tokens", targets.numel())):
            self.per_window[key].append(value)

    def scores(self, compare: bool) -> Scores:
        n = max(self.count, 1)
        return Scores(
            ppl=math.exp(self.nll / n),
            kld=self.kld / n if compare else None,
            top1=self.agree / n if compare else None,
            tokens=self.count,
            per_window=self.per_window,
        )


# [batch, T] token ids (and ``start``) -> [batch, T - 1 - start, vocab] log-softmax: the predictions
# of positions start .. T - 2, each for the token after it
LogProbs = Callable[..., torch.Tensor]


def causal_lm_logprobs(model: torch.nn.Module) -> LogProbs:
    """Log-probabilities for the next-token positions of a batch of windows from ``start`` on.
    A task scores a few continuation tokens at the end of each row, and the output head with its
    softmax over the vocabulary is a third of a small model's time: it runs only where asked."""

    @torch.inference_mode()
    def run(windows: torch.Tensor, start: int = 0) -> torch.Tensor:
        logits = model(input_ids=windows, logits_to_keep=windows.shape[1] - start).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1)

    return run


def score(
    variant: LogProbs,
    windows: torch.Tensor,
    reference: LogProbs | ReferenceStore | None = None,
    on_window: Callable[[], None] | None = None,
) -> Scores:
    """Score ``variant`` on each window; with ``reference``, also compare it token by token.

    The reference is the original's distributions kept on disk (a recipe's store), or a model
    recomputed per window: its full distribution over the vocabulary for every token of the text
    would not fit in memory for real models.
    """
    acc = Accumulator()
    for i in range(windows.shape[0]):
        window = windows[i : i + 1]
        targets = window[:, 1:]
        logp = variant(window)
        if isinstance(reference, ReferenceStore):
            acc.add(logp[0], targets[0], reference.window(i).to(logp.device))
        else:
            acc.add(logp, targets, reference(window) if reference else None)
        if on_window:
            on_window()
    return acc.scores(compare=reference is not None)
