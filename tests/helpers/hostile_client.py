"""A misbehaving client in a process of its own (so its work does not share the measuring test's
interpreter lock): sends hostile requests of the kinds given (joined by +, taken in turn) to a server until stopped,
printing each reply's status and error code, one line each; GAP seconds pass between one reply and
the next request (0: a flood).

    python tests/helpers/hostile_client.py URL KIND[+KIND...] [GAP]

KIND: big (50 MB, its Content-Length announced), chunked (50 MB, unannounced), deep (JSON nested
100,000 deep), health (a benign GET /health, for comparison).
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time

import httpx

MB = 1_000_000
HEAD, TAIL, PIECE = b'{"model": "tiny", "prompt": "', b'"}', b"word " * (MB // 5)
BIG = len(HEAD) + 50 * len(PIECE) + len(TAIL)  # a 50 MB prompt, sent 1 MB at a time
DEEP = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def fifty_mb():
    yield HEAD
    for _ in range(50):
        yield PIECE
    yield TAIL


def send(client: httpx.Client, kind: str) -> httpx.Response:
    json_type = {"content-type": "application/json"}
    if kind == "big":  # announced: Content-Length says 50 MB
        return client.post("/v1/completions", content=fifty_mb(), headers={**json_type, "content-length": str(BIG)})
    if kind == "chunked":  # unannounced: Transfer-Encoding: chunked
        return client.post("/v1/completions", content=fifty_mb(), headers=json_type)
    if kind == "health":
        return client.get("/health")
    return client.post("/v1/completions", content=DEEP, headers=json_type)


def main(url: str, kinds: str, gap: str = "0") -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Only the cores' idle time: on a shared test machine the sender's own work (making and sending
    # its bodies) is not the server's cost, and would otherwise be measured as if it were.
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with httpx.Client(base_url=url, timeout=60) as client:
        for kind in itertools.cycle(kinds.split("+")):
            reply = send(client, kind)
            code = (reply.json().get("error") or {}).get("code") if reply.headers.get("content-type") == "application/json" else None
            print(reply.status_code, code, flush=True)
            time.sleep(float(gap))


if __name__ == "__main__":
    main(*sys.argv[1:])
