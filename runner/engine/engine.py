"""The engine loop: schedule a step, lay out its batch, run the model, sample, retire what finished.

``Engine`` owns the model, the KV pool, the block manager and the scheduler (and on CUDA the graphs
that replay decode-only steps); ``step()`` advances every scheduled sequence by its share of the
step and returns the sequences that finished in it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import InputError
from runner.engine.batch import layout
from runner.engine.block_manager import BlockManager
from runner.engine.checkpoint import open_model
from runner.engine.kernels import fused_decode
from runner.engine.kv_cache import BITS, FLOAT_CACHES, KVPool, bytes_per_token, float_cache
from runner.engine.model import DecoderModel
from runner.engine.sampling import SamplingParams, penalize, sample
from runner.engine.scheduler import Scheduler
from runner.engine.sequence import Sequence, Status
from runner.engine.speculative import DraftProposer, NgramProposer, SpeculativeConfig, verify
from runner.engine.static_decode import StaticDecode

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}  # the options' names and config.json's
DEFAULT_KV_SHARE = 0.5  # of the memory available when no --kv-memory is given
# Prompt positions scored at once (SamplingParams.prompt_logprobs): their logits are this many rows
# of the vocabulary (128 MiB of float32 for Gemma 3's 262,144 tokens), whatever the prompt's length.
PROMPT_ROWS_AT_ONCE = 128


@dataclass(frozen=True)
class EngineConfig:
    """The engine's options, under the names the CLI uses (``--dtype``, ``--kv-cache-dtype``, ...).

    ``kv_memory``: bytes for the KV pool, or a share (0 to 1] of the memory available now (after the
    weights are loaded), then no more than ``max_num_seqs`` sequences of ``max_model_len`` fill;
    ``max_model_len``: the longest sequence, prompt and output (default: the model's context);
    ``enable_prefix_caching``: share the KV blocks of prompts' common starts; ``speculative``: guess
    tokens with a draft model or prompt lookup, verified in one step; ``enforce_eager``: no CUDA
    graphs, every step runs op by op (on a CPU, always so)."""

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_memory: float | int | None = None
    max_model_len: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None
    enforce_eager: bool = False


class Engine:
    def __init__(self, model: str | Path, config: EngineConfig = EngineConfig()):
        self.config = config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # vLLM's sizes: 16 on a GPU; 128 on a CPU, whose attention over the gathered blocks runs
        # fewer, larger products (about 10% less CPU time on the 32-request workload of ref)
        self.block_size = config.block_size or (16 if self.device.type == "cuda" else 128)
        for name, value, low in (("block_size", self.block_size, 1), ("max_num_seqs", config.max_num_seqs, 1),
                                 ("max_num_batched_tokens", config.max_num_batched_tokens, 1)):
            if not isinstance(value, int) or value < low:
                raise InputError(f"{name} {value}: must be a whole number of at least {low}")
        self.ckpt = open_model(Path(model))
        arch = self.arch = self.ckpt.arch
        dtype = self._dtype(config.dtype, "dtype")
        self.model = DecoderModel(self.ckpt, dtype, self.device)
        cache = float_cache(dtype) if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        self.max_model_len = config.max_model_len or arch.max_context
        if not self.max_model_len or self.max_model_len < 1:
            raise InputError(f"{self.ckpt.path}: the model states no context length: give max_model_len")
        if arch.max_context and self.max_model_len > arch.max_context:
            raise InputError(f"max_model_len {self.max_model_len}: longer than the model's context ({arch.max_context} tokens)")
        if cache not in BITS:
            raise InputError(f"kv_cache_dtype {cache}: one of auto, {', '.join(BITS)}")
        per_block = bytes_per_token(arch, cache) * self.block_size
        budget = _budget(config.kv_memory)
        num_blocks = int(budget // per_block) - 1  # the pool's last block is scratch (padding rows of a static step)
        needed = -(-self.max_model_len // self.block_size)
        if not (isinstance(config.kv_memory, (int, float)) and config.kv_memory > 1):
            # a share of memory, not bytes asked for: no more than max_num_seqs full-length sequences use
            num_blocks = min(num_blocks, config.max_num_seqs * needed)
        if num_blocks < needed:
            raise InputError(f"KV memory {budget / 2**20:,.1f} MiB holds {max(num_blocks, 0)} blocks of {self.block_size} tokens "
                             f"and one of scratch; "
                             f"one sequence of max_model_len {self.max_model_len} needs {needed} "
                             f"({needed * per_block / 2**20:,.1f} MiB): give more kv_memory or a smaller max_model_len")
        self.pool = KVPool(arch, num_blocks + 1, self.block_size, cache, dtype, self.device)
        self.blocks = BlockManager(num_blocks, self.block_size, config.enable_prefix_caching)
        self.scratch_block = num_blocks
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.eos = {t for t in (_as_list(self.ckpt.config.get("eos_token_id"))) if isinstance(t, int)}
        self._next_id = 0
        self._seeds = torch.Generator().manual_seed(config.seed)
        self.peak_blocks = 0
        self.spec_proposed = self.spec_accepted = self.spec_steps = 0  # guesses, those kept, sequence-steps verifying
        spec = config.speculative
        self._decode_rows = 1 if spec is None else 1 + spec.num_tokens  # a verify step's rows attend as decode rows
        self.proposer = None if spec is None else NgramProposer(spec) if spec.method == "ngram" else \
            DraftProposer(spec, self.model, self.ckpt, num_blocks * self.block_size
                          + config.max_num_seqs * (spec.num_tokens + self.block_size), self.block_size)
        # decode-only steps replayed from CUDA graphs, where the fused kernel reads the cache
        self.decoder = None
        if self.device.type == "cuda" and not config.enforce_eager and fused_decode(self.device, cache):
            from runner.engine.cuda_graphs import CudaGraphs

            self.decoder = CudaGraphs(self.static_decode())

    def static_decode(self) -> StaticDecode:
        """Fixed buffers for decode-only steps of up to ``max_num_seqs`` sequences of ``max_model_len``."""
        return StaticDecode(self.model, self.pool, self.config.max_num_seqs, -(-self.max_model_len // self.block_size),
                            self.scratch_block)

    def _dtype(self, name: str, option: str) -> torch.dtype:
        if name == "auto":  # the checkpoint's; bf16 for fp16 on a CPU, which computes fp16 slowly
            stored = DTYPES.get(str(self.ckpt.config.get("dtype") or self.ckpt.config.get("torch_dtype")), torch.float32)
            return torch.bfloat16 if stored == torch.float16 and self.device.type == "cpu" else stored
        if name not in DTYPES:
            raise InputError(f"{option} {name}: one of auto, {', '.join(FLOAT_CACHES)}")
        return DTYPES[name]

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if not prompt_ids:
            raise InputError("a prompt needs at least one token")
        if any(not isinstance(t, int) or not 0 <= t < self.arch.vocab for t in prompt_ids):
            raise InputError(f"a prompt token id is outside the vocabulary (0..{self.arch.vocab - 1})")
        if any(t >= self.arch.vocab for t in params.logit_bias):
            raise InputError(f"logit_bias: a token id outside the vocabulary (0..{self.arch.vocab - 1})")
        if len(prompt_ids) >= self.max_model_len:
            raise InputError(f"a prompt of {len(prompt_ids)} tokens leaves no room in the context of "
                             f"{self.max_model_len} tokens")
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
            generator = torch.Generator().manual_seed(seed)
        seq = Sequence(self._next_id, list(prompt_ids), params, generator)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    def finish(self, seq: Sequence, reason: str = "abort") -> None:
        """End a request now (a stop string found, or a client that left): its blocks are freed at once."""
        if seq.status is not Status.FINISHED:
            self._retire(seq, reason, time.perf_counter())

    @property
    def unfinished(self) -> bool:
        return self.scheduler.unfinished

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that finished in it."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            raise InputError("no sequence can be scheduled: the KV pool is smaller than one waiting sequence needs")
        self.peak_blocks = max(self.peak_blocks, self.blocks.num_blocks - self.blocks.num_free)
        now = time.perf_counter()
        for seq, _ in scheduled:
            seq.first_scheduled = seq.first_scheduled or now
        scored: list[tuple[Sequence, range]] = []
        if self.decoder is not None and _decodes_only(scheduled):
            sampled = [seq for seq, _ in scheduled]
            logits = self.decoder.run(sampled)
        else:
            step, sampled, scored = layout(scheduled, self.block_size, self.device, self._decode_rows, score_prompts=True)
            if scored:
                logits, hidden = self.model.forward(step, self.pool, sum(1 + len(seq.draft_ids) for seq in sampled))
                _score_prompts(self.model.head, hidden, scored)
            else:
                logits = self.model.forward(step, self.pool)
        for seq, n in scheduled:
            seq.num_computed += n - len(seq.draft_ids)  # guesses' keys count once accepted (below)
        new_tokens = self._choose(logits, sampled)
        finished = []
        now = time.perf_counter()
        for seq, (tokens, logprobs, top) in zip(sampled, new_tokens):
            for token, logprob, alternatives in zip(tokens, logprobs, top):
                seq.output_ids.append(token)
                if seq.params.logprobs is not None:
                    seq.logprobs.append(logprob)
                if seq.params.logprobs:
                    seq.top_logprobs.append(alternatives)
                seq.token_times.append(now)
                reason = self._finish_reason(seq, token)
                if reason:
                    self._retire(seq, reason, now)
                    finished.append(seq)
                    break
        for seq, _ in scheduled:
            if seq.status is not Status.FINISHED:
                self.blocks.cache_full_blocks(seq)
        if self.proposer is not None:
            self._propose()
        return finished

    def _choose(self, logits: torch.Tensor, sampled: list[Sequence]) -> list[tuple[list[int], list, list]]:
        """Per sampled sequence, its new tokens with their logprobs and likeliest alternatives: one
        token, or the guesses it verified that the target accepts and one of the target's own."""
        rows, first = [], 0
        for seq in sampled:
            rows.append(first)
            first += 1 + len(seq.draft_ids)
        plain = [i for i, s in enumerate(sampled) if not s.draft_ids]
        chosen: list[list[int]] = [[] for _ in sampled]
        if plain:
            scores = logits[[rows[i] for i in plain]]
            penalized = [j for j, i in enumerate(plain) if sampled[i].params.penalized]
            if penalized:  # chosen from the penalized scores; the log-probabilities stay the model's own, as vLLM's
                seqs = [sampled[plain[j]] for j in penalized]
                scores[penalized] = penalize(scores[penalized], [s.params for s in seqs], [s.prompt_ids for s in seqs],
                                             [s.output_ids for s in seqs])
            drawn = sample(scores, [sampled[i].params for i in plain], [sampled[i].generator for i in plain]).tolist()
            for i, token in zip(plain, drawn):
                chosen[i] = [token]
        for i, seq in enumerate(sampled):
            if seq.draft_ids:
                guesses = seq.draft_ids
                chosen[i], accepted = verify(logits[rows[i] : rows[i] + 1 + len(guesses)], seq, guesses, seq.draft_q)
                seq.num_computed += accepted
                self.spec_proposed += len(guesses)
                self.spec_steps += 1
                self.spec_accepted += accepted
                seq.draft_ids, seq.draft_q = [], None
        token_rows = [rows[i] + j for i, tokens in enumerate(chosen) for j in range(len(tokens))]
        flat = [t for tokens in chosen for t in tokens]
        asked = [seq.params.logprobs for seq, tokens in zip(sampled, chosen) for _ in tokens]
        logprobs, top = _logprobs(logits, token_rows, flat, asked)
        out, at = [], 0
        for tokens in chosen:
            out.append((tokens, logprobs[at : at + len(tokens)], top[at : at + len(tokens)]))
            at += len(tokens)
        return out

    def _propose(self) -> None:
        """Guesses for every running sequence that decodes next step, as many as it may still use,
        and no more than its share of the step's token budget left after every running sequence's
        own next tokens (so that guesses never crowd out another sequence's decode token or prompt chunk)."""
        # a penalized sequence gets no guesses: its scores change with every token it keeps
        ready = [s for s in self.scheduler.running if s.num_computed == s.num_tokens - 1 and not s.params.penalized]
        if not ready:
            return
        spare = self.config.max_num_batched_tokens - sum(s.num_tokens - s.num_computed for s in self.scheduler.running)
        k = min(self.config.speculative.num_tokens, max(0, spare) // len(ready))
        limits = [max(0, min(k, s.params.max_tokens - len(s.output_ids) - 1, self.max_model_len - s.num_tokens - 1))
                  for s in ready]
        guesses, dists = self.proposer.propose(ready, limits)
        for seq, g, q in zip(ready, guesses, dists):
            seq.draft_ids, seq.draft_q = g, q

    def _retire(self, seq: Sequence, reason: str, now: float) -> None:
        self.scheduler.finish(seq, reason)
        seq.finished = now
        if self.proposer is not None:
            self.proposer.release(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None


def _decodes_only(scheduled: list[tuple[Sequence, int]]) -> bool:
    """Whether every scheduled sequence computes just its last token (no prompt chunk, no guesses):
    a step of the static decode path."""
    return all(n == 1 and seq.num_computed + 1 == seq.num_tokens and not seq.draft_ids for seq, n in scheduled)


def _logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], asked: list[int | None]) -> tuple[list, list]:
    """Per chosen token (``tokens[i]``, sampled from ``logits[rows[i]]``): its log-probability
    (where asked), and the ``asked`` most likely tokens with theirs (where more than 0 are asked)."""
    if all(a is None for a in asked):
        return [None] * len(tokens), [None] * len(tokens)
    logp = torch.log_softmax(logits[rows], -1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    most = max(a or 0 for a in asked)
    if most == 0:
        return chosen, [None] * len(tokens)
    values, ids = (t.tolist() for t in logp.topk(most, -1))
    return chosen, [dict(zip(i[:a], v[:a])) if a else None for i, v, a in zip(ids, values, asked)]


def _score_prompts(head, hidden: torch.Tensor, scored: list[tuple[Sequence, range]]) -> None:
    """Each scored sequence's prompt log-probabilities at ``positions`` (``hidden``'s rows, in
    order, made logits by ``head`` a slice at a time): the log-probability of the prompt token
    after each position, and its likeliest tokens."""
    targets = [seq.prompt_ids[p + 1] for seq, positions in scored for p in positions]
    asked = [seq.params.prompt_logprobs for seq, positions in scored for _ in positions]
    chosen, top = [], []
    for first in range(0, len(targets), PROMPT_ROWS_AT_ONCE):
        part = slice(first, first + PROMPT_ROWS_AT_ONCE)
        logits = head(hidden[part])
        c, t = _logprobs(logits, list(range(len(logits))), targets[part], asked[part])
        chosen += c
        top += t
    at = 0
    for seq, positions in scored:
        seq.prompt_logprobs += chosen[at : at + len(positions)]
        if seq.params.prompt_logprobs:
            seq.prompt_top_logprobs += top[at : at + len(positions)]
        at += len(positions)


def parse_memory(text: str) -> float | int:
    """``--kv-memory``: bytes (``2GiB``, ``512MiB``, ``1e9``) or a share of free memory (``0.3``)."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    unit = next((u for u in units if t.endswith(u)), None)
    try:
        value = float(t[: -len(unit)] if unit else t)
    except ValueError:
        raise InputError(f"--kv-memory {text}: bytes (e.g. 2GiB, 512MiB) or a share of free memory (e.g. 0.3)") from None
    if unit:
        return int(value * units[unit])
    return value if value <= 1 else int(value)


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _budget(kv_memory: float | int | None) -> int:
    """Bytes for the KV pool: as given, or a share of the memory available now."""
    if kv_memory is not None and (isinstance(kv_memory, bool) or not isinstance(kv_memory, (int, float)) or kv_memory <= 0):
        raise InputError(f"kv_memory {kv_memory}: bytes, or a share of free memory in (0, 1]")
    if kv_memory is not None and kv_memory > 1:
        return int(kv_memory)
    share = DEFAULT_KV_SHARE if kv_memory is None else kv_memory
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        try:
            meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            free = int(meminfo["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            pass
    return int(free * share)
