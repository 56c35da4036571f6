"""The KV cache's blocks: which are free, who holds each, how many more a sequence needs.

The cache is one pool of fixed-size blocks (``block_size`` tokens each, of every layer); a sequence
holds a table of block ids, position ``p`` living in block ``table[p // block_size]`` at offset
``p % block_size``. Blocks are counted by reference, so that sequences can later share the blocks of
a common prefix; a block returns to the free list when its count drops to zero.
"""

from __future__ import annotations

from collections import deque

from runner.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_hold(self, seq: Sequence, tokens: int) -> bool:
        """Whether ``seq`` can grow to ``tokens`` cached tokens with the blocks free now."""
        return self.blocks_for(tokens) - len(seq.block_table) <= len(self._free)

    def grow(self, seq: Sequence, tokens: int) -> None:
        """Give ``seq`` the blocks it lacks to hold ``tokens`` tokens (``can_hold`` said it could)."""
        for _ in range(self.blocks_for(tokens) - len(seq.block_table)):
            block = self._free.popleft()
            self._refs[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        seq.block_table = []
