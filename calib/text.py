"""Turning a text file into fixed-length token windows, the unit of calibration and evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.errors import InputError


def read_text(path: Path) -> str:
    """A UTF-8 text file, or a ``.jsonl`` file of ``{"text": ...}`` records joined by blank lines."""
    if not path.is_file():
        raise InputError(f"{path}: text file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    if path.suffix == ".jsonl":
        text = "\n\n".join(_jsonl_texts(path, text))
    if not text.strip():
        raise InputError(f"{path}: text file is empty")
    return text


def _jsonl_texts(path: Path, content: str) -> list[str]:
    texts = []
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}: line {number} is not JSON ({e.msg})") from None
        except RecursionError:
            raise InputError(f"{path}: line {number} is not JSON (nested too deeply)") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f"{path}: line {number} has no string field 'text'")
        texts.append(record["text"])
    return texts


def token_windows(tokenizer, path: Path, window: int, max_windows: int | None = None) -> torch.Tensor:
    """Consecutive, non-overlapping windows of ``window`` tokens from the start of the file.

    Deterministic by construction (no sampling), so two runs score exactly the same tokens. The
    tail shorter than a window is dropped, as llama.cpp's perplexity tool does.
    """
    ids = tokenizer(read_text(path), add_special_tokens=False)["input_ids"]
    n = len(ids) // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise InputError(f"{path}: {len(ids)} tokens is shorter than one window of {window} tokens")
    return torch.tensor(ids[: n * window], dtype=torch.long).reshape(n, window)


def sample_windows(tokenizer, path: Path, window: int, max_windows: int, seed: int = 0) -> torch.Tensor:
    """Up to ``max_windows`` windows of ``window`` tokens drawn from the whole text, without overlap.

    Calibration should see all of a text, not just its beginning: the token stream is cut into
    consecutive windows and ``max_windows`` of them (all, if the text has no more) are picked at
    random, in text order. The same text, tokenizer and seed always give the same windows.
    """
    every = token_windows(tokenizer, path, window)
    picked = torch.randperm(len(every), generator=torch.Generator().manual_seed(seed))[:max_windows]
    return every[picked.sort().values]
