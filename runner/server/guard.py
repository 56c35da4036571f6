"""What a request body may be, checked on its raw bytes before anything parses it.

A body over ``max_bytes`` is refused with 413 as soon as its ``Content-Length`` says so, or, sent in
chunks, as soon as the bytes read pass the limit; the rest is never stored (uvicorn drops what
arrives after the response, so the client still reads its 413). A body within the limit is scanned
for its JSON shape: nesting deeper than ``max_depth`` or more than ``max_values`` values in its
arrays and objects is refused with 400 before ``json.loads`` recurses into it or pydantic walks it.
So the cost of a hostile body is bounded by the limits, not by what the client sends.
"""

from __future__ import annotations

import asyncio
import json
import re
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
SCAN_INLINE = 2**16  # bodies up to this are scanned on the event loop (well under a millisecond)

_STRING = re.compile(rb'"[^"\\]*(?:\\[\s\S]?[^"\\]*)*"?')  # never fails, so never backtracks: linear
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


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


def json_shape(body: bytes) -> tuple[int, int]:
    """A JSON text's deepest nesting and its commas outside strings (a bound on the values its
    arrays and objects hold, less one), in linear time and without recursion. Strings are blanked
    first, so brackets and commas inside them do not count. On a text that is not JSON the answer
    may be anything, but json.loads stops at the first error, and up to it the two read strings
    alike, so it never nests deeper than this says."""
    bare = _STRING.sub(b'""', body)
    brackets = np.frombuffer(bare.translate(None, _NOT_BRACKETS), np.uint8)
    if not brackets.size:
        return 0, bare.count(b",")
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max()), bare.count(b",")


def check_shape(body: bytes, limits: Limits) -> None:
    """``APIError`` 400 naming what is wrong with a body too deep or too wide to parse."""
    depth, commas = json_shape(body)
    if depth > limits.max_depth:
        raise APIError(400, f"the body nests {depth} levels deep; this server parses at most {limits.max_depth}",
                       None, "json_too_deep")
    if commas >= limits.max_values:
        raise APIError(400, f"the body holds more than {commas:,} values in its arrays and objects; this server "
                            f"parses at most {limits.max_values:,}", None, "json_too_large")


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
            if len(body) > SCAN_INLINE:
                await asyncio.to_thread(check_shape, body, self.limits)
            else:
                check_shape(body, self.limits)
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
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_bytes:  # sent in chunks, or longer than it said
                raise too_large(self.limits)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _answer(send, error: APIError) -> None:
    payload = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
