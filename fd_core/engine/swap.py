"""Host-memory blocks that hold the KV cache of sequences preempted by swap (``--swap-space``)."""

from __future__ import annotations


class SwapSpace:
    """``num_blocks`` host blocks, each the size of a device block. Only the bookkeeping lives
    here; the backend's Memory allocates the host arrays and copies blocks in and out."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        """``count`` host blocks, or None (taking nothing) when fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
