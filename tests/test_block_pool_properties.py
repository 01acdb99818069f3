"""Property-based tests of the block pool (``fd_core.engine.block_pool``).

A hypothesis state machine drives random interleavings of what the scheduler does with the pool
(admit a new sequence from the prefix cache, grow and compute it, fork it, free it, preempt it by
recompute or by swap, take raw blocks to force eviction, reset the cache) against a shadow model
of device memory: ``content[block][offset]`` is the ``(position, token)`` a sequence "computed"
into that slot, fork's copies copy it, and a block handed out fresh is scribbled over. If the
pool ever shares, caches, evicts or hands out a block wrongly, some sequence's computed tokens
or some cache entry's content stop matching the tokens they stand for.
"""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fd_core.engine.block_pool import BlockPool, block_hash, seq_block_hashes
from fd_core.engine.block_rows import BlockTableRows
from fd_core.engine.sampling_params import SamplingParams
from fd_core.engine.sequence import Sequence

# A small alphabet and a few fixed prefixes, so that prompts share blocks and the cache hits.
TOKENS = st.integers(0, 2)
PREFIXES = (
    (0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1),
    (2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2),
    (1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0),
)
SALTS = st.sampled_from([None, None, None, "tenant-a"])

_ids = itertools.count()


def make_seq(prompt, salt: str | None = None) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=f"r{i}", index=0, prompt_token_ids=list(prompt),
                    params=SamplingParams(), seed=i, arrival=i, cache_salt=salt)


def chain(tokens, bs: int, salt: str | None, nblocks: int) -> list[bytes]:
    """The chained block hashes of ``tokens``, computed independently of the pool's memo."""
    out, parent = [], None
    for i in range(nblocks):
        parent = block_hash(parent, list(tokens[i * bs:(i + 1) * bs]), salt)
        out.append(parent)
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def snapshot(pool: BlockPool):
    """Everything observable about the pool's bookkeeping."""
    return (list(pool._free), dict(pool._cached), [(b.ref_count, b.hash) for b in pool.blocks],
            pool.evictions)


# --------------------------------------------------------------------------------------------
# The state machine
# --------------------------------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.running: list[Sequence] = []  # sequences holding blocks
        self.alloc: dict[int, int] = {}  # seq_id -> tokens its block table was sized for
        self.waiting: list[Sequence] = []  # preempted by recompute: no blocks, nothing computed
        self.swapped: list[tuple[Sequence, list[list]]] = []  # preempted by swap, host copies
        self.held: list[list[int]] = []  # raw blocks from take_blocks (swap-in style)
        self.history: list[tuple[tuple[int, ...], str | None]] = []  # every admitted prompt
        self.origin: dict[bytes, tuple[tuple[int, ...], str | None]] = {}  # hash -> true prefix
        self.content: dict[int, list] = {}  # shadow device memory
        self.cfo: list[int] = []  # model of the free, still-cached blocks, in eviction order
        self.junk = itertools.count()
        self.queried = self.hit_tokens = 0
        self.rows = BlockTableRows()  # the executor's copy of the tables, kept between steps

    @initialize(num_blocks=st.integers(3, 16), bs=st.sampled_from([1, 2, 3, 4]),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks: int, bs: int, caching: bool) -> None:
        self.pool = BlockPool(num_blocks, bs, enable_caching=caching)
        self.bs = bs
        self.content = {b: [None] * bs for b in range(num_blocks)}
        assert self.pool.capacity == num_blocks - 1 == self.pool.num_free

    # -- helpers -------------------------------------------------------------------------

    def _pick(self, data, seqs, label):
        return seqs[data.draw(st.integers(0, len(seqs) - 1), label=label)]

    def _expect_take(self, m: int, exclude=()):
        """Before ``m`` fresh blocks are handed out: which cached blocks must be evicted
        (uncached free blocks go first, then cached ones least recently freed first)."""
        free = [b for b in self.pool._free if b not in exclude]
        uncached = [b for b in free if self.pool.blocks[b].hash is None]
        cached = [b for b in self.cfo if b not in exclude]
        return cached[:max(0, m - len(uncached))], set(free)

    def _after_take(self, fresh, expected_evicted, free_before, evictions_before) -> None:
        pool = self.pool
        assert len(set(fresh)) == len(fresh)
        for b in fresh:
            assert b != 0, "block 0 handed out"
            assert b in free_before, f"block {b} handed out but was not free"
            assert pool.blocks[b].ref_count == 1 and pool.blocks[b].hash is None
            # whoever owns it now writes over it: stale content must never be read back
            self.content[b] = [("junk", next(self.junk))] * self.bs
        evicted = [b for b in fresh if b in self.cfo]
        if evicted:
            event("evicted cached free blocks")
        assert evicted == expected_evicted, (
            f"evicted {evicted}, expected LRU order {expected_evicted} (free queue model {self.cfo})")
        assert pool.evictions - evictions_before == len(evicted)
        self.cfo = [b for b in self.cfo if b not in evicted]

    def _expect_release(self, table) -> None:
        """Model of free(): the blocks that become free still cached join the LRU tail,
        the sequence's last blocks first."""
        rc = {b: self.pool.blocks[b].ref_count for b in table}
        for b in reversed(table):
            rc[b] -= 1
            if rc[b] == 0 and self.pool.blocks[b].hash is not None:
                self.cfo.append(b)

    def _check_hits(self, seq: Sequence, hits: list[int]) -> None:
        pool, bs = self.pool, self.bs
        n = seq.num_tokens
        if not pool.enable_caching:
            assert hits == []
        assert len(hits) <= max(0, (n - 1) // bs), "match covered the last token"
        assert len(set(hits)) == len(hits)
        for j, b in enumerate(hits):
            assert b != 0 and pool.blocks[b].hash is not None
            want = [(p, seq.tokens[p]) for p in range(j * bs, (j + 1) * bs)]
            assert self.content[b] == want, (
                f"match returned block {b} for block {j} of {seq.tokens} (salt {seq.cache_salt!r}) "
                f"but it holds {self.content[b]}")
        if not pool.enable_caching:
            return
        # a cached block some running sequence still uses cannot have been evicted: a prompt
        # that begins like that sequence must hit at least those blocks
        limit = max(0, (n - 1) // bs)
        for other in self.running:
            if (other.cache_salt or None) != (seq.cache_salt or None):
                continue
            k = 0
            while (k < min(limit, len(other.block_table))
                   and pool.blocks[other.block_table[k]].hash is not None
                   and other.tokens[k * bs:(k + 1) * bs] == seq.tokens[k * bs:(k + 1) * bs]):
                k += 1
            assert len(hits) >= k, (
                f"only {len(hits)} hits for {seq.tokens}, but a running sequence holds {k} "
                f"cached blocks of that prefix")

    def _admit(self, seq: Sequence, data) -> bool:
        pool, bs = self.pool, self.bs
        n = seq.num_tokens
        before = snapshot(pool)
        hits = pool.match(seq)
        assert snapshot(pool) == before, "match changed the pool"
        self._check_hits(seq, hits)
        cached = len(hits) * bs
        event("admit with cache hits" if hits else "admit without hits")
        target = cached + data.draw(st.integers(1, n - cached + bs), label="admit_tokens")
        taken_from_free = sum(1 for b in hits if pool.blocks[b].ref_count == 0)
        fresh = max(0, ceil_div(target, bs) - len(hits))
        can = pool.can_admit(seq, hits, target)
        assert can == (fresh + taken_from_free <= pool.num_free)
        if not can:
            with pytest.raises(RuntimeError):
                pool.admit(seq, hits, target)
            assert snapshot(pool) == before and seq.block_table == []
            event("admit refused")
            return False
        expected_evicted, free_before = self._expect_take(fresh, exclude=hits)
        ev = pool.evictions
        pool.admit(seq, hits, target)
        pool.record_lookup(n, cached)
        self.queried += n
        self.hit_tokens += cached
        assert seq.block_table[:len(hits)] == hits
        assert len(seq.block_table) == ceil_div(target, bs)
        assert seq.num_computed == cached, "the hit blocks count as computed"
        assert seq.num_committed_blocks == len(hits)
        self.cfo = [b for b in self.cfo if b not in hits]
        self._after_take(seq.block_table[len(hits):], expected_evicted, free_before, ev)
        self.alloc[seq.seq_id] = target
        self.running.append(seq)
        self.history.append((tuple(seq.tokens), seq.cache_salt))
        c = data.draw(st.integers(0, min(target, n) - cached), label="prefill_chunk")
        self._compute(seq, cached + c)
        return True

    def _compute(self, seq: Sequence, upto: int) -> None:
        """The model runs: write K/V of tokens[num_computed:upto] into the seq's slots."""
        pool, bs = self.pool, self.bs
        for pos in range(seq.num_computed, upto):
            b = seq.block_table[pos // bs]
            assert pool.blocks[b].ref_count == 1, f"writing position {pos} into shared block {b}"
            assert pool.blocks[b].hash is None, f"writing position {pos} into cached block {b}"
            self.content[b][pos % bs] = (pos, seq.tokens[pos])
        seq.num_computed = upto
        self._commit(seq)

    def _commit(self, seq: Sequence) -> None:
        pool, bs = self.pool, self.bs
        before = dict(pool._cached)
        ncb = seq.num_committed_blocks
        pool.commit(seq)
        after = pool._cached
        for h, b in before.items():
            assert after.get(h) == b, "commit dropped or moved a cache entry"
        full = min(seq.num_computed // bs, len(seq.block_table))
        if not pool.enable_caching:
            assert after == {} and seq.num_committed_blocks == ncb
            return
        assert seq.num_committed_blocks == max(ncb, full)
        hashes = chain(seq.tokens, bs, seq.cache_salt, full)
        for h, b in after.items():
            if h in before:
                continue
            assert seq.block_table.count(b) == 1
            i = seq.block_table.index(b)
            assert ncb <= i < full, f"commit published block {i} outside {ncb}..{full}"
            toks = tuple(seq.tokens[:(i + 1) * bs])
            assert chain(toks, bs, seq.cache_salt, i + 1)[-1] == h == hashes[i]
            self.origin[h] = (toks, seq.cache_salt)
        for i in range(ncb, full):
            assert hashes[i] in after, f"committed block {i} of {seq.tokens} is not findable"
            if after[hashes[i]] != seq.block_table[i]:
                event("duplicate block kept private")

    def _free_seq(self, seq: Sequence) -> None:
        self._expect_release(seq.block_table)
        self.pool.free(seq)
        assert seq.block_table == [] and seq.num_committed_blocks == 0
        del self.alloc[seq.seq_id]

    # -- rules ---------------------------------------------------------------------------

    @rule(data=st.data(), p=st.integers(0, len(PREFIXES) - 1), salt=SALTS)
    def allocate(self, data, p, salt) -> None:
        """A new request whose prompt begins with one of a few fixed prefixes."""
        prefix = PREFIXES[p][:data.draw(st.integers(0, len(PREFIXES[p])), label="prefix_len")]
        suffix = data.draw(st.lists(TOKENS, max_size=6), label="suffix")
        prompt = list(prefix) + suffix or [0]
        self._admit(make_seq(prompt, salt), data)

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def hit(self, data) -> None:
        """A new request sharing a prefix with an earlier one (same salt)."""
        tokens, salt = self._pick(data, self.history, "donor")
        keep = data.draw(st.integers(1, len(tokens)), label="shared")
        suffix = data.draw(st.lists(TOKENS, max_size=2 * self.bs), label="suffix")
        self._admit(make_seq(list(tokens[:keep]) + suffix, salt), data)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def append(self, data) -> None:
        """Sample k tokens into a running sequence, grow it, compute a chunk, commit."""
        pool, bs = self.pool, self.bs
        seq = self._pick(data, self.running, "seq")
        k = data.draw(st.integers(0, 2 * bs), label="new_tokens")
        seq.output_token_ids.extend(data.draw(st.lists(TOKENS, min_size=k, max_size=k), label="toks"))
        c = data.draw(st.integers(0, seq.num_tokens - seq.num_computed), label="chunk")
        lookahead = data.draw(st.integers(0, bs), label="lookahead")
        target = max(self.alloc[seq.seq_id], seq.num_computed + c + lookahead)
        need = pool.blocks_needed(seq, target)
        assert need == max(0, ceil_div(target, bs) - len(seq.block_table))
        if pool.can_grow(seq, target):
            expected_evicted, free_before = self._expect_take(need)
            ev, old = pool.evictions, len(seq.block_table)
            pool.grow(seq, target)
            assert len(seq.block_table) == old + need
            self._after_take(seq.block_table[old:], expected_evicted, free_before, ev)
            self.alloc[seq.seq_id] = target
        else:
            assert need > pool.num_free
            before = snapshot(pool)
            table = list(seq.block_table)
            with pytest.raises(RuntimeError):
                pool.grow(seq, target)
            assert snapshot(pool) == before and seq.block_table == table
            event("grow refused")
            c = min(c, self.alloc[seq.seq_id] - seq.num_computed)
        self._compute(seq, seq.num_computed + c)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def shrink(self, data) -> None:
        """Give back a sequence's blocks past some uncomputed position (a speculative step's
        rejected drafts)."""
        seq = self._pick(data, self.running, "seq")
        keep = data.draw(st.integers(seq.num_computed, self.alloc[seq.seq_id]), label="keep")
        kept = ceil_div(keep, self.bs)
        if kept < len(seq.block_table):
            self._expect_release(seq.block_table[kept:])
            self.alloc[seq.seq_id] = keep
            event("shrunk")
        self.pool.shrink(seq, keep)
        assert len(seq.block_table) == ceil_div(self.alloc[seq.seq_id], self.bs)

    @precondition(lambda self: any(s.num_computed > 0 for s in self.running))
    @rule(data=st.data())
    def fork(self, data) -> None:
        """Another output of a running sequence continues from its computed tokens."""
        pool, bs = self.pool, self.bs
        parent = self._pick(data, [s for s in self.running if s.num_computed > 0], "parent")
        nc = parent.num_computed
        child = make_seq(parent.tokens[:nc], parent.cache_salt)
        full, partial = divmod(nc, bs)
        before = snapshot(pool)
        parent_table = list(parent.block_table)
        expected_evicted, free_before = self._expect_take(1 if partial else 0)
        ev = pool.evictions
        copies = pool.fork(parent, child)
        assert parent.block_table == parent_table and parent.num_computed == nc
        if partial and not free_before:
            assert copies is None
            assert snapshot(pool) == before, "a failed fork changed the pool"
            assert child.block_table == [] and child.num_computed == 0
            event("fork refused")
            return
        assert copies is not None, "fork failed with a free block available"
        assert child.block_table[:full] == parent.block_table[:full]
        assert len(child.block_table) == ceil_div(nc, bs)
        assert child.num_computed == nc
        assert child.num_committed_blocks <= min(parent.num_committed_blocks, full)
        if partial:
            assert len(copies) == 1
            src, dst = copies[0]
            assert src == parent.block_table[full] and dst == child.block_table[full] != src
            self._after_take([dst], expected_evicted, free_before, ev)
            self.content[dst] = list(self.content[src])  # the copy the caller makes
            event("fork copied a partial block")
        else:
            assert copies == []
            event("fork at a block boundary")
            assert snapshot(pool)[0] == before[0], "a fork without copies touched the free queue"
        self.alloc[child.seq_id] = nc
        self.running.append(child)
        self.history.append((tuple(child.tokens), child.cache_salt))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data) -> None:
        """A sequence finishes (or is aborted)."""
        seq = self.running.pop(data.draw(st.integers(0, len(self.running) - 1), label="seq"))
        self._free_seq(seq)
        before = snapshot(self.pool)
        self.pool.free(seq)  # freeing an emptied sequence again releases nothing
        assert snapshot(self.pool) == before

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_recompute(self, data) -> None:
        seq = self.running.pop(data.draw(st.integers(0, len(self.running) - 1), label="seq"))
        self._free_seq(seq)
        seq.num_computed = 0
        self.waiting.append(seq)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data) -> None:
        """A sequence preempted by recompute comes back, mostly from the prefix cache."""
        i = data.draw(st.integers(0, len(self.waiting) - 1), label="seq")
        if self._admit(self.waiting[i], data):
            self.waiting.pop(i)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_swap(self, data) -> None:
        seq = self.running.pop(data.draw(st.integers(0, len(self.running) - 1), label="seq"))
        host = [list(self.content[b]) for b in seq.block_table]
        alloc = self.alloc[seq.seq_id]
        self._free_seq(seq)
        self.alloc[seq.seq_id] = alloc
        self.swapped.append((seq, host))

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        pool = self.pool
        i = data.draw(st.integers(0, len(self.swapped) - 1), label="seq")
        seq, host = self.swapped[i]
        if len(host) > pool.num_free:
            return
        self.swapped.pop(i)
        expected_evicted, free_before = self._expect_take(len(host))
        ev = pool.evictions
        device = pool.take_blocks(len(host))
        self._after_take(device, expected_evicted, free_before, ev)
        for b, saved in zip(device, host):
            self.content[b] = list(saved)
        seq.block_table = device
        event("swap in")
        self.running.append(seq)
        self._commit(seq)

    @rule(data=st.data())
    def evict(self, data) -> None:
        """Take raw blocks, enough to evict cached free blocks when there are any."""
        pool = self.pool
        nf = pool.num_free
        if data.draw(st.booleans(), label="overdraw"):
            before = snapshot(pool)
            with pytest.raises(RuntimeError):
                pool.take_blocks(nf + 1)
            assert snapshot(pool) == before
        uncached = nf - len(self.cfo)
        lo = uncached + 1 if self.cfo else 0
        count = data.draw(st.integers(lo, nf), label="count")
        expected_evicted, free_before = self._expect_take(count)
        ev = pool.evictions
        blocks = pool.take_blocks(count)
        assert len(blocks) == count
        self._after_take(blocks, expected_evicted, free_before, ev)
        if data.draw(st.booleans(), label="hold"):
            self.held.append(blocks)
        else:
            self._release_raw(blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_held(self, data) -> None:
        self._release_raw(self.held.pop(data.draw(st.integers(0, len(self.held) - 1), label="i")))

    def _release_raw(self, blocks: list[int]) -> None:
        holder = make_seq([])
        holder.block_table = list(blocks)
        self._expect_release(blocks)
        self.pool.free(holder)

    @rule()
    def reset(self) -> None:
        pool = self.pool
        in_use = {h: b for h, b in pool._cached.items() if pool.blocks[b].ref_count > 0}
        assert pool.reset_prefix_cache() == len(self.cfo)
        assert pool._cached == in_use, "reset dropped a prefix a running sequence uses"
        self.cfo = []

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        pool, bs = self.pool, self.bs
        if pool is None:
            return
        refs = collections.Counter()
        for s in self.running:
            assert len(set(s.block_table)) == len(s.block_table), "a block twice in one table"
            refs.update(s.block_table)
        for blocks in self.held:
            refs.update(blocks)
        for s in self.waiting:
            assert s.block_table == [] and s.num_computed == 0
        for s, _ in self.swapped:
            assert s.block_table == []

        # no leak, no double free, block 0 reserved
        assert 0 not in refs and pool.blocks[0].ref_count == 0 and 0 not in pool._free
        free = list(pool._free)
        assert len(set(free)) == len(free)
        free_set = set(free)
        for b in range(1, pool.num_blocks):
            rc = pool.blocks[b].ref_count
            assert rc >= 0, f"block {b} has ref_count {rc}"
            assert rc == refs[b], f"block {b}: ref_count {rc}, referenced {refs[b]} times"
            assert (rc == 0) == (b in free_set), f"block {b}: ref_count {rc}, free={b in free_set}"
        assert pool.num_free == sum(1 for b in pool.blocks[1:] if b.ref_count == 0)

        # the prefix cache: hash <-> block is a bijection, and content matches the hash
        if not pool.enable_caching:
            assert pool._cached == {} and all(b.hash is None for b in pool.blocks)
        hashed = {b.block_id: b.hash for b in pool.blocks if b.hash is not None}
        assert len(hashed) == len(pool._cached) == pool.num_cached
        for h, b in pool._cached.items():
            assert hashed.get(b) == h
            toks, salt = self.origin[h]
            i = len(toks) // bs - 1
            assert self.content[b] == [(i * bs + o, toks[i * bs + o]) for o in range(bs)], (
                f"cached block {b} should hold {toks[i * bs:]} at {i * bs}, holds {self.content[b]}")

        # free queue: uncached blocks first, then cached ones least recently freed first
        flags = [pool.blocks[b].hash is not None for b in free]
        assert flags == sorted(flags), "a cached free block is queued before an uncached one"
        assert [b for b in free if pool.blocks[b].hash is not None] == self.cfo

        for s in self.running:
            alloc = self.alloc[s.seq_id]
            assert len(s.block_table) == ceil_div(alloc, bs)
            assert s.num_computed <= min(alloc, s.num_tokens)
            assert s.num_committed_blocks <= s.num_computed // bs
            for pos in range(s.num_computed):  # every computed token's K/V is intact
                b = s.block_table[pos // bs]
                assert self.content[b][pos % bs] == (pos, s.tokens[pos]), (
                    f"seq {s.seq_id} position {pos}: block {b} holds {self.content[b][pos % bs]}")
            hashes = None
            for i, b in enumerate(s.block_table):
                if (i + 1) * bs > s.num_computed:
                    assert pool.blocks[b].ref_count == 1, f"partial block {b} is shared"
                    assert pool.blocks[b].hash is None, f"partial block {b} is cached"
                elif pool.blocks[b].hash is not None:
                    hashes = hashes or chain(s.tokens, bs, s.cache_salt, s.num_computed // bs)
                    assert pool.blocks[b].hash == hashes[i]

        assert pool.queried_tokens == self.queried and pool.hit_tokens == self.hit_tokens
        assert pool.hit_rate() == (self.hit_tokens / self.queried if self.queried else 0.0)

    @invariant()
    def block_rows_are_the_tables(self) -> None:
        """The executor's kept rows equal the tables built afresh, whatever the pool did to
        them since the last step (this machine's steps see the running sequences in turn)."""
        if not self.running:
            return
        got = self.rows.tables(self.running)
        width = max(len(s.block_table) for s in self.running)
        want = [s.block_table + [0] * (width - len(s.block_table)) for s in self.running]
        assert got.tolist() == want


TestBlockPoolStateMachine = BlockPoolMachine.TestCase
TestBlockPoolStateMachine.settings = settings(
    max_examples=250, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# --------------------------------------------------------------------------------------------
# @given: the hash chain
# --------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(TOKENS, min_size=1, max_size=24), bs=st.integers(1, 4), salt=SALTS,
       data=st.data())
def test_block_hash_chain(tokens, bs, salt, data):
    nblocks = len(tokens) // bs
    seq = make_seq(tokens, salt)
    memo = seq_block_hashes(seq, nblocks, bs)
    assert memo == chain(tokens, bs, salt, nblocks)
    assert seq_block_hashes(seq, nblocks, bs) == memo  # memoised, stable
    other = "tenant-b" if salt else "tenant-a"
    if nblocks:  # another salt changes every block's identity
        assert not set(chain(tokens, bs, other, nblocks)) & set(memo)
        # changing one token changes that block's identity and every later one, not earlier ones
        pos = data.draw(st.integers(0, nblocks * bs - 1))
        changed = list(tokens)
        changed[pos] = (changed[pos] + 1) % 3
        j = pos // bs
        alt = chain(changed, bs, salt, nblocks)
        assert alt[:j] == memo[:j]
        assert all(a != m for a, m in zip(alt[j:], memo[j:]))


# --------------------------------------------------------------------------------------------
# Deterministic unit tests
# --------------------------------------------------------------------------------------------


def run(pool: BlockPool, seq: Sequence) -> list[int]:
    """Admit ``seq`` from the cache, compute all its tokens, commit. Returns the hits."""
    hits = pool.match(seq)
    assert pool.can_admit(seq, hits, seq.num_tokens)
    pool.admit(seq, hits, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    pool.commit(seq)
    return hits


def test_lru_eviction_order():
    pool = BlockPool(9, 2, enable_caching=True)  # 8 usable blocks
    a = make_seq([0, 0, 1, 1, 2, 2])  # 3 full blocks, all cached
    b = make_seq([1, 2, 1, 2])  # 2 full blocks, cached
    u = make_seq([0])  # one partial block, not cached
    for s in (a, b, u):
        run(pool, s)
    a_blocks, b_blocks, u_blocks = list(a.block_table), list(b.block_table), list(u.block_table)
    assert pool.num_cached == 5 and pool.num_free == 2
    idle = set(pool._free)
    pool.free(a)  # freed first: least recently freed
    pool.free(b)
    pool.free(u)  # freed last, but worthless: reused first
    assert pool.num_free == 8 and pool.num_cached == 5
    first = pool.take_blocks(3)
    assert set(first) == idle | set(u_blocks), "uncached free blocks go before cached ones"
    assert pool.num_cached == 5 and pool.evictions == 0
    # among cached blocks: a's before b's, and a's tail before its head
    assert pool.take_blocks(1) == [a_blocks[2]]
    assert pool.evictions == 1 and pool.num_cached == 4
    probe = make_seq([0, 0, 1, 1, 2, 2, 0])
    assert pool.match(probe) == a_blocks[:2], "a's head survives its tail's eviction"
    assert pool.take_blocks(2) == [a_blocks[1], a_blocks[0]]
    assert pool.match(make_seq([0, 0, 1, 1, 2, 2, 0])) == []
    assert pool.match(make_seq([1, 2, 1, 2, 0])) == b_blocks
    assert pool.take_blocks(2) == [b_blocks[1], b_blocks[0]]
    assert pool.num_free == 0 and pool.num_cached == 0 and pool.evictions == 5


def test_lru_reuse_refreshes_recency():
    """A cached free block that is hit and freed again moves behind blocks freed before it."""
    pool = BlockPool(7, 2, enable_caching=True)
    a, b = make_seq([0, 0, 0]), make_seq([1, 1, 1])
    run(pool, a)
    run(pool, b)
    a0, b0 = a.block_table[0], b.block_table[0]
    pool.free(a)
    pool.free(b)
    again = make_seq([0, 0, 2])
    assert run(pool, again) == [a0]
    pool.free(again)  # a0 is now the most recently freed cached block
    taken = pool.take_blocks(pool.num_free)
    assert taken.index(b0) < taken.index(a0)


def test_cache_salt_isolates_identical_prompts():
    pool = BlockPool(20, 2, enable_caching=True)
    prompt = [1, 2, 1, 2, 0]
    a = make_seq(prompt, "x")
    run(pool, a)
    assert pool.match(make_seq(prompt, "y")) == []
    assert pool.match(make_seq(prompt, None)) == []
    assert pool.match(make_seq(prompt, "x")) == a.block_table[:2]
    # and the other way round: an unsalted prompt is not visible to a salted one
    plain = make_seq(prompt)
    run(pool, plain)
    assert set(plain.block_table).isdisjoint(a.block_table)
    assert pool.match(make_seq(prompt)) == plain.block_table[:2]
    assert pool.match(make_seq(prompt, "x")) == a.block_table[:2]
    assert pool.num_cached == 4


def test_fork_at_full_block_boundary_copies_nothing():
    pool = BlockPool(10, 4, enable_caching=True)
    parent = make_seq(list(range(8)))
    pool.admit(parent, [], 9)  # 3 blocks: room for the next token
    parent.num_computed = 8
    pool.commit(parent)
    free_before = list(pool._free)
    child = make_seq(parent.tokens)
    assert pool.fork(parent, child) == []
    assert child.block_table == parent.block_table[:2]
    assert child.num_computed == 8
    assert [pool.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]
    assert list(pool._free) == free_before
    child.output_token_ids.append(5)
    pool.grow(child, 9)  # the child's next token gets a block of its own
    assert child.block_table[2] != parent.block_table[2]
    pool.free(parent)
    pool.free(child)
    assert pool.num_free == pool.capacity


def test_fork_partial_block_is_copied():
    pool = BlockPool(10, 4)
    parent = make_seq(list(range(6)))
    pool.admit(parent, [], 6)
    parent.num_computed = 6
    child = make_seq(parent.tokens)
    copies = pool.fork(parent, child)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]
    assert pool.blocks[parent.block_table[1]].ref_count == 1
    assert pool.blocks[child.block_table[1]].ref_count == 1


def test_fork_without_free_block_returns_none_and_changes_nothing():
    pool = BlockPool(3, 4, enable_caching=True)  # 2 usable blocks
    parent = make_seq([1, 2, 3, 4, 5])
    pool.admit(parent, [], 5)
    parent.num_computed = 5
    pool.commit(parent)
    assert pool.num_free == 0
    before = snapshot(pool)
    table = list(parent.block_table)
    child = make_seq(parent.tokens)
    assert pool.fork(parent, child) is None
    assert snapshot(pool) == before
    assert parent.block_table == table and child.block_table == []
    assert child.num_computed == 0 and child.num_committed_blocks == 0


def test_commit_of_duplicate_content_stays_private():
    pool = BlockPool(10, 2, enable_caching=True)
    prompt = [1, 2, 1, 2, 0]
    a, b = make_seq(prompt), make_seq(prompt)
    # both admitted before either computed: neither finds the other's blocks
    for s in (a, b):
        assert pool.match(s) == []
        pool.admit(s, [], s.num_tokens)
    for s in (a, b):
        s.num_computed = s.num_tokens
        pool.commit(s)
    assert pool.num_cached == 2
    assert [pool.blocks[x].hash is not None for x in a.block_table] == [True, True, False]
    assert all(pool.blocks[x].hash is None for x in b.block_table)
    assert b.num_committed_blocks == 2
    assert sorted(pool._cached.values()) == sorted(a.block_table[:2])
    b_table = list(b.block_table)
    pool.free(b)  # private duplicates are worthless: reused first
    assert set(list(pool._free)[:3]) == set(b_table)
    assert pool.num_cached == 2
    c = make_seq(prompt)
    assert pool.match(c) == a.block_table[:2]


def test_commit_of_duplicate_content_freed_to_front():
    pool = BlockPool(10, 2, enable_caching=True)
    prompt = [1, 2, 1, 2, 0]
    a, b = make_seq(prompt), make_seq(prompt)
    for s in (a, b):
        pool.admit(s, [], s.num_tokens)
    for s in (a, b):
        s.num_computed = s.num_tokens
        pool.commit(s)
    a_table, b_table = list(a.block_table), list(b.block_table)
    pool.free(a)
    pool.free(b)
    free = list(pool._free)
    assert set(free[:4]) == {a_table[2]} | set(b_table), "uncached blocks first"
    assert free[-2:] == [a_table[1], a_table[0]], "cached blocks last, tail before head"


def test_double_free_and_over_release():
    pool = BlockPool(6, 2, enable_caching=True)
    a = make_seq([1, 2, 3])
    run(pool, a)
    table = list(a.block_table)
    pool.free(a)
    assert a.block_table == [] and pool.num_free == pool.capacity
    before = snapshot(pool)
    pool.free(a)  # a second free of the same sequence releases nothing
    assert snapshot(pool) == before
    stale = make_seq([1, 2, 3])
    stale.block_table = table  # a stale copy of the released table
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(stale)


def test_over_release_of_shared_block():
    pool = BlockPool(6, 2)
    a = make_seq([1, 2, 3, 4])
    run(pool, a)
    b = make_seq(a.tokens)
    assert pool.fork(a, b) == []
    shared = a.block_table[0]
    assert pool.blocks[shared].ref_count == 2
    pool.free(b)
    assert pool.blocks[shared].ref_count == 1 and shared not in pool._free
    extra = make_seq([])
    extra.block_table = [shared, shared]  # releases one reference too many
    with pytest.raises(RuntimeError):
        pool.free(extra)


def test_match_never_covers_the_last_token_and_changes_nothing():
    pool = BlockPool(10, 2, enable_caching=True)
    run(pool, make_seq([1, 1, 2, 2, 0]))
    before = snapshot(pool)
    assert len(pool.match(make_seq([1, 1, 2, 2]))) == 1  # 2 full blocks, last token excluded
    assert len(pool.match(make_seq([1, 1, 2, 2, 9]))) == 2
    assert pool.match(make_seq([1, 1])) == []
    assert snapshot(pool) == before


def test_admit_counts_hits_as_computed_and_hit_rate():
    pool = BlockPool(10, 2, enable_caching=True)
    run(pool, make_seq([1, 1, 2, 2, 0]))
    s = make_seq([1, 1, 2, 2, 1, 1])
    hits = pool.match(s)
    pool.record_lookup(s.num_tokens, len(hits) * 2)
    pool.admit(s, hits, s.num_tokens)
    assert s.block_table[:2] == hits and len(s.block_table) == 3
    assert s.num_computed == 4 and s.num_committed_blocks == 2
    assert pool.hit_rate() == 4 / 6


def test_caching_disabled_never_hits():
    pool = BlockPool(10, 2, enable_caching=False)
    run(pool, make_seq([1, 1, 2, 2, 0]))
    assert pool.match(make_seq([1, 1, 2, 2, 0])) == []
    assert pool.num_cached == 0


def test_exhaustion_raises_and_block_zero_is_reserved():
    pool = BlockPool(5, 2, enable_caching=True)
    taken = pool.take_blocks(4)
    assert sorted(taken) == [1, 2, 3, 4] and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.take_blocks(1)
    s = make_seq([1, 2, 3])
    assert not pool.can_grow(s, 3) and not pool.can_admit(s, [], 3)
    with pytest.raises(RuntimeError):
        pool.grow(s, 3)
    with pytest.raises(RuntimeError):
        pool.admit(s, [], 3)
    assert s.block_table == []
    with pytest.raises(ValueError):
        BlockPool(1, 2)


def test_reset_prefix_cache_keeps_prefixes_in_use():
    pool = BlockPool(10, 2, enable_caching=True)
    a, b = make_seq([1, 1, 0]), make_seq([2, 2, 0])
    run(pool, a)
    run(pool, b)
    pool.free(a)
    assert pool.reset_prefix_cache() == 1
    assert pool.match(make_seq([1, 1, 0])) == []
    assert pool.match(make_seq([2, 2, 0])) == b.block_table[:1]


def test_block_rows_give_back_the_rows_of_sequences_gone():
    """Rows of sequences no longer scheduled are given back once they outnumber the step's,
    zeroed, and a returning sequence is written afresh; every step's tables stay exact."""
    import random

    rows, rng = BlockTableRows(), random.Random(0)
    seqs = [make_seq([0]) for _ in range(300)]
    for s in seqs:
        s.block_table = [rng.randrange(1, 1000) for _ in range(rng.randrange(0, 40))]
    for step in range(60):
        batch = rng.sample(seqs, rng.randrange(1, 20))
        for s in batch:
            if rng.random() < 0.3:
                s.block_table.extend(rng.randrange(1, 1000) for _ in range(rng.randrange(1, 3)))
            elif rng.random() < 0.1:
                s.block_table = s.block_table[: rng.randrange(0, len(s.block_table) + 1)]
        width = max(len(s.block_table) for s in batch)
        assert rows.tables(batch).tolist() == [s.block_table + [0] * (width - len(s.block_table)) for s in batch]
        assert len(rows) <= 2 * 20 + 64 + len(batch)
