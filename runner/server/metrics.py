"""``/metrics`` in Prometheus' text format: latency histograms the engine thread fills as requests
finish, and gauges read from the engine when scraped.

Names follow Prometheus' conventions (``_seconds``, ``_total``); a scrape costs no engine step.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from runner.engine.sequence import Metrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{"+Inf" if bound == float("inf") else bound}"}} {running}')
        return out + [f"{name}_sum {self.total}", f"{name}_count {running}"]


class ServerMetrics:
    """What the server counts; ``observe`` runs on the engine thread, ``render`` on the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft, self.tpot, self.e2e = Histogram(), Histogram(), Histogram()
        self.finished: dict[str, int] = {}
        self.prompt_tokens = self.generation_tokens = self.rejected = 0

    def observe(self, metrics: Metrics, finish_reason: str, prompt_tokens: int, output_tokens: int) -> None:
        with self._lock:
            self.e2e.observe(metrics.e2e_s)
            if output_tokens:
                self.ttft.observe(metrics.ttft_s)
            if output_tokens > 1:
                self.tpot.observe(metrics.tpot_s)
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += output_tokens

    def reject(self) -> None:
        with self._lock:
            self.rejected += 1

    def render(self, engine: list[tuple[str, str, str, float]]) -> str:
        """The exposition text; ``engine``: (name, kind, help, value) of what the engine holds now."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP quantbench_{name} {help_}", f"# TYPE quantbench_{name} {kind}"])
            lines.extend(f"quantbench_{s}" for s in samples)

        with self._lock:
            for name, help_, hist in (("time_to_first_token_seconds", "Request arrival to its first token.", self.ttft),
                                      ("time_per_output_token_seconds", "Mean gap between a request's later tokens.", self.tpot),
                                      ("e2e_request_latency_seconds", "Request arrival to its last token.", self.e2e)):
                metric(name, "histogram", help_, hist.lines(name))
            metric("requests_finished_total", "counter", "Requests ended, by finish reason (abort: the client left).",
                   [f'requests_finished_total{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())])
            metric("requests_rejected_total", "counter", "Requests refused with 429: the waiting queue was full.",
                   [f"requests_rejected_total {self.rejected}"])
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [f"prompt_tokens_total {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter", "Tokens generated for finished requests.",
                   [f"generation_tokens_total {self.generation_tokens}"])
        for name, kind, help_, value in engine:
            metric(name, kind, help_, [f"{name} {value}"])
        return "\n".join(lines) + "\n"
