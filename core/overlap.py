"""A map whose next items are computed in threads while the caller consumes the current one.

A variant's build reads a tensor, quantizes it (on the GPU, or in the GGUF encoders' worker
processes) and hands it to the writers, in the plan's order. Reading the file and encoding or
copying to the GPU release the GIL, so with a GPU they overlap the writers' file I/O when the next
tensors are prepared ahead; the writers still take every tensor in order, so the files' bytes are
those of the serial build.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(fn: Callable[[T], R], items: Iterable[T], ahead: int) -> Iterator[R]:
    """``fn`` of each item, in the items' order, with up to ``ahead`` items computed in threads
    beyond the one being consumed (about ``ahead + 1`` results held at once, one more while the
    consumer still holds the last: memory stays bounded). ``ahead`` 0 is the plain serial map, with no thread. An exception from ``fn`` is
    raised where its result is consumed; the work already started is then waited for, not lost
    in the background."""
    if ahead <= 0:
        yield from map(fn, items)
        return
    pending: deque[Future[R]] = deque()
    with ThreadPoolExecutor(ahead, thread_name_prefix="prepare") as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) > ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


class Behind:
    """Calls run in order in one background thread while the caller goes on (a GPU pass writing
    a fitted layer's tensors to disk while it fits the next), at most ``depth`` waiting or running:
    ``submit`` waits for the oldest first, which bounds the results held. ``depth`` 0 runs each
    call at once, in the caller's thread. Leaving the ``with`` block waits for every call, and an
    exception from one is raised there or at the next ``submit``."""

    def __init__(self, depth: int):
        self._depth = depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="behind") if depth > 0 else None
        self._pending: deque[Future[None]] = deque()

    def submit(self, call: Callable[[], None]) -> None:
        if self._pool is None:
            call()
            return
        while len(self._pending) >= self._depth:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(call))

    def __enter__(self) -> "Behind":
        return self

    def __exit__(self, *exc) -> None:
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
