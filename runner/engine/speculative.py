"""Speculative decoding: a cheap proposer guesses a sequence's next tokens, the target model scores
them all in one step, and the longest run it agrees with is kept, plus one token of its own.

Proposers:
- ``draft=DIR``: a smaller model with the same tokenizer (or a recipe's variant folder of the same
  model), run by the same forward pass on a KV cache of its own. Each round it first catches up on
  the tokens it has not seen (the target's last accepted ones), then decodes its guesses one step
  at a time, all sequences batched.
- ``self=int4`` (or ``int3``...): the same, with the target itself as the draft, its decoder layers'
  Linear weights rounded to that many bits in memory (``self_draft.py``).
- ``ngram``: prompt lookup. The sequence's last n tokens (n from ``prompt_lookup_max`` down to
  ``prompt_lookup_min``) are looked up earlier in its own tokens; the tokens that followed there
  are the guess. No model: free, and right when the output quotes its prompt.

Acceptance (``verify``): greedy keeps a guess while it equals the target's argmax, so the output
is the plain run's token for token. Sampling keeps guess ``x`` with probability
``min(1, p(x) / q(x))`` (``p`` the target's distribution, ``q`` the proposer's; an n-gram guess is a
point mass, ``q(x) = 1``) and on a rejection draws from ``max(p - q, 0)`` renormalised: the output
is distributed as the target's alone (Leviathan et al., 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.errors import InputError
from runner.engine.batch import layout
from runner.engine.block_manager import BlockManager
from runner.engine.checkpoint import open_model
from runner.engine.kv_cache import KVPool, float_cache
from runner.engine.model import DecoderModel
from runner.engine.sampling import SamplingParams, probabilities
from runner.engine.self_draft import DRAFT_DTYPE, LowBitView, share_unrounded
from runner.engine.sequence import Sequence


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: "draft" (with ``draft_model``), "self" (with ``draft_bits``) or "ngram";
    ``num_tokens``: guesses per step."""

    method: str
    draft_model: Path | None = None
    draft_bits: int | None = None
    num_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    @staticmethod
    def parse(text: str) -> "SpeculativeConfig":
        """``--speculative``: ``ngram``, ``draft=DIR`` or ``self=intB``, each optionally ``,k=N`` (guesses per step)."""
        head, *options = text.split(",")
        k = 4
        for option in options:
            name, _, value = option.partition("=")
            if name != "k" or not value.isdigit() or not 1 <= int(value) <= 16:
                raise InputError(f"--speculative {text}: options are k=N (1..16 guesses per step)")
            k = int(value)
        if head == "ngram":
            return SpeculativeConfig("ngram", num_tokens=k)
        if head.startswith("draft=") and len(head) > 6:
            return SpeculativeConfig("draft", Path(head[6:]), num_tokens=k)
        bits = head.removeprefix("self=int")
        if head.startswith("self=int") and bits.isdigit() and 2 <= int(bits) <= 8:
            return SpeculativeConfig("self", draft_bits=int(bits), num_tokens=k)
        raise InputError(f"--speculative {text}: ngram, draft=DIR (a smaller model with the same tokenizer), "
                         f"or self=intB (the model itself with B-bit weights, B from 2 to 8)")


class NgramProposer:
    """Prompt lookup with a guess count that follows the sequence: after a round whose guesses were
    all kept it guesses ``num_tokens`` again (a copied passage goes on), after a refusal one more
    than it had right (the copy ended, or the lookup found the wrong place). A sequence that copies
    gets long guesses; one that does not costs about one guess a step."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._last: dict[int, tuple[int, list[int]]] = {}  # per sequence: its length when guessing, the guesses

    def propose(self, seqs: list[Sequence], limits: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        out = []
        for seq, k in zip(seqs, limits):
            tokens = seq.prompt_ids + seq.output_ids
            guesses = self._lookup(np.asarray(tokens), min(k, self._wanted(seq.id, tokens))) if k else []
            self._last[seq.id] = (len(tokens), guesses)
            out.append(guesses)
        return out, [None] * len(seqs)

    def _wanted(self, seq_id: int, tokens: list[int]) -> int:
        """How many to guess: all after a round that kept every guess (or none made), else one more than were kept."""
        length, guesses = self._last.get(seq_id, (0, []))
        if not guesses:
            return self.config.num_tokens
        kept = 0
        while kept < len(guesses) and length + kept < len(tokens) and tokens[length + kept] == guesses[kept]:
            kept += 1
        return self.config.num_tokens if kept == len(guesses) else kept + 1

    def _lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """The ``k`` tokens that followed the latest earlier occurrence of the longest suffix found."""
        for n in range(min(self.config.prompt_lookup_max, len(tokens) - 1), self.config.prompt_lookup_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
            hits = np.flatnonzero((windows == tokens[-n:]).all(1))
            if hits.size:
                start = hits[-1] + n
                return tokens[start : start + k].tolist()
        return []

    def release(self, seq: Sequence) -> None:
        self._last.pop(seq.id, None)


class DraftProposer:
    """A draft model's guesses, with the KV cache it keeps per sequence between rounds."""

    def __init__(self, config: SpeculativeConfig, target: DecoderModel, target_ckpt, tokens: int, block_size: int):
        dtype, device = target.dtype, target.device
        if config.method == "self":
            dtype = DRAFT_DTYPE
            self.model = DecoderModel(LowBitView(target_ckpt, config.draft_bits), dtype, device)
            share_unrounded(self.model, target)
        else:
            ckpt = open_model(config.draft_model)
            if ckpt.arch.vocab != target.arch.vocab:
                raise InputError(f"--speculative draft={config.draft_model}: a vocabulary of {ckpt.arch.vocab} tokens; "
                                 f"the target's has {target.arch.vocab} (the draft needs the target's tokenizer)")
            self.model = DecoderModel(ckpt, dtype, device)
        self.config, self.device, self.block_size = config, device, block_size
        num_blocks = -(-tokens // block_size)
        self.pool = KVPool(self.model.arch, num_blocks, block_size, float_cache(dtype), dtype, device)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)
        self._state: dict[int, Sequence] = {}  # the draft's own copy of each target sequence

    def propose(self, seqs: list[Sequence], limits: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        guesses: list[list[int]] = [[] for _ in seqs]
        dists: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(limits) if k]
        mirrors = {i: self._mirror(seqs[i]) for i in active}
        while active:
            # each round feeds every mirror what it has not seen (its last guess, or the target's tokens)
            active = [i for i in active if len(guesses[i]) < limits[i] and self._room(mirrors[i])]
            if not active:
                break
            step, _, _ = layout([(mirrors[i], mirrors[i].num_tokens - mirrors[i].num_computed) for i in active],
                             self.block_size, self.device, 1 + self.config.num_tokens)
            logits = self.model.forward(step, self.pool)
            for row, i in enumerate(active):
                m, seq = mirrors[i], seqs[i]
                m.num_computed = m.num_tokens
                if seq.params.greedy:
                    token = int(logits[row].argmax())
                else:
                    q = probabilities(logits[row].cpu(), seq.params)  # the generator lives on the CPU
                    token = int(torch.multinomial(q, 1, generator=seq.generator)[0])
                    dists[i].append(q)
                guesses[i].append(token)
                m.output_ids.append(token)
        return guesses, [torch.stack(d) if d else None for d in dists]

    def _room(self, mirror: Sequence) -> bool:
        """Blocks for the mirror's next step; False when the draft's cache is full (fewer guesses)."""
        if not self.blocks.can_hold(mirror, mirror.num_tokens):
            return False
        self.blocks.grow(mirror, mirror.num_tokens)
        return True

    def _mirror(self, seq: Sequence) -> Sequence:
        """The draft's sequence for ``seq``: its tokens now, with the cache it kept of those that
        still agree (a rejected guess's keys are dropped)."""
        mine = self._state.get(seq.id)
        if mine is None:
            mine = self._state[seq.id] = Sequence(seq.id, seq.prompt_ids, seq.params, None)
        tokens = seq.prompt_ids + seq.output_ids
        had = mine.prompt_ids + mine.output_ids
        common = min(len(tokens), len(had), mine.num_computed)
        same = np.asarray(tokens[:common]) == np.asarray(had[:common])
        mine.num_computed = common if same.all() else int(same.argmin())
        mine.output_ids = list(seq.output_ids)
        return mine

    def release(self, seq: Sequence) -> None:
        mine = self._state.pop(seq.id, None)
        if mine is not None:
            self.blocks.free(mine)


def verify(logits: torch.Tensor, seq: Sequence, guesses: list[int], q: torch.Tensor | None) -> tuple[list[int], int]:
    """The tokens ``seq`` keeps from a step that scored its ``guesses``: ``logits`` [len+1, vocab]
    are the target's after its last token and after each guess. Returns the kept tokens (accepted
    guesses, then one of the target's own) and how many guesses were accepted."""
    p: SamplingParams = seq.params
    if p.greedy:
        best = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(guesses) and guesses[accepted] == best[accepted]:
            accepted += 1
        return guesses[:accepted] + [best[accepted]], accepted
    target = probabilities(logits.cpu(), p)
    draws = torch.rand(len(guesses), generator=seq.generator).tolist()
    for i, (x, u) in enumerate(zip(guesses, draws)):
        px = float(target[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if u * qx < px:  # accept with probability min(1, p/q)
            continue
        residual = target[i] if q is None else (target[i] - q[i]).clamp_min(0)
        if q is None:
            residual = residual.index_fill(0, torch.tensor([x]), 0.0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p will do
            residual = target[i]
        token = int(torch.multinomial(residual, 1, generator=seq.generator)[0])
        return guesses[:i] + [token], i
    token = int(torch.multinomial(target[len(guesses)], 1, generator=seq.generator)[0])
    return guesses + [token], len(guesses)
