"""SentencePiece-style BPE tokenizers as transformers 5 saves Llama-2's and Gemma's: a
``tokenizer.json`` alone (no ``tokenizer.model``), a BPE over "▁"-escaped text with byte fallback.

The vocabulary is trained here on the calibration text with the ``tokenizers`` library, laid out
as those models lay theirs out (special tokens, then the 256 byte pieces, then the merged pieces
and characters), and saved through transformers' own tokenizer class, so the folder is what
``save_pretrained`` writes for such a model.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import BUNDLED

# Special tokens in the order the real vocabularies start with them.
SPECIALS = {
    "llama": ["<unk>", "<s>", "</s>"],
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
}


def save_sentencepiece_bpe(folder: Path, style: str, vocab_size: int = 3000) -> dict[str, int]:
    """Train a byte-fallback BPE of ``vocab_size`` pieces and save it at ``folder`` as the ``style``
    ("llama" or "gemma") tokenizer; returns its special tokens' ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GemmaTokenizer, LlamaTokenizer

    specials = SPECIALS[style]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    # Words start with "▁", as SentencePiece's do; no piece spans two words.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)])
    tok.train([str(BUNDLED / "calib.txt")], trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    if style == "llama":
        hf = LlamaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True, legacy=False)
    else:
        hf = GemmaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True)
    hf.save_pretrained(folder)
    return {text: model["vocab"][text] for text in specials}
