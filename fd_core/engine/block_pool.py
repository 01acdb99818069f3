"""The paged KV cache's block pool: reference-counted blocks and the prefix cache.

A block holds ``block_size`` consecutive token slots of one or more sequences. Sequences share
a block by reference: the ``n`` outputs of one request share their prompt's blocks (``fork``),
and with prefix caching any sequence whose tokens begin like an earlier one's reuses that
sequence's full blocks instead of recomputing them.

A full block is identified by a chained hash: SHA-256 over the previous block's hash, the
block's token ids and the request's cache salt. The chain makes a block's identity depend on
everything before it, as its keys and values do (they attend to the whole prefix); SHA-256 keeps
two different prefixes from ever sharing an identity by collision.

Blocks nobody references are free. A free block that still holds a cached prefix stays findable
until the pool needs it for something else: blocks that hold nothing worth keeping are handed
out first, then cached ones least recently freed first, and handing out a cached block evicts it.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from fd_core.engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: list[int], salt: str | None = None) -> bytes:
    """Identity of a full block: its tokens, everything before them (``parent``), the salt."""
    return _chain(parent, np.asarray(token_ids, dtype=np.int64).tobytes(), salt)


def _chain(parent: bytes | None, tokens: bytes, salt: str | None) -> bytes:
    h = hashlib.sha256(parent or b"fd-root")
    if parent is None and salt:
        h.update(salt.encode())
    h.update(tokens)
    return h.digest()


def seq_block_hashes(seq: Sequence, num_blocks: int, block_size: int) -> list[bytes]:
    """The chained hashes of ``seq``'s first ``num_blocks`` full blocks, extending the memo on
    the sequence (its tokens only ever grow, so earlier hashes stay valid)."""
    hashes = seq.block_hashes
    have = len(hashes)
    if have < num_blocks:
        # the missing blocks' tokens as int64 bytes in one conversion, not one per block: a
        # 1,024-token prompt's 64 hashes took 56 µs that way, 25 µs this way (2 cores, AVX-512)
        data = np.asarray(seq.tokens_between(have * block_size, num_blocks * block_size), dtype=np.int64).tobytes()
        width = block_size * 8
        for i in range(num_blocks - have):
            hashes.append(_chain(hashes[-1] if hashes else None, data[i * width:(i + 1) * width], seq.cache_salt))
    return hashes[:num_blocks]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is in the prefix cache


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` slots. Block 0 is never handed out: padded block
    tables point at it, so a stray read lands on a block no sequence owns."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0, in the order they are handed out
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[bytes, int] = {}  # hash -> block holding that content
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    # -- accounting ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached-but-unused ones included)."""
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks a sequence can ever use (all but the reserved one)."""
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.capacity

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_tokens`` tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache ----------------------------------------------------------------------

    def match(self, seq: Sequence) -> list[int]:
        """The blocks holding the longest cached prefix of ``seq``, changing nothing.

        The last token is never matched: the step that computes it produces the logits the
        next token is sampled from."""
        if not self.enable_caching:
            return []
        hits = []
        for h in seq_block_hashes(seq, (seq.num_tokens - 1) // self.block_size, self.block_size):
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, seq: Sequence, hits: list[int], num_tokens: int, reserve: int = 0) -> bool:
        """Whether ``seq`` (holding no blocks) can take ``hits`` and grow to ``num_tokens``,
        leaving ``reserve`` blocks free."""
        taken_from_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = max(0, -(-num_tokens // self.block_size) - len(hits))
        return fresh + taken_from_free <= self.num_free - reserve

    def admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Give ``seq`` the cached blocks ``hits`` (its first ``len(hits)`` blocks, already
        computed) and room for ``num_tokens`` tokens. Check ``can_admit`` first."""
        assert not seq.block_table, "admit is for a sequence that holds no blocks"
        if not self.can_admit(seq, hits, num_tokens):
            raise RuntimeError("block pool exhausted; the scheduler should have checked")
        for b in hits:
            self._ref(b)
        seq.block_table = list(hits)
        seq.num_committed_blocks = len(hits)
        # a cached block was published once every model that keeps keys and values in it had
        # computed it (the speculative proposer's layers too)
        seq.num_computed = seq.proposer_computed = len(hits) * self.block_size
        self.grow(seq, num_tokens)

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit

    def commit(self, seq: Sequence, computed: int | None = None) -> None:
        """Publish ``seq``'s newly computed full blocks in the prefix cache: those within its
        first ``computed`` tokens (default: ``num_computed``).

        A block whose content another block already publishes stays private: the first one
        keeps serving hits, and this one is freed like any uncached block."""
        computed = seq.num_computed if computed is None else computed
        full = min(computed // self.block_size, len(seq.block_table))
        if not self.enable_caching or full <= seq.num_committed_blocks:
            return
        for i, h in enumerate(seq_block_hashes(seq, full, self.block_size)[seq.num_committed_blocks:],
                              start=seq.num_committed_blocks):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self._cached:
                block.hash = h
                self._cached[h] = block.block_id
        seq.num_committed_blocks = full

    # -- allocation ------------------------------------------------------------------------

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError("block pool exhausted; the scheduler should have checked")
        seq.block_table.extend(self._take() for _ in range(need))

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Release ``seq``'s trailing blocks past the first ``num_tokens`` tokens' (slots a
        speculative step wrote for drafts that were rejected). They were never published."""
        keep = -(-num_tokens // self.block_size)
        table = seq.block_table
        if len(table) <= keep:
            return
        for b in reversed(table[keep:]):
            self._release(b)
        seq.block_table = table[:keep]  # a new list: see Sequence.block_table

    def take_blocks(self, count: int) -> list[int]:
        """``count`` fresh blocks, referenced once, for a caller that fills them itself
        (swap-in). Check ``num_free`` first."""
        if not 0 <= count <= self.num_free:
            raise RuntimeError(f"cannot take {count} blocks with {self.num_free} free")
        return [self._take() for _ in range(count)]

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Make ``child`` (holding no blocks) continue from ``parent``'s computed tokens.

        The full blocks are shared; the partly filled last block is copied into a fresh block
        the child owns, since both will write after its last token. Returns the ``(src, dst)``
        block copies the caller must make before either sequence runs again, or None when no
        block is free for the copy (nothing changes then)."""
        assert not child.block_table, "fork is for a child that holds no blocks"
        full, partial = divmod(parent.num_computed, self.block_size)
        if partial and not self.num_free:
            return None
        for b in parent.block_table[:full]:
            self._ref(b)
        child.block_table = parent.block_table[:full]
        copies = []
        if partial:
            dst = self._take()
            copies.append((parent.block_table[full], dst))
            child.block_table.append(dst)
        child.num_computed = parent.num_computed
        child.num_committed_blocks = min(parent.num_committed_blocks, full)
        return copies

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Of its cached blocks, the last become the first to be
        evicted: a prefix is likelier to be shared than the tail of one sequence."""
        for b, count in Counter(seq.block_table).items():
            if self.blocks[b].ref_count < count:
                raise RuntimeError(f"block {b} freed more often than it was taken")
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix that no sequence is using; returns how many blocks."""
        dropped = 0
        for b in list(self._free):
            if self.blocks[b].hash is not None:
                self._uncache(self.blocks[b])
                dropped += 1
        return dropped

    def _take(self) -> int:
        b, _ = self._free.popitem(last=False)
        block = self.blocks[b]
        if block.hash is not None:
            self._uncache(block)
            self.evictions += 1
        block.ref_count = 1
        return b

    def _release(self, b: int) -> None:
        block = self.blocks[b]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[b] = None
            if block.hash is None:
                self._free.move_to_end(b, last=False)  # worthless: reuse it first

    def _ref(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref_count == 0:
            del self._free[b]
        block.ref_count += 1

    def _uncache(self, block: Block) -> None:
        if self._cached.get(block.hash) == block.block_id:
            del self._cached[block.hash]
        block.hash = None
