"""How the bundled tasks were made, so anyone can remake them: ``python make.py PERSUASION.txt``.

The source is Jane Austen's *Persuasion* (1818, public domain), from chapter 9 on: the model never
saw the book in training, and the report's perplexity text (``../eval.txt``) is chapters 1 to 8,
so no task passage is also scored for perplexity. Paragraphs are split into sentences at
``. ! ?`` followed by a space; everything is decided by the text and one seed.

- ``persuasion_cloze.jsonl`` (LAMBADA-style): 100 words of the book that end just before the last
  word of a sentence or clause; the target is that word, which occurs at least twice in the
  passage. Right when greedy decoding writes the word.
- ``persuasion_order.jsonl`` (multiple choice): two sentences, then the true next sentence and
  three copies of it with one pair of neighbouring words swapped. Right when the true sentence has
  the highest log-probability.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

HELD_OUT_FROM = "Chapter 9"
CLOZE, CHOICE = 500, 500
_PASSAGE = 100
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")
_FINAL_WORD = re.compile(r"^([A-Za-z]{3,})[.,;:!?]['\"]?$")  # a word that ends a sentence or clause


def paragraphs(text: str) -> list[str]:
    body = text[text.index(HELD_OUT_FROM):]
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", body)]
    return [p for p in paras if len(p.split()) >= 12 and not p.startswith("Chapter")]


def cloze(paras: list[str], rng: random.Random) -> list[dict]:
    """Words that end a sentence or clause and occur at least twice in the 100 words before them
    (the passage may cross paragraphs): the passage is what makes them guessable."""
    words = " ".join(paras).split()
    bare = [w.strip(".,;:!?'\"()-_") for w in words]
    found = []
    for k in range(_PASSAGE, len(words)):
        m = _FINAL_WORD.match(words[k])
        if m and bare[k - _PASSAGE:k].count(m.group(1)) >= 2:
            found.append({"context": " ".join(words[k - _PASSAGE:k]), "target": " " + m.group(1)})
    rng.shuffle(found)
    return found[:CLOZE]


def word_order(paras: list[str], rng: random.Random) -> list[dict]:
    """A sentence after the two before it, against three copies with one pair of neighbouring
    words swapped: the same words and length, so only fluency tells them apart."""
    examples = []
    for p in paras:
        parts = _SENTENCE.split(p)
        for k in range(1, len(parts)):
            words = parts[k].split()
            if not 6 <= len(words) <= 30:
                continue
            choices = [parts[k]]
            for i in rng.sample(range(len(words) - 1), 3):
                swapped = list(words)
                swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
                choices.append(" ".join(swapped))
            if len(set(choices)) < 4:
                continue
            true = choices[0]
            rng.shuffle(choices)
            examples.append({"context": " ".join(parts[max(0, k - 2):k]), "choices": [" " + c for c in choices],
                             "gold": choices.index(true)})
    rng.shuffle(examples)
    return examples[:CHOICE]


def main(source: Path) -> None:
    paras = paragraphs(source.read_text(encoding="utf-8"))
    here = Path(__file__).parent
    for name, examples in (("persuasion_cloze", cloze(paras, random.Random(0))),
                           ("persuasion_order", word_order(paras, random.Random(1)))):
        with open(here / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for e in examples:
                f.write(json.dumps(e, ensure_ascii=False) + "\n")
        print(f"{name}: {len(examples)} examples")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
