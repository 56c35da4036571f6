"""What a request body may be, checked on its raw bytes before anything parses it.

A body over ``max_bytes`` is refused with 413 as soon as its ``Content-Length`` says so, or, sent in
chunks, as soon as the bytes read pass the limit; the rest is never stored (uvicorn drops what
arrives after the response, so the client still reads its 413). A body within the limit is scanned
for its JSON shape: nesting deeper than ``max_depth`` or more than ``max_values`` values in its
arrays and objects is refused with 400 before ``json.loads`` recurses into it or pydantic walks it.
So the cost of a hostile body is bounded by the limits, not by what the client sends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from runner.server.protocol import APIError

# Why 64 bytes a token: a prompt that fits the context costs well under that in JSON. Plain text runs
# 4-6 bytes a token, text escaped as \uXXXX (non-Latin scripts) about 12, a list of token ids at most
# 8 ("123456, "). The MiB on top is for fields the server reads or ignores (messages' roles, tools,
# metadata), so a small context does not refuse an ordinary request.
BYTES_PER_CONTEXT_TOKEN = 64
BASE_REQUEST_BYTES = 2**20
# Real requests nest a few levels (messages[i].content[j].text; a tool's schema a dozen): 64 leaves
# room, and stays far below Python's recursion limit, which json.loads would otherwise reach.
MAX_DEPTH = 64
SCAN_PIECE = 2**16  # scanned at a time on the event loop, then checked: about a millisecond



def default_max_request_bytes(context_tokens: int) -> int:
    """``--max-request-bytes`` when not given: 1 MiB plus 64 bytes per token of context."""
    return BASE_REQUEST_BYTES + BYTES_PER_CONTEXT_TOKEN * context_tokens


def default_max_values(context_tokens: int) -> int:
    """Values a body's arrays and objects may hold in all: a prompt of token ids as long as the
    context, four times over, plus room for a long conversation's messages."""
    return 4 * context_tokens + 2**16


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    max_depth: int
    max_values: int

    @classmethod
    def for_context(cls, context_tokens: int, max_bytes: int | None = None) -> Limits:
        return cls(max_bytes or default_max_request_bytes(context_tokens), MAX_DEPTH, default_max_values(context_tokens))


class ShapeScan:
    """A JSON text's deepest nesting and its commas outside strings (a bound on the values its
    arrays and objects hold, less one), read piece by piece as the body arrives, in a few
    vectorised passes a piece and without recursion, so a body too deep is refused at its first
    piece that shows it.

    A quote after an odd run of backslashes is escaped; the others open and close strings, and
    brackets and commas inside strings do not count. On a text that is not JSON the answer may be
    anything, but json.loads stops at its first error, and up to there both read strings alike, so
    it never nests deeper than this says."""

    def __init__(self):
        self.inside = 0  # 1 within a string
        self.escape_next = False  # the last piece ended in an odd run of backslashes
        self.depth = self.deepest = self.commas = 0

    def feed(self, piece: bytes) -> None:
        if not piece:
            return
        if not self.escape_next and b'"' not in piece and b"\\" not in piece:  # no string starts or ends here
            if self.inside:
                return  # a long text's middle: nothing in it counts
            if not any(c in piece for c in (b"[", b"]", b"{", b"}")):
                self.commas += piece.count(b",")
                return
        b = np.frombuffer(piece, np.uint8)
        quotes = b == ord('"')
        edges = np.diff((b == ord("\\")).view(np.int8), prepend=np.int8(0), append=np.int8(0))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # runs of backslashes
        lengths = ends - starts
        if self.escape_next:
            if starts.size and starts[0] == 0:
                lengths[0] += 1  # the run goes on from the last piece
            else:
                quotes[0] = False
        odd = lengths % 2 == 1
        quotes[ends[odd & (ends < b.size)]] = False
        self.escape_next = bool(ends.size and ends[-1] == b.size and odd[-1])
        parity = np.bitwise_xor.accumulate(quotes.view(np.uint8)) ^ np.uint8(self.inside)  # 1: in a string
        outside = parity == 0
        self.inside = int(parity[-1])
        steps = ((b == ord("[")) | (b == ord("{"))).view(np.int8) - ((b == ord("]")) | (b == ord("}"))).view(np.int8)
        steps = steps[(steps != 0) & outside]
        if steps.size:
            levels = np.cumsum(steps, dtype=np.int64) + self.depth
            self.deepest, self.depth = max(self.deepest, int(levels.max())), int(levels[-1])
        self.commas += int(np.count_nonzero((b == ord(",")) & outside))

    def check(self, limits: Limits) -> None:
        """``APIError`` 400 naming what is wrong with a body too deep or too wide to parse."""
        if self.deepest > limits.max_depth:
            raise APIError(400, f"the body nests more than {limits.max_depth} levels deep (at least {self.deepest} in "
                                f"its first bytes); this server parses at most {limits.max_depth}", None, "json_too_deep")
        if self.commas >= limits.max_values:
            raise APIError(400, f"the body holds more than {limits.max_values:,} values in its arrays and objects; this "
                                "server parses at most that many", None, "json_too_large")


def json_shape(body: bytes) -> tuple[int, int]:
    """A whole body's deepest nesting and commas outside strings (ShapeScan's)."""
    scan = ShapeScan()
    scan.feed(body)
    return scan.deepest, scan.commas


def too_large(limits: Limits, size: int | None = None) -> APIError:
    said = f"{size:,} bytes" if size is not None else f"more than {limits.max_bytes:,} bytes"
    return APIError(413, f"the request body is {said}; this server takes at most {limits.max_bytes:,} "
                         "(--max-request-bytes)", None, "request_too_large")


class BodyGuard:
    """ASGI middleware: reads an HTTP request's body itself, within ``limits``, checks its shape,
    and hands the app the same body; an error is answered here, so the app never sees the body."""

    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            body = await self._read(scope, receive)
            if body is None:  # the client left while sending it
                return
        except APIError as error:
            return await _answer(send, error)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only a disconnect comes

        await self.app(scope, replay, send)

    async def _read(self, scope, receive) -> bytes | None:
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_bytes:
            raise too_large(self.limits, int(length))
        chunks, size, scan = [], 0, ShapeScan()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_bytes:  # sent in chunks, or longer than it said
                raise too_large(self.limits)
            for at in range(0, len(chunk), SCAN_PIECE):
                scan.feed(chunk[at:at + SCAN_PIECE])
                scan.check(self.limits)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _answer(send, error: APIError) -> None:
    payload = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
