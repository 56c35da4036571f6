"""``quantize bench``: a fixed workload through the engine, and the latencies users feel.

Prompts are cut from a text (the bundled evaluation text by default) at the given lengths in turn;
outputs are the given lengths in turn, greedy, EOS ignored, so every run does the same work. At
most ``concurrency`` requests are in flight: each finished one is replaced by the next (a closed
loop, as a fixed pool of users would load a server). Times are from a request's arrival.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from calib.text import read_text
from core.errors import InputError
from runner.engine.llm import LLM
from runner.engine.sampling import SamplingParams
from runner.engine.sequence import Sequence


@dataclass(frozen=True)
class Workload:
    requests: int = 32
    concurrency: int = 8
    prompt_tokens: tuple[int, ...] = (32, 64, 128, 256)
    output_tokens: tuple[int, ...] = (16, 64, 128, 256)

    def __post_init__(self) -> None:
        for name, value in (("requests", self.requests), ("concurrency", self.concurrency)):
            if value < 1:
                raise InputError(f"--{name} {value}: must be 1 or more")
        for name, values in (("prompt-tokens", self.prompt_tokens), ("output-tokens", self.output_tokens)):
            if not values or min(values) < 1:
                raise InputError(f"--{name}: one or more lengths of at least 1 token")


@dataclass
class Summary:
    """mean, median and 99th percentile, in seconds."""

    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> "Summary":
        if not values:
            return cls(0.0, 0.0, 0.0)
        ordered = sorted(values)
        return cls(statistics.fmean(ordered), statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))])


@dataclass
class BenchResult:
    model: str
    requests: int
    concurrency: int
    seconds: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_s: Summary
    tpot_s: Summary
    itl_s: Summary  # inter-token latency: the gaps between a request's tokens
    kv_blocks_peak: int
    kv_blocks_total: int
    preemptions: int
    peak_rss_mib: float
    # with --speculative: method, guesses_per_step, acceptance_rate (guesses kept / made), and
    # plain_output_tokens_per_s and speedup from the same workload run without it
    speculative: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def workload_prompts(tokenizer, text: Path, workload: Workload) -> list[list[int]]:
    """Consecutive cuts of ``text``, one per request, at the prompt lengths in turn."""
    ids = tokenizer(read_text(text), add_special_tokens=False)["input_ids"]
    lengths = [workload.prompt_tokens[i % len(workload.prompt_tokens)] for i in range(workload.requests)]
    if sum(lengths) > len(ids):
        raise InputError(f"{text}: {len(ids)} tokens, fewer than the {sum(lengths)} the prompts take")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [ids[s : s + n] for s, n in zip(starts, lengths)]


def output_lengths(workload: Workload) -> list[int]:
    return [workload.output_tokens[i % len(workload.output_tokens)] for i in range(workload.requests)]


def run_bench(llm: LLM, text: Path, workload: Workload, on_request: Callable[[], None] = lambda: None) -> BenchResult:
    prompts = workload_prompts(llm.tokenizer, text, workload)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in output_lengths(workload)]
    pending = deque(zip(prompts, params))
    in_flight: list[Sequence] = []
    done: list[Sequence] = []
    engine = llm.engine
    engine.peak_blocks = 0
    preempted, proposed, accepted = engine.scheduler.preemptions, engine.spec_proposed, engine.spec_accepted
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < workload.concurrency:
            in_flight.append(llm.add(*pending.popleft()))
        for seq in llm.step():
            in_flight.remove(seq)
            done.append(seq)
            on_request()
    seconds = time.perf_counter() - start
    tokens = sum(len(s.output_ids) for s in done)
    spec = engine.config.speculative
    guessed = engine.spec_proposed - proposed
    return BenchResult(
        model=str(engine.ckpt.path), requests=len(done), concurrency=workload.concurrency, seconds=seconds,
        output_tokens=tokens, output_tokens_per_s=tokens / seconds, requests_per_s=len(done) / seconds,
        ttft_s=Summary.of([s.metrics.ttft_s for s in done]),
        tpot_s=Summary.of([s.metrics.tpot_s for s in done if len(s.output_ids) > 1]),
        itl_s=Summary.of([b - a for s in done for a, b in zip(s.token_times, s.token_times[1:])]),
        kv_blocks_peak=engine.peak_blocks, kv_blocks_total=engine.blocks.num_blocks,
        preemptions=engine.scheduler.preemptions - preempted,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        speculative=None if spec is None else {
            "method": spec.method if spec.method == "ngram" else f"draft={spec.draft_model}",
            "guesses_per_step": spec.num_tokens,
            "acceptance_rate": (engine.spec_accepted - accepted) / guessed if guessed else 0.0},
    )


def run_llama_cpp(gguf: Path, prompts: list[list[int]], outputs: list[int], threads: int | None = None) -> BenchResult:
    """The same workload through llama.cpp (llama-cpp-python), one request at a time, greedy, EOS
    ignored: how a GGUF variant runs where users run it. Its KV cache holds one sequence."""
    from llama_cpp import Llama

    llm = Llama(str(gguf), n_ctx=max(len(p) + n for p, n in zip(prompts, outputs)), n_batch=512, verbose=False,
                n_threads=threads or None, logits_all=False)
    ttft, tpot, itl, tokens = [], [], [], 0
    start = time.perf_counter()
    for prompt, n in zip(prompts, outputs):
        llm.reset()
        arrival = time.perf_counter()
        times = []
        llm.eval(prompt)
        for _ in range(n):
            token = int(llm.scores[llm.n_tokens - 1].argmax())  # greedy on the last position's logits
            times.append(time.perf_counter())
            llm.eval([token])
        tokens += n
        ttft.append(times[0] - arrival)
        if n > 1:
            tpot.append((times[-1] - times[0]) / (n - 1))
        itl += [b - a for a, b in zip(times, times[1:])]
    seconds = time.perf_counter() - start
    return BenchResult(model=str(gguf), requests=len(prompts), concurrency=1, seconds=seconds, output_tokens=tokens,
                       output_tokens_per_s=tokens / seconds, requests_per_s=len(prompts) / seconds,
                       ttft_s=Summary.of(ttft), tpot_s=Summary.of(tpot), itl_s=Summary.of(itl), kv_blocks_peak=0,
                       kv_blocks_total=0, preemptions=0,
                       peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
