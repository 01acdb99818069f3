"""Continuous batching over a token budget.

Each step the scheduler decides, for every sequence it runs, how many of its not-yet-computed
tokens go into the step:

1. Running sequences first, oldest first: a decoding sequence takes 1 token, a sequence still
   prefilling takes as much of its remaining prompt as the budget allows (chunked prefill).
   If the block pool cannot hold a running sequence's new tokens, the newest running sequence
   is preempted (its blocks freed, its progress reset, recomputed later) until it can.
2. Then waiting sequences, oldest first, while ``max_num_seqs`` and the token budget allow and
   the block pool has room; a preempted sequence is back at the front of the queue.

A step never exceeds ``max_num_batched_tokens`` tokens or ``max_num_seqs`` sequences, and no
sequence grows beyond ``max_model_len`` tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fd_core.engine.block_pool import BlockPool
from fd_core.engine.sequence import Sequence, Status


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

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        queue = sorted(self.running, key=lambda s: s.arrival)
        kept: list[Sequence] = []
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            while not self.pool.can_grow(seq, seq.num_computed + num_new):
                victim = queue.pop() if queue else None
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
            if not self.pool.can_grow(seq, seq.num_computed + num_new):
                self._preempt(seq)
                preempted.append(seq)
                continue
            self.pool.grow(seq, seq.num_computed + num_new)
            scheduled.append(ScheduledSeq(seq, num_new))
            kept.append(seq)
            budget -= num_new
        kept.extend(queue)  # over budget this step; they stay running and go first next step
        self.running = kept

        # preempted sequences go back to the head of the queue, oldest first
        for seq in sorted(preempted, key=lambda s: s.arrival, reverse=True):
            self.waiting.appendleft(seq)

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                remaining = seq.num_tokens - seq.num_computed
                if remaining > budget and not self.chunked_prefill:
                    break
                num_new = min(remaining, budget)
                if not self.pool.can_grow(seq, seq.num_computed + num_new):
                    break
                self.waiting.popleft()
                self.pool.grow(seq, seq.num_computed + num_new)
                seq.status = Status.RUNNING
                self.running.append(seq)
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.pool.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.pool.free(seq)
