"""The engine's front door, in the shape vLLM users know: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from formats.hf import load_tokenizer
from runner.engine.detokenizer import Detokenizer
from runner.engine.engine import Engine, EngineConfig
from runner.engine.sampling import SamplingParams
from runner.engine.sequence import Metrics, Sequence
from runner.engine.speculative import SpeculativeConfig


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # the generated tokens
    finish_reason: str
    logprobs: list[float] | None  # of each chosen token, where asked for
    top_logprobs: list[dict[int, float]] | None  # the likeliest tokens at each step, where more than 0 asked for
    metrics: Metrics
    # with prompt_logprobs: each prompt token's log-probability (None for the first, which nothing
    # predicts), and its position's likeliest tokens where more than 0 asked for
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


class LLM:
    """A model served by the paged, continuously batched engine (runner/engine/)."""

    def __init__(self, model: str | Path, dtype: str = "auto", kv_cache_dtype: str = "auto", block_size: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, kv_memory: float | int | None = None,
                 max_model_len: int | None = None, seed: int = 0, enable_prefix_caching: bool = True,
                 speculative: str | SpeculativeConfig | None = None, enforce_eager: bool = False):
        if isinstance(speculative, str):
            speculative = SpeculativeConfig.parse(speculative)
        self.engine = Engine(model, EngineConfig(dtype, kv_cache_dtype, block_size, max_num_seqs, max_num_batched_tokens,
                                                 kv_memory, max_model_len, seed, enable_prefix_caching, speculative,
                                                 enforce_eager))
        self.tokenizer = load_tokenizer(self.engine.ckpt)
        self.detokenizer = Detokenizer(self.tokenizer)

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt (a string, or a list of token ids) to its end, all batched together;
        one result per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        seqs = [self.add(p, sp) for p, sp in zip(prompts, params)]
        while any(s.finish_reason is None for s in seqs):
            self.step()
        return [self.output(s) for s in seqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """The text of one prompt's output as it grows, piece by piece (a stop string cut off)."""
        seq = self.add(prompt, params or SamplingParams())
        shown = 0
        while seq.finish_reason is None:
            self.step()
            text = self.visible_text(seq)
            if len(text) > shown:
                yield text[shown:]
                shown = len(text)

    def visible_text(self, seq: Sequence) -> str:
        """The output text that can be shown now: all of it once finished; before that, not what
        may be the start of a stop string. It only ever grows."""
        if seq.finish_reason is not None or not seq.params.stop:
            return seq.text
        return seq.text[: max(0, len(seq.text) - max(len(s) for s in seq.params.stop) + 1)]

    def add(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        return self.engine.add(self.token_ids(prompt), params)

    def token_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt as the engine takes it: token ids as given, a text tokenized with its special tokens."""
        return list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def step(self) -> list[Sequence]:
        """One engine step; the sequences it finished, those ended by a stop string included.
        Every sequence's text grows by its new tokens'."""
        finished = self.engine.step()
        for seq in finished:
            self._cut(seq, self.detokenizer.update(seq, final=True))
        for seq in list(self.engine.scheduler.running):
            if self._cut(seq, self.detokenizer.update(seq)):
                self.engine.finish(seq, "stop")
                finished.append(seq)
        return finished

    def output(self, seq: Sequence) -> RequestOutput:
        scored = seq.params.prompt_logprobs
        return RequestOutput(seq.prompt_ids, seq.text, seq.output_ids, seq.finish_reason,
                             seq.logprobs if seq.params.logprobs is not None else None,
                             seq.top_logprobs if seq.params.logprobs else None, seq.metrics,
                             [None, *seq.prompt_logprobs] if scored is not None else None,
                             [None, *seq.prompt_top_logprobs] if scored else None)

    @staticmethod
    def _cut(seq: Sequence, new: int) -> bool:
        """Cut ``seq.text`` before the first stop string, looking only where one could end in the
        text from ``new`` on; whether it held one."""
        stops = seq.params.stop
        if not stops:
            return False
        start = max(0, new - max(len(s) for s in stops) + 1)
        cuts = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
        if cuts:
            seq.text = seq.text[: min(cuts)]
        return bool(cuts)
