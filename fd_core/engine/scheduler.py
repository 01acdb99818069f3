"""Continuous batching over a token budget, first come first served.

Each step the scheduler decides, for every sequence it runs, how many of its not-yet-computed
tokens go into the step (at most ``max_num_batched_tokens`` in all, at most ``max_num_seqs``
sequences running):

1. Running sequences first, oldest arrival first: a decoding sequence takes 1 token, a
   sequence still prefilling takes as much of its remaining prompt as the budget leaves
   (chunked prefill), so decodes are never starved by a long prompt. When the block pool cannot
   hold a running sequence's new tokens, the newest running sequence is preempted — by swapping
   its blocks to host memory when there is swap space for them, else by recompute (its blocks
   are released and it starts over, less what the prefix cache still holds) — until it can; a
   sequence that is itself the newest preempts itself.
2. Then, only if nothing was preempted, waiting sequences in arrival order (preempted ones keep
   their place, so they come back first): a swapped sequence gets fresh blocks and its host
   blocks are copied back; any other is matched against the prefix cache and computes only
   what the cache lacks. Admission stops at the first sequence that does not fit (budget,
   ``max_num_seqs``, free blocks; with chunked prefill off, a prompt must fit the budget whole),
   so a long prompt is never overtaken by later short ones.

The ``n`` outputs of one request enter as one sequence; the others are forked from it once its
prompt is computed (``fork``).
"""

from __future__ import annotations

import bisect
import operator
from collections import deque
from dataclasses import dataclass, field

from fd_core.engine.block_pool import BlockPool
from fd_core.engine.sequence import Sequence, Status
from fd_core.engine.swap import SwapSpace

_by_arrival = operator.attrgetter("arrival")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed this step, starting at seq.num_computed

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence and so samples its next token."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    # block copies the step makes before it computes: (device, host) out, (host, device) in
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, swap: SwapSpace | None = None) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.swap = swap
        self.waiting: list[Sequence] = []  # by arrival
        self.running: list[Sequence] = []
        self.num_swapped_out = 0
        self.num_recomputed = 0

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_swapped(self) -> int:
        return sum(1 for s in self.waiting if s.status is Status.SWAPPED)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [])
        budget = self.max_num_batched_tokens

        queue = deque(sorted(self.running, key=_by_arrival))
        kept: list[Sequence] = []
        scheduled = out.scheduled
        block_size = self.pool.block_size
        # a loop over every running sequence, every step: kept to plain attribute reads
        while queue and budget > 0:
            seq = queue.popleft()
            outputs = seq.output_token_ids
            if len(outputs) >= seq.max_tokens:
                # its last token is still on the device (asynchronous scheduling): nothing to run
                kept.append(seq)
                continue
            num_new = min(len(seq.prompt_token_ids) + len(outputs) - seq.num_computed, budget)
            target = seq.num_computed + num_new
            if target > len(seq.block_table) * block_size:  # most decode steps fit the last block
                need = self.pool.blocks_needed(seq, target)
                while need > self.pool.num_free and queue:
                    self._preempt(queue.pop(), out)
                if need > self.pool.num_free:
                    self._preempt(seq, out)
                    continue
                self.pool.grow(seq, target)
            scheduled.append(ScheduledSeq(seq, num_new))
            kept.append(seq)
            budget -= num_new
        kept.extend(queue)  # over budget this step; they stay running and go first next step
        self.running = kept
        for seq in out.preempted:
            self.add(seq)

        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget, out)
            if num_new is None:
                break
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Give a waiting sequence its blocks for this step; how many tokens it computes, or
        None (changing nothing) when it does not fit."""
        if seq.status is Status.SWAPPED:
            num_new = self._fit(seq.num_tokens - seq.num_computed, budget)
            if num_new is None or self.pool.blocks_needed(seq, seq.num_computed + num_new) > self.pool.num_free:
                return None
            device = self.pool.take_blocks(len(seq.host_blocks))
            out.swap_in.extend(zip(seq.host_blocks, device))
            self.swap.release(seq.host_blocks)
            seq.host_blocks, seq.block_table = [], device
            self.pool.grow(seq, seq.num_computed + num_new)
            return num_new

        hits = self.pool.match(seq)
        cached = len(hits) * self.pool.block_size
        num_new = self._fit(seq.num_tokens - cached, budget)
        if num_new is None or not self.pool.can_admit(seq, hits, cached + num_new):
            return None
        self.pool.admit(seq, hits, cached + num_new)
        self.pool.record_lookup(seq.num_tokens, cached)
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = cached
        return num_new

    def _fit(self, remaining: int, budget: int) -> int | None:
        if remaining > budget and not self.chunked_prefill:
            return None
        return min(remaining, budget)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        host = self.swap.take(len(seq.block_table)) if self.swap is not None else None
        if host is not None:
            # the copies run before this step computes, so the freed blocks may be reused in it
            out.swap_out.extend(zip(seq.block_table, host))
            seq.host_blocks = host
            seq.status = Status.SWAPPED
            self.num_swapped_out += 1
        else:
            seq.num_computed = 0
            seq.status = Status.WAITING
            self.num_recomputed += 1
        self.pool.free(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)

    def advance(self, out: SchedulerOutput) -> None:
        """Record that the step ran: its tokens are computed, full blocks join the prefix cache."""
        block_size, commit = self.pool.block_size, self.pool.enable_caching
        for s in out.scheduled:
            seq = s.seq
            if seq.status is Status.FINISHED:  # ended on the previous step's token while this one ran
                continue
            seq.num_computed += s.num_new
            if commit and seq.num_computed // block_size > seq.num_committed_blocks:  # a block filled up
                self.pool.commit(seq)

    # -- forks and endings -----------------------------------------------------------------

    def fork(self, parent: Sequence) -> list[tuple[int, int]]:
        """Start ``parent``'s waiting siblings from its computed prompt. Each that finds a seat
        and a block shares the prompt's blocks; the others queue and compute it themselves
        (mostly from the prefix cache). Returns the block copies to make now."""
        copies: list[tuple[int, int]] = []
        for child in parent.forks:
            child.fork_of = None
            child.num_cached_tokens = parent.num_cached_tokens
            made = self.pool.fork(parent, child) if len(self.running) < self.max_num_seqs else None
            if made is None:
                self.add(child)
                continue
            copies.extend(made)
            child.status = Status.RUNNING
            self.running.append(child)
        parent.forks = []
        return copies

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out of scheduling (finished or aborted), releasing all it holds."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.fork_of is not None:
            seq.fork_of.forks.remove(seq)
            seq.fork_of = None
        for child in seq.forks:  # its siblings can no longer fork from it: they queue alone
            child.fork_of = None
            self.add(child)
        seq.forks = []
        if seq.host_blocks:
            self.swap.release(seq.host_blocks)
            seq.host_blocks = []
        self.pool.free(seq)
