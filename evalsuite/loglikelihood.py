"""Log-likelihoods of continuations: what every task score is made of, here and through lm-eval.

A multiple-choice answer is the choice with the highest summed log-probability after its context;
a cloze answer is right when greedy decoding would write the target. Both come from one batched
pass per group of requests, each row right-padded: the model is causal, so padding after a row's
last token cannot change that row's log-probabilities. Only the positions a continuation needs go
through the output head.
"""

from __future__ import annotations

from typing import Sequence

import torch

from evalsuite.metrics import LogProbs

Request = tuple[list[int], list[int]]  # (context token ids, continuation token ids)

_LOGIT_BUDGET = 1 << 27  # floats of log-probabilities in flight per batch (512 MB)
# tokens per batch: rows of near the same length (they are sorted), so the positions any row's
# continuation needs start near each row's end and the output head runs on few positions; 2048
# scored the bundled tasks 2.6x faster than batches of 126 rows on the 2-core VM
_BATCH_TOKENS = 2048


def encode_pair(tokenizer, context: str, continuation: str, bos: int | None = None) -> Request:
    """Token ids of a (context, continuation) pair as lm-eval's HF model makes them: the pair is
    encoded whole and split where the context's own ids end, so the continuation's first token is
    the one the model really sees after that context (a space moves from the context's end to the
    continuation's start first, since BPE vocabularies glue a space to the word after it). An
    empty context becomes ``bos``: the continuation's first token needs something to follow."""
    stripped = context.rstrip(" ")
    continuation = context[len(stripped):] + continuation
    whole = tokenizer.encode(stripped + continuation, add_special_tokens=False)
    head = tokenizer.encode(stripped, add_special_tokens=False) if stripped else []
    if whole[: len(head)] != head:  # a merge across the boundary: fall back to encoding each half
        whole = head + tokenizer.encode(continuation, add_special_tokens=False)
    if not head:
        if bos is None:
            raise ValueError("an empty context needs a bos token id to start from")
        head = [bos]
        whole = head + whole
    return head, whole[len(head):]


def continuation_logprobs(logprobs: LogProbs, requests: Sequence[Request], max_length: int,
                          vocab_size: int) -> list[tuple[float, bool]]:
    """For each (context, continuation): the continuation's summed log-probability after its
    context, and whether greedy decoding would produce it token for token. A pair longer than
    ``max_length`` tokens loses tokens from the left of its context, as lm-eval truncates."""
    if any(not 0 < len(cont) < max_length for _, cont in requests):
        raise ValueError(f"every continuation needs 1 to {max_length - 1} tokens")
    rows = [(ctx + cont)[-max_length:] for ctx, cont in requests]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out: list[tuple[float, bool] | None] = [None] * len(rows)
    start = 0
    while start < len(order):
        width = len(rows[order[start]])
        count = max(1, min(_LOGIT_BUDGET // (width * vocab_size), _BATCH_TOKENS // width))
        batch = order[start:start + count]
        start += count
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for j, i in enumerate(batch):
            ids[j, : len(rows[i])] = torch.tensor(rows[i])
        # the first position whose prediction any continuation of the batch needs
        first = min(len(rows[i]) - 1 - len(requests[i][1]) for i in batch)
        lp = logprobs(ids, first)  # [rows, width - 1 - first, vocab]: position first + t predicts token first + t + 1
        for j, i in enumerate(batch):
            n_cont = len(requests[i][1])
            end = len(rows[i]) - 1
            picked = lp[j, end - n_cont - first:end - first]
            targets = ids[j, end - n_cont + 1:end + 1]
            total = picked.gather(-1, targets.unsqueeze(-1)).sum().item()
            out[i] = (total, bool((picked.argmax(-1) == targets).all()))
    return out  # type: ignore[return-value]


def rolling_logprob(logprobs: LogProbs, tokens: list[int], max_length: int, vocab_size: int,
                    bos: int) -> float:
    """The summed log-probability of a whole text, every token scored once: windows of up to
    ``max_length`` tokens, each scoring what the window before it left off (lm-eval's rolling
    windows), the first token after ``bos``."""
    requests: list[Request] = []
    text = [bos] + tokens
    step = max_length - 1
    for start in range(1, len(text), step):
        cont = text[start:start + step]
        requests.append((text[max(0, start + len(cont) - max_length):start], cont))
    return sum(lp for lp, _ in continuation_logprobs(logprobs, requests, max_length, vocab_size))
