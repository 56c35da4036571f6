"""A SentencePiece-style BPE given only as ``tokenizer.json``, read as the pieces llama.cpp's
SentencePiece tokenizer needs.

transformers 5 saves the Llama-2, Mistral and Gemma tokenizers as ``tokenizer.json`` alone: a BPE
over "▁"-escaped text with byte fallback, with no ``tokenizer.model`` beside it. GGUF carries
such a vocabulary as llama.cpp's ``llama`` tokenizer model: pieces, scores and types. llama.cpp
merges the adjacent pair whose concatenation is the highest-scoring piece, where transformers
merges the pair of lowest rank in the merge list; so each piece scores minus the rank of the
first merge that makes it, and the two merge in the same order. (llama.cpp's own converter,
``LlamaHfVocab``, gives every piece -1000, which makes llama.cpp merge left to right.) For the
files converted from a SentencePiece model, whose merges list every split of every piece in
piece order, this is SentencePiece's own order.

llama.cpp does not split the text before merging and knows one normalization: spaces become "▁",
with or without one prepended. Other normalizers and pre-tokenizers are refused, since the
tokens would differ.
"""

from __future__ import annotations

import re
from pathlib import Path

from core.errors import InputError
from formats.sentencepiece_model import BYTE, NORMAL, UNKNOWN, UNUSED, SentencePieceModel

SPACE = "\u2581"  # "▁", SentencePiece's escaped space
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def is_sentencepiece_bpe(tok: dict) -> bool:
    """Whether a tokenizer.json is a SentencePiece-style BPE (byte fallback), not a byte-level one."""
    model = tok.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def read_sentencepiece_json(tok: dict, path: Path, unk_token: str | None = None) -> SentencePieceModel:
    """The pieces (text, score, type) by id and the space-prefix setting of a tokenizer.json that
    ``is_sentencepiece_bpe``; ``unk_token`` names the unknown piece where the model does not."""
    model = tok["model"]
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise InputError(f"{path}: a BPE with {key} {model[key]!r} is not one llama.cpp's SentencePiece tokenizer runs")
    vocab: dict[str, int] = model["vocab"]
    n = max(vocab.values()) + 1
    byte_pieces = [text for text in vocab if _BYTE_PIECE.fullmatch(text)]
    if len(byte_pieces) != 256:
        raise InputError(f"{path}: byte fallback needs the 256 pieces <0x00>..<0xFF>; the vocabulary has {len(byte_pieces)}")
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges", [])]
    first_rank: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        first_rank.setdefault(left + right, rank)
    unk = model.get("unk_token") or unk_token
    pieces: list[tuple[str, float, int]] = [(f"[PAD{i}]", -10000.0, UNUSED) for i in range(n)]
    for text, i in vocab.items():
        if _BYTE_PIECE.fullmatch(text):
            pieces[i] = (text, 0.0, BYTE)
        elif text == unk:
            pieces[i] = (text, 0.0, UNKNOWN)
        elif text in first_rank:
            pieces[i] = (text, -float(first_rank[text]), NORMAL)
        else:  # a single character: below every merged piece, as SentencePiece orders them
            pieces[i] = (text, -float(len(merges) + i), NORMAL)
    return SentencePieceModel(pieces, "bpe", _adds_space_prefix(tok, vocab, path))


def _adds_space_prefix(tok: dict, vocab: dict[str, int], path: Path) -> bool:
    """Whether the text gets a "▁" in front, for the normalizations llama.cpp reproduces: Llama-2's
    and Mistral's (Metaspace, or Prepend + Replace as transformers 4 wrote them) and Gemma's
    (Replace alone; its Split on " " finds no space left after it)."""
    norm = tok.get("normalizer") or {}
    pre = tok.get("pre_tokenizer") or {}
    steps = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm] if norm else []
    kinds = [(s.get("type"), s.get("prepend") or (s.get("pattern") or {}).get("String"), s.get("content")) for s in steps]
    replace = ("Replace", " ", SPACE)
    if pre.get("type") == "Metaspace" and not steps and pre.get("replacement") == SPACE:
        if pre.get("split") and any(SPACE in text[1:] for text in vocab):
            raise InputError(f"{path}: Metaspace splits words apart but pieces hold '▁' inside; llama.cpp does not split")
        return pre.get("prepend_scheme", "always") != "never"
    gemma_split = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
    if pre and pre != gemma_split:
        raise InputError(f"{path}: pre-tokenizer {pre.get('type')} is not one llama.cpp's SentencePiece tokenizer reproduces "
                         f"(supported: Metaspace, or none after Replace(' ', '▁'))")
    if kinds == [replace]:
        return False
    if kinds == [("Prepend", SPACE, None), replace]:
        return True
    raise InputError(f"{path}: normalizer {norm.get('type')} is not one llama.cpp's SentencePiece tokenizer reproduces "
                     f"(supported: Replace(' ', '▁'), optionally after Prepend('▁'))")
