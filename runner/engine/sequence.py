"""One request as the engine carries it: its tokens, how many of them are in the KV cache, the
cache blocks holding them, and the times that make its latency metrics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from runner.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its cache freed, to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Metrics:
    """Seconds, all from the request's arrival: queued until first scheduled, to the first token, per
    later token, end to end."""

    queued_s: float
    ttft_s: float
    tpot_s: float
    e2e_s: float


@dataclass
class Sequence:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per token, where logprobs > 0
    # with params.prompt_logprobs: per prompt token after the first, its log-probability and its
    # position's likeliest tokens with theirs (where prompt_logprobs > 0)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose keys and values are in the cache
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its tokens' full blocks
    blocks_keyed: int = 0  # of its blocks, how many the prefix cache has been offered
    draft_ids: list[int] = field(default_factory=list)  # speculative guesses the next step verifies
    draft_q: torch.Tensor | None = None  # the draft's distributions they were drawn from (sampling)
    finish_reason: str | None = None  # "stop" (EOS, a stop token or string) or "length"
    text: str = ""  # the output's text so far (whole characters), cut before a stop string
    text_window: tuple[int, int] = (0, 0)  # output tokens: where the detokenizer's window starts, and how many are in text
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled
    finished: float | None = None

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def prompt_rows(self) -> range:
        """Positions whose logits score a prompt token that this sequence has still to score (none
        unless its params ask for its prompt's log-probabilities)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(len(self.prompt_logprobs), len(self.prompt_ids) - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop - 1`` of prompt and output together."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : stop - n]
        return self.prompt_ids[start:stop] + self.output_ids[: max(0, stop - n)]

    @property
    def metrics(self) -> Metrics:
        first, end = self.first_token or self.arrival, self.finished or time.perf_counter()
        later = len(self.output_ids) - 1
        return Metrics(
            queued_s=(self.first_scheduled or self.arrival) - self.arrival,
            ttft_s=first - self.arrival,
            tpot_s=(end - first) / later if later > 0 else 0.0,
            e2e_s=end - self.arrival,
        )
