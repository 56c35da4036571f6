"""A lower bound on a text's token count, known without tokenizing it.

No token covers more than ``max_token_bytes`` bytes of the text, so a text of ``n`` bytes takes at
least ``ceil(n / max_token_bytes)`` tokens, and one whose bound reaches the context is refused
before the tokenizer spends seconds and gigabytes on it. The bound is only sound where every token
stands for a bounded piece of the text, which holds for BPE over bytes (GPT-2's byte-level
alphabet, or byte fallback as Llama's and Mistral's SentencePiece models have) when no
normalizer or pre-tokenizer can drop or shrink text. Elsewhere, an unknown-word token can stand
for a whole word (WordPiece), whitespace can vanish in pre-tokenization, Unicode normalization can
compose characters into fewer bytes: there is no bound, and the text is tokenized in full, off
the event loop, within the server's body limit.
"""

from __future__ import annotations

import json
import math

# Pieces that only add text (a prefix, a space turned into U+2581) or split it and keep every part.
_GROWING_NORMALIZERS = {"Prepend", "Replace"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def max_token_bytes(tokenizer) -> int | None:
    """The most bytes of text one token of this tokenizer can stand for; None where no bound is
    sound (see the module's docstring) or the tokenizer is not a fast one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _keeps_text(spec.get("normalizer"), spec.get("pre_tokenizer")):
        return None
    byte_level = _has(spec.get("pre_tokenizer"), "ByteLevel")
    if not (byte_level or model.get("byte_fallback")):
        return None  # an unknown character would be one unknown token (or a fused run of them)
    vocab = model.get("vocab") or {}
    if not vocab:
        return None
    # Byte-level tokens spell one byte per character; other tokens spell their text (U+2581 for a
    # space, 3 bytes for 1: an over-count, which keeps the bound sound).
    longest = max(len(t) if byte_level else len(t.encode("utf-8")) for t in vocab)
    added = [len(a["content"].encode("utf-8")) for a in spec.get("added_tokens") or []]
    return max([longest, *added])


def min_tokens(text: str, per_token: int | None) -> int:
    """At least how many tokens ``text`` takes (0 where ``per_token`` is None: no bound)."""
    if per_token is None:
        return 0
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / per_token)


def _keeps_text(normalizer: dict | None, pre_tokenizer: dict | None) -> bool:
    if normalizer is not None and not all(p["type"] in _GROWING_NORMALIZERS and _replace_grows(p)
                                          for p in _parts(normalizer, "normalizers")):
        return False
    if pre_tokenizer is not None:
        for p in _parts(pre_tokenizer, "pretokenizers"):
            if p["type"] not in _KEEPING_PRE_TOKENIZERS or (p["type"] == "Split" and p.get("behavior") == "Removed"):
                return False
    return True


def _replace_grows(piece: dict) -> bool:
    """A Replace of a literal string by one at least as long in bytes (a regex could match anything)."""
    if piece["type"] != "Replace":
        return True
    pattern = piece.get("pattern") or {}
    return "String" in pattern and len(piece.get("content", "").encode()) >= len(pattern["String"].encode())


def _parts(piece: dict, key: str) -> list[dict]:
    """A normalizer's or pre-tokenizer's pieces, a Sequence flattened."""
    if piece["type"] == "Sequence":
        return [p for sub in piece.get(key) or [] for p in _parts(sub, key)]
    return [piece]


def _has(piece: dict | None, kind: str) -> bool:
    return piece is not None and any(p["type"] == kind for p in _parts(piece, "pretokenizers"))
