"""Output text grown token by token, for streams and stop strings.

Decoding a sequence's whole output after every step costs a long answer time quadratic in its
length. Here each step decodes a short window instead: from a few tokens back (so a token whose
text depends on its neighbour, a leading space or half of a multi-byte character, decodes in
context) to the end. The text is committed only when the window ends on a whole character, so it
only ever grows, and at the end it is the text of the whole output (tested against decoding it in
one go).
"""

from __future__ import annotations

from runner.engine.sequence import Sequence

INCOMPLETE = "\ufffd"  # what a byte-level tokenizer decodes half a character to


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def update(self, seq: Sequence, final: bool = False) -> int:
        """Append the text of ``seq``'s new output tokens to ``seq.text``; ``final``: the output is
        complete, so commit what is left even if it ends mid-character. Returns the length
        ``seq.text`` had before, where new text starts."""
        before = len(seq.text)
        start, read = seq.text_window
        if read == len(seq.output_ids):
            return before
        committed = self._decode(seq.output_ids[start:read])
        window = self._decode(seq.output_ids[start:])
        if len(window) > len(committed) and (final or not window.endswith(INCOMPLETE)):
            seq.text += window[len(committed):]
            seq.text_window = (read, len(seq.output_ids))
        return before

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
