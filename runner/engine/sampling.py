"""What a request asks of generation (``SamplingParams``, as vLLM users know it) and the sampler that
turns a batch of logits into one token per sequence.

Greedy rows are decided together by one argmax. Sampled rows each draw from their own
``torch.Generator`` on the CPU, seeded by the request's ``seed`` (or one drawn from the engine's
seed): a request's tokens depend on its seed alone, never on what else shares its batch, and a
CUDA engine draws as a CPU one does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.errors import InputError

# Colder than this is greedy, as in vLLM (its _SAMPLING_EPS): greedy is the limit anyway, and logits
# divided by 1e-40 overflow float32 to inf, whose softmax is NaN, and the draw would fail the whole
# batch's step, every request in it, not only the one that asked.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (below GREEDY_BELOW): greedy
    top_k: int = -1  # -1 (or 0): no limit
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None  # generation ends before the first of these strings
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # OpenAI's penalties, on the tokens generated so far: the logit of a token drops by
    # presence_penalty once it has appeared and by frequency_penalty for each time; vLLM's
    # repetition_penalty (transformers' too) divides a positive logit of a token seen in the prompt
    # or output by it, and multiplies a negative one
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI's: added to those tokens' logits
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's log-probability and the N likeliest's
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (vLLM's name)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens {self.max_tokens}: must be 1 or more"),
            (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < float("inf"),
             f"temperature {self.temperature}: must be 0 (greedy) or more"),
            (isinstance(self.top_k, int) and self.top_k >= -1, f"top_k {self.top_k}: must be -1 (no limit) or more"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, f"top_p {self.top_p}: must be in (0, 1]"),
            (self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), f"seed {self.seed}: must be in 0..2^63-1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop: must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids: must be token ids"),
            (all(isinstance(v, (int, float)) and -2 <= v <= 2 for v in (self.presence_penalty, self.frequency_penalty)),
             f"presence_penalty {self.presence_penalty}, frequency_penalty {self.frequency_penalty}: must be in [-2, 2]"),
            (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty < float("inf"),
             f"repetition_penalty {self.repetition_penalty}: must be above 0"),
            (all(isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and -100 <= b <= 100
                 for t, b in self.logit_bias.items()), "logit_bias: token ids to biases in [-100, 100]"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), f"logprobs {self.logprobs}: must be 0 or more"),
            (self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
             f"prompt_logprobs {self.prompt_logprobs}: must be 0 or more"),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether its scores are the model's logits changed (penalties or a logit bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias) or self.repetition_penalty != 1.0


def penalize(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
             outputs: list[list[int]]) -> torch.Tensor:
    """``logits`` [rows, vocab] with each row's penalties and logit bias applied (a new tensor; rows
    without either unchanged), for a sequence with ``prompts[i]`` and ``outputs[i]`` so far: the token
    counts are scattered into one [rows, vocab] table, so the work is one pass over the tokens."""
    rows, vocab = logits.shape
    dev = logits.device

    def counts(histories: list[list[int]]) -> torch.Tensor:
        table = torch.zeros(rows, vocab, device=dev)
        owner = torch.repeat_interleave(torch.arange(rows), torch.tensor([len(h) for h in histories])).to(dev)
        ids = torch.tensor([t for h in histories for t in h], dtype=torch.long, device=dev)
        return table.index_put_((owner, ids), torch.ones(len(ids), device=dev), accumulate=True)

    out = counts(outputs)
    column = lambda values: torch.tensor(values, dtype=torch.float32, device=dev)[:, None]  # noqa: E731
    if any(p.repetition_penalty != 1.0 for p in params):
        repetition = column([p.repetition_penalty for p in params])
        seen = (out > 0) | (counts(prompts) > 0)
        scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen & (repetition != 1), scaled, logits)
    logits = logits - column([p.frequency_penalty for p in params]) * out - column([p.presence_penalty for p in params]) * (out > 0)
    biased = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias.items()]
    if biased:
        row, token, bias = zip(*biased)
        logits = logits.index_put((torch.tensor(row, device=dev), torch.tensor(token, device=dev)),
                                  torch.tensor(bias, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: ``logits`` [..., vocab] (float32) at its
    temperature, cut to its top-k and top-p."""
    scores = logits / p.temperature
    if 0 < p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k, -1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, -1)
    if p.top_p < 1:
        ordered, order = probs.sort(-1, descending=True)
        outside = ordered.cumsum(-1) - ordered > p.top_p  # the smallest prefix whose mass reaches top_p stays
        probs = probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``logits`` [rows, vocab] (float32), as each row's params say."""
    tokens = logits.argmax(-1).cpu()
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if sampled:  # drawn on the CPU, where the requests' generators live, whatever device scored them
        rows = logits[sampled].cpu()
        for row, scores in zip(sampled, rows):
            tokens[row] = torch.multinomial(probabilities(scores, params[row]), 1, generator=generators[row])[0]
    return tokens
