"""The incremental detokenizer: text grown a few tokens at a time equals the whole output decoded in
one go, never shows half a character, and a stop string split across steps is still found."""

from __future__ import annotations

import random

import pytest

from conftest import TINY
from runner.engine.detokenizer import INCOMPLETE, Detokenizer
from runner.engine.llm import LLM
from runner.engine.sampling import SamplingParams
from runner.engine.sequence import Sequence

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


def grow(detokenizer: Detokenizer, ids: list[int], rng: random.Random) -> tuple[Sequence, list[str]]:
    """Feed ``ids`` one to three at a time, as engine steps (speculative ones add several) do."""
    seq, texts, at = Sequence(0, [1], SamplingParams(), None), [], 0
    while at < len(ids):
        at = min(len(ids), at + rng.randint(1, 3))
        seq.output_ids = ids[:at]
        detokenizer.update(seq, final=at == len(ids))
        texts.append(seq.text)
    return seq, texts


def test_grown_text_is_the_whole_decode(tokenizer):
    rng = random.Random(0)
    detokenizer = Detokenizer(tokenizer)
    unicode = tokenizer("naïve café, Straße — 東京の🚀 and «quotes»\n\n  spaced  out")["input_ids"]
    cases = [unicode] + [[rng.randrange(tokenizer.vocab_size) for _ in range(200)] for _ in range(20)]
    multibyte = [i for i in range(tokenizer.vocab_size) if INCOMPLETE in tokenizer.decode([i])]
    assert multibyte, "the tokenizer has byte tokens that are half a character"
    cases.append([rng.choice(multibyte) for _ in range(100)])  # mostly invalid byte runs
    for ids in cases:
        seq, texts = grow(detokenizer, ids, rng)
        assert seq.text == tokenizer.decode(ids, skip_special_tokens=True)
        for earlier, later in zip(texts, texts[1:]):
            assert later.startswith(earlier)
        assert not any(t.endswith(INCOMPLETE) for t in texts[:-1])


def test_half_a_character_waits_for_the_rest(tokenizer):
    ids = tokenizer("🚀")["input_ids"]
    assert len(ids) > 1, "the rocket takes several byte tokens"
    detokenizer = Detokenizer(tokenizer)
    seq = Sequence(0, [1], SamplingParams(), None)
    for n in range(1, len(ids)):
        seq.output_ids = ids[:n]
        detokenizer.update(seq)
        assert seq.text == ""
    seq.output_ids = ids
    detokenizer.update(seq)
    assert seq.text == "🚀"


def test_a_stop_string_split_across_steps_is_found():
    seq = Sequence(0, [1], SamplingParams(stop=["xyz", "never"]), None)
    seq.text = "one two x"
    assert not LLM._cut(seq, 0)
    before, seq.text = len(seq.text), seq.text + "yz three"  # the step's new text completes "xyz"
    assert LLM._cut(seq, before)
    assert seq.text == "one two "
