"""llama.cpp's view of a GGUF file (through llama-cpp-python, the 'interop' extra): perplexity over
whole windows, and the KL divergence one file adds to another's next-token distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch


def llama_cpp_log_probs(path, tokens: list[int], window: int = 256):
    """llama.cpp's next-token log-probabilities over each whole window of ``tokens`` (a fresh cache
    per window), with the tokens they predict."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the 'interop' extra")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=window, logits_all=True, verbose=False, n_threads=2)
    for start in range(0, len(tokens) - window + 1, window):
        ids = tokens[start : start + window]
        llm.reset()
        llm.eval(ids)
        logits = torch.tensor(np.asarray(llm.scores[: window - 1]), dtype=torch.float64)
        yield logits.log_softmax(-1), torch.tensor(ids[1:])


def llama_cpp_perplexity(path, tokens: list[int], window: int = 256) -> float:
    nll, count = 0.0, 0
    for log_probs, targets in llama_cpp_log_probs(path, tokens, window):
        nll -= log_probs[torch.arange(len(targets)), targets].sum().item()
        count += len(targets)
    return math.exp(nll / count)


def llama_cpp_added_kld(source, converted, tokens: list[int], window: int = 256) -> float:
    """Mean KL divergence of the converted file's next-token distribution from the source file's,
    both run by llama.cpp: what the conversion alone adds."""
    total, count = 0.0, 0
    for (p, _), (q, _) in zip(llama_cpp_log_probs(source, tokens, window), llama_cpp_log_probs(converted, tokens, window)):
        total += (p.exp() * (p - q)).sum().item()
        count += len(p)
    return total / count
