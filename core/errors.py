"""The one error type for a user's mistake, which every layer raises and the command line prints as
one line (no traceback, exit status 2)."""

from __future__ import annotations


class InputError(Exception):
    """A mistake in what the user gave us (a file, a recipe field, a flag).

    The message is one line that names the offending file, field or tensor; the command line prints
    it without a traceback and exits with status 2. Names come from untrusted files, so control
    characters in them are shown escaped and a message of runaway length is cut in the middle:
    whatever a file holds, the error stays one readable line.
    """

    def __init__(self, message: str):
        super().__init__(_one_line(str(message)))


def _one_line(text: str, limit: int = 1000) -> str:
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= limit else f"{text[: limit * 3 // 4]} ... {text[-limit // 4 :]}"
