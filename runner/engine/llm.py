"""The engine's front door, in the shape vLLM users know: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from formats.hf import load_tokenizer
from runner.engine.engine import Engine, EngineConfig
from runner.engine.sampling import SamplingParams
from runner.engine.sequence import Metrics, Sequence


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # the generated tokens
    finish_reason: str
    logprobs: list[float] | None  # of each chosen token, where asked for
    metrics: Metrics


class LLM:
    """A model served by the paged, continuously batched engine (runner/engine/)."""

    def __init__(self, model: str | Path, dtype: str = "auto", kv_cache_dtype: str = "auto", block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, kv_memory: float | int | None = None,
                 max_model_len: int | None = None, seed: int = 0):
        self.engine = Engine(model, EngineConfig(dtype, kv_cache_dtype, block_size, max_num_seqs, max_num_batched_tokens,
                                                 kv_memory, max_model_len, seed))
        self.tokenizer = load_tokenizer(self.engine.ckpt)

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
        seqs = [self.engine.add(self._ids(p), sp) for p, sp in zip(prompts, params)]
        while any(s.finish_reason is None for s in seqs):
            for seq in self.engine.step():
                self._detokenize(seq)
            for seq in seqs:  # stop strings end a sequence the moment its text holds one
                if seq.finish_reason is None and seq.params.stop and self._detokenize(seq):
                    self.engine.finish(seq, "stop")
        return [RequestOutput(s.prompt_ids, s.text, s.output_ids, s.finish_reason, s.logprobs if s.params.logprobs is not None else None,
                              s.metrics) for s in seqs]

    def _ids(self, prompt: str | list[int]) -> list[int]:
        return prompt if isinstance(prompt, list) else self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def _detokenize(self, seq: Sequence) -> bool:
        """Set ``seq.text``; cut it before the first stop string and say whether one was found."""
        seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        cuts = [seq.text.find(s) for s in seq.params.stop if s in seq.text]
        if cuts:
            seq.text = seq.text[: min(cuts)]
        return bool(cuts)
