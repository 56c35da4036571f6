"""The engine on a thread of its own, for a server's event loop.

The event loop never runs the model. It hands requests and aborts to the engine thread through an
inbox; the thread takes them between steps, runs a step, and posts each request's new tokens and
text to that request's asyncio queue. A client that leaves is aborted before the next step, so its
blocks are free at once.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from core.errors import InputError
from runner.engine.llm import LLM
from runner.engine.sampling import SamplingParams
from runner.engine.sequence import Sequence
from runner.server.metrics import ServerMetrics


# How far below the event loop the engine thread runs. With 5, a short completion's TTFT while
# hostile clients send 50 MB bodies grew by 1.8-2.9 ms (1.29-1.43x) where it grew by 4-5 ms at 0,
# and output tokens/s under serve_load were 1.08x those at 0 (6 rounds, 2026-12-05).
_ENGINE_NICE = 5


def _below_the_event_loop() -> None:
    """Lower the calling thread's scheduling priority, and so its OpenMP workers' (a thread
    inherits its creator's): their spinning between parallel regions then gives way at once to
    the event loop when a client's request wakes it. Linux only, where a thread id names one thread."""
    if sys.platform == "linux" and _ENGINE_NICE:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _ENGINE_NICE)
        except OSError:
            pass


class Overloaded(Exception):
    """The waiting queue is full: the request is refused (HTTP 429)."""


@dataclass
class Update:
    """A request's progress since its last update."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None = None
    error: tuple[int, str] | None = None  # HTTP status and message: the engine could not run it
    # in a request's first update with tokens, where its params ask for them: each prompt token's
    # log-probability after the first, and where more than 0 asked, its position's likeliest tokens
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None
    sent_text: int = 0
    sent_tokens: int = 0

    def post(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the event loop is gone (the server is shutting down)
            pass


class AsyncEngine:
    def __init__(self, llm: LLM, max_waiting: int):
        self.llm, self.engine, self.max_waiting = llm, llm.engine, max_waiting
        self.metrics = ServerMetrics()
        self._inbox: queue.SimpleQueue[tuple[str, Request]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._closing = False
        self._active: dict[int, Request] = {}  # by sequence id; the engine thread's alone
        self._thread = threading.Thread(target=self._run, name="quantbench-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; every request still open is ended and its blocks freed."""
        self._closing = True
        self._wake.set()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, jobs: list[tuple[list[int], SamplingParams]]) -> list[Request]:
        """Queue the sequences of one client request (from the event loop), all or none:
        ``Overloaded`` when, with them, more than ``max_waiting`` would wait beyond those the
        running batch has room for."""
        scheduler = self.engine.scheduler
        room = max(0, scheduler.max_num_seqs - len(scheduler.running))
        if len(scheduler.waiting) + self._inbox.qsize() + len(jobs) - 1 - room >= self.max_waiting:
            self.metrics.reject()
            raise Overloaded(f"the server has {self.max_waiting} requests waiting already"
                             + (f" and this one has {len(jobs)} sequences" if len(jobs) > 1 else "") + ": try again later")
        loop = asyncio.get_running_loop()
        requests = [Request(ids, params, loop) for ids, params in jobs]
        for request in requests:
            self._inbox.put(("add", request))
        self._wake.set()
        return requests

    def abort(self, request: Request) -> None:
        self._inbox.put(("abort", request))
        self._wake.set()

    def _run(self) -> None:
        _below_the_event_loop()
        while True:
            self._take_inbox()
            if self._closing:
                break
            if not self.engine.unfinished:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self.llm.step()
            except Exception as error:  # a bug, not a request's fault: end what runs, keep serving
                traceback.print_exc(file=sys.stderr)
                for request in list(self._active.values()):
                    self._end(request, "abort", (500, f"the engine failed: {type(error).__name__}: {error}"))
                continue
            self._publish()
        for request in list(self._active.values()):
            self._end(request, "abort", (503, "the server is shutting down"))

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, request = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    request.seq = self.engine.add(request.prompt_ids, request.params)
                except InputError as error:
                    request.post(Update("", [], [], [], "abort", (400, str(error))))
                    continue
                request.seq.arrival = request.arrival
                self._active[request.seq.id] = request
            elif request.seq is not None and request.seq.id in self._active:
                self._end(request, "abort")

    def _end(self, request: Request, reason: str, error: tuple[int, str] | None = None) -> None:
        self.engine.finish(request.seq, reason)
        self._publish_one(request, error)

    def _publish(self) -> None:
        for request in list(self._active.values()):
            self._publish_one(request)

    def _publish_one(self, request: Request, error: tuple[int, str] | None = None) -> None:
        seq = request.seq
        done = seq.finish_reason is not None
        text = self.llm.visible_text(seq) if not error else ""
        tokens = seq.output_ids[request.sent_tokens:]
        if not done and not tokens and len(text) == request.sent_text:
            return
        update = Update(text[request.sent_text:], tokens, seq.logprobs[request.sent_tokens:],
                        seq.top_logprobs[request.sent_tokens:], seq.finish_reason if done else None, error)
        if request.sent_tokens == 0 and tokens and seq.params.prompt_logprobs is not None:
            update.prompt_logprobs = list(seq.prompt_logprobs)
            update.prompt_top_logprobs = list(seq.prompt_top_logprobs) if seq.params.prompt_logprobs else None
        request.sent_text, request.sent_tokens = max(request.sent_text, len(text)), len(seq.output_ids)
        if done:
            del self._active[seq.id]
            self.metrics.observe(seq.metrics, seq.finish_reason, len(seq.prompt_ids), len(seq.output_ids))
        request.post(update)
