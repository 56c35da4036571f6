"""Continuous batching with chunked prefill.

Each step fills a budget of ``max_num_batched_tokens``: first one token for every running sequence
that is decoding (and the next chunk of any running sequence still in its prompt), oldest first;
then chunks of waiting prompts, first come first served, while fewer than ``max_num_seqs`` run and
the blocks they need are free. A finished sequence leaves at once, so its place is taken on the
next step. When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it waits at the head of the queue, to be recomputed from its
prompt and the tokens it already produced (which are kept), so its output does not change.
A sequence admitted takes the blocks of its start that the prefix cache holds, and computes only
the rest.
"""

from __future__ import annotations

from collections import deque

from runner.engine.block_manager import BlockManager
from runner.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's work: (sequence, how many of its next tokens to compute)."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0 or seq.status is not Status.RUNNING:
                continue  # out of budget, or preempted by an older sequence just now
            own = seq.num_tokens - seq.num_computed
            n = min(own + len(seq.draft_ids), budget)
            if n > own and not self.blocks.can_hold(seq, seq.num_computed + n):
                n = min(own, budget)  # speculative guesses never cost another sequence its place
            del seq.draft_ids[max(0, n - own):]  # guesses beyond the budget are dropped
            while not self.blocks.can_hold(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.blocks.grow(seq, seq.num_computed + n)
            scheduled.append((seq, n))
            budget -= n
        while self.waiting and budget and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            found = self.blocks.match(seq)  # its start, where another sequence computed it already
            cached = len(found) * self.blocks.block_size
            n = min(seq.num_tokens - cached, budget)
            if self.blocks.blocks_for(cached + n) - len(found) > self.blocks.free_after_match(found):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.blocks.take(seq, found)
            self.blocks.grow(seq, seq.num_computed + n)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.draft_ids, seq.draft_q = [], None
        seq.num_computed, seq.status = 0, Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
