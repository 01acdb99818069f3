"""The paged KV cache's block pool: which fixed-size blocks of cache slots each sequence owns."""

from __future__ import annotations

from collections import deque

from fd_core.engine.sequence import Sequence


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots. Block 0 is never handed out: padded
    block tables point at it, so a stray read lands on a block no sequence owns."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks a sequence can ever use (all but the reserved one)."""
        return self.num_blocks - 1

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_tokens`` tokens in total."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError("block pool exhausted; the scheduler should have checked")
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []

    def usage(self) -> float:
        return 1.0 - self.num_free / self.capacity
