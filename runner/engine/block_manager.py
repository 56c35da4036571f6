"""The KV cache's blocks: which are free, who holds each, which hold a known prefix.

The cache is one pool of fixed-size blocks (``block_size`` tokens each, of every layer); a sequence
holds a table of block ids, position ``p`` living in block ``table[p // block_size]`` at offset
``p % block_size``. Blocks are counted by reference; a block whose count drops to zero is free.

Prefix caching: a full block is keyed by a hash of its tokens chained with the key of the block
before it, so a key names a whole prefix (BLAKE2b, 128 bits: two prefixes do not meet by chance). A
freed block keeps its key and contents until it is needed for something else, least recently used
first; a new sequence whose first blocks' keys are known takes those blocks (one more reference
each) instead of computing them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from runner.engine.sequence import Sequence



def block_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype="<i8").tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # next to take first
        self._refs = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.queried_tokens = self.hit_tokens = 0  # prompt tokens looked up, and found cached

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached prefixes among them, reclaimed when needed)."""
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_hold(self, seq: Sequence, tokens: int) -> bool:
        """Whether ``seq`` can grow to ``tokens`` cached tokens with the blocks free now."""
        return self.blocks_for(tokens) - len(seq.block_table) <= len(self._free)

    def grow(self, seq: Sequence, tokens: int) -> None:
        """Give ``seq`` the blocks it lacks to hold ``tokens`` tokens (``can_hold`` said it could)."""
        for _ in range(self.blocks_for(tokens) - len(seq.block_table)):
            block, _ = self._free.popitem(last=False)
            if self._key[block] is not None:  # the least recently used cached prefix gives way
                del self._cached[self._key[block]]
                self._key[block] = None
            self._refs[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; its cached blocks are kept, last block first to go."""
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._key[block] is None:
                    self._free.move_to_end(block, last=False)  # nothing to keep: reused first
        seq.block_table = []
        seq.blocks_keyed = 0

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks that hold the start of a sequence with nothing computed yet, leaving at
        least one token to compute (the step that samples needs its logits). A sequence that asks
        for its prompt's log-probabilities computes all of it: the cache holds keys and values, not logits."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        found, count = [], (seq.num_tokens - 1) // self.block_size
        self._key_blocks(seq, count)
        for key in seq.block_keys[:count]:
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def free_after_match(self, found: list[int]) -> int:
        """Free blocks left once the matched ones (some of them free) are taken."""
        return len(self._free) - sum(self._refs[b] == 0 for b in found)

    def take(self, seq: Sequence, found: list[int]) -> None:
        """Give ``seq`` the matched blocks: their tokens count as computed."""
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += len(found) * self.block_size
        for block in found:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        seq.block_table = list(found)
        seq.blocks_keyed = len(found)
        seq.num_computed = len(found) * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks ``seq`` has filled since last asked, so later sequences can share them."""
        if not self.prefix_caching:
            return
        full = seq.num_computed // self.block_size
        self._key_blocks(seq, full)
        for i, key in enumerate(seq.block_keys[seq.blocks_keyed : full], seq.blocks_keyed):
            block = seq.block_table[i]
            if key not in self._cached and self._key[block] is None:
                self._cached[key], self._key[block] = block, key
        seq.blocks_keyed = max(seq.blocks_keyed, full)

    def _key_blocks(self, seq: Sequence, count: int) -> None:
        """Make ``seq.block_keys`` hold the keys of its first ``count`` full blocks of tokens. A
        sequence's tokens only grow, so each key is computed once, whatever is cached or computed."""
        bs = self.block_size
        for i in range(len(seq.block_keys), count):
            seq.block_keys.append(block_key(seq.block_keys[-1] if seq.block_keys else b"", seq.tokens(i * bs, (i + 1) * bs)))
