"""Continuous batching over a token budget, first come first served.

Each step the scheduler decides, for every sequence it runs, how many of its not-yet-computed
tokens go into the step, and which rows it samples. Its limits, which no step exceeds: the
tokens it computes plus the rows of the forks it seats (below) are at most
``max_num_batched_tokens``; the running sequences plus the forks it seats are at most
``max_num_seqs``, and so are the rows it samples (each running sequence samples at most one).

1. Running sequences first, oldest arrival first: a decoding sequence takes 1 token, a
   sequence still prefilling takes as much of its remaining prompt as the budget leaves
   (chunked prefill), so decodes are never starved by a long prompt. With a
   ``long_prefill_token_threshold`` (0: none) a prefilling sequence with more tokens left than
   the threshold takes the threshold's worth — and none at all if an older one past it has no
   more tokens left than itself (that one finishes first: prompts beyond the threshold are
   prefilled oldest first, not in turns). When the block pool cannot hold a running
   sequence's new tokens, the newest running sequence is preempted — by swapping its blocks to
   host memory when there is swap space for them, else by recompute (its blocks are released
   and it starts over, less what the prefix cache still holds) — until it can; a sequence that
   is itself the newest preempts itself.
2. Then, only if nothing was preempted, waiting sequences in arrival order (preempted ones keep
   their place, so they come back first): a swapped sequence gets fresh blocks and its host
   blocks are copied back; any other is matched against the prefix cache and computes only
   what the cache lacks, again at most the threshold. Admission stops at the first sequence
   that does not fit (budget, ``max_num_seqs``, free blocks; with chunked prefill off, a prompt
   must fit the budget whole), so a long prompt is never overtaken by later short ones.
3. Budget left after admission goes back to the sequences the threshold held back, oldest
   first, as far as free blocks allow (never by preempting): a long prompt alone still
   prefills at the full budget, and one that prefills beside others leaves room for new
   requests to start in the next step.

The ``n`` outputs of one request enter as one sequence holding the others in ``forks``. The
step that computes the end of its prompt seats forks in order, each while there is a seat
(``max_num_seqs``), a token of budget for its sampled row and, where the prompt ends inside a
block, a free block for its copy of that block (promised to it until the step is recorded);
those sample from the parent's row and then share its blocks (``fork``). The others are
detached and queue as ordinary sequences, computing the prompt themselves (mostly from the
prefix cache) and sampling their first token from their own logits: the same token, since
sampling depends only on the logits, the seed and the step.
"""

from __future__ import annotations

import bisect
import operator
from collections import deque
from dataclasses import dataclass, field

from fd_core.engine.block_pool import BlockPool
from fd_core.engine.sequence import PLACEHOLDER, Sequence, Status
from fd_core.engine.swap import SwapSpace

_by_arrival = operator.attrgetter("arrival")
_by_seq_arrival = operator.attrgetter("seq.arrival")


@dataclass
class ScheduledSeq:
    seq: Sequence
    # tokens computed this step, starting at seq.num_computed: its drafts, if any, included
    num_new: int
    # forks of ``seq`` seated this step: each samples its first token from this step's row of
    # ``seq`` (with its own seed), then shares ``seq``'s blocks (Scheduler.fork)
    forks: list[Sequence] = field(default_factory=list)
    # speculative decoding: the proposed tokens this step computes after the sequence's last
    # token, each sampled a row of its own (engine/speculative/verify.py); after the step, how
    # many of them the target rejected (their keys and values are not kept)
    drafts: list[int] = field(default_factory=list)
    rejected: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence and so samples its next token."""
        return self.seq.num_computed + self.num_new - len(self.drafts) == self.seq.num_tokens

    @property
    def num_rows(self) -> int:
        """Rows it samples: one (a row per draft more), one per fork, or none mid-prompt."""
        return (1 + len(self.drafts)) * self.samples + len(self.forks)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    # block copies the step makes before it computes: (device, host) out, (host, device) in
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # keys and values computed elsewhere to write before the step: (blocks, their index among
    # the transferred ones, the transferred per-rank arrays)
    kv_import: list[tuple[list[int], int, object]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    @property
    def num_forks(self) -> int:
        """Forks seated this step: one sampled row each, counted against the token budget."""
        return sum(len(s.forks) for s in self.scheduled)

    @property
    def num_rows(self) -> int:
        """Rows the step samples: one per scheduled sequence that reaches its end (and one per
        draft it verifies), one per fork."""
        return sum(s.num_rows for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, swap: SwapSpace | None = None,
                 long_prefill_token_threshold: int = 0) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        # the most tokens one sequence computes in a step while budget is wanted elsewhere;
        # 0: no cap (and none without chunked prefill: a prompt is then computed whole)
        self.long_prefill_token_threshold = (long_prefill_token_threshold or 0) if chunked_prefill else 0
        self.swap = swap
        # a proposer with a model of its own (draft, MTP) keeps keys and values in the same blocks:
        # a block joins the prefix cache once both have computed it (Sequence.proposer_computed)
        self.proposer_kv = False
        self.waiting: list[Sequence] = []  # by arrival
        self.running: list[Sequence] = []
        self.num_swapped_out = 0
        self.num_recomputed = 0
        # during ``schedule``: forks seated so far, and the free blocks promised to them
        self._seated = self._reserved = 0

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
        limit = self.long_prefill_token_threshold
        # forks seated this step, and the free blocks promised to them for their copies of the
        # prompt's last block (taken in ``fork``, once the step is recorded)
        self._seated = self._reserved = 0

        queue = deque(sorted(self.running, key=_by_arrival))
        kept: list[Sequence] = []
        held: list[Sequence] = []  # running, past the threshold, behind an older one: leftover only
        fewest = 1 << 62  # tokens left to the older sequences past the threshold scheduled so far
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
            remaining = len(seq.prompt_token_ids) + len(outputs) - seq.num_computed
            if limit and remaining > limit:
                if remaining >= fewest:  # an older one would finish first: it goes first
                    held.append(seq)
                    kept.append(seq)
                    continue
                num_new = min(limit, budget)
            else:
                num_new = min(remaining, budget)
            target = seq.num_computed + num_new
            if target > len(seq.block_table) * block_size:  # most decode steps fit the last block
                need = self.pool.blocks_needed(seq, target)
                while need > self.pool.num_free - self._reserved and queue:
                    self._preempt(queue.pop(), out)
                if need > self.pool.num_free - self._reserved:
                    self._preempt(seq, out)
                    continue
                self.pool.grow(seq, target)
            s = ScheduledSeq(seq, num_new)
            if seq.draft_token_ids and remaining == 1:
                self._add_drafts(s, budget - 1 - len(queue))
            scheduled.append(s)
            kept.append(seq)
            budget -= s.num_new
            if limit and remaining > limit:
                fewest = remaining
            if seq.forks and num_new == remaining:  # the end of its prompt: seat its forks
                budget = self._seat_forks(s, budget, len(self.running) - len(out.preempted))
        kept.extend(queue)  # over budget this step; they stay running and go first next step
        self.running = kept
        for seq in out.preempted:
            self.add(seq)

        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) + self._seated < self.max_num_seqs):
            seq = self.waiting[0]
            num_new = self._admit(seq, budget, out)
            if num_new is None:
                break
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            s = ScheduledSeq(seq, num_new)
            out.scheduled.append(s)
            budget -= num_new
            if seq.forks and s.samples:
                budget = self._seat_forks(s, budget, len(self.running))

        if limit and budget > 0:
            budget = self._give_back(out, budget, held)
        return out

    def _add_drafts(self, s: ScheduledSeq, spare: int) -> None:
        """Let a decoding sequence verify its proposed tokens this step, as many as ``spare``
        tokens of budget allow (what is left once every running sequence still to be
        scheduled has its one token) and free blocks hold: drafts never preempt."""
        seq = s.seq
        target = seq.num_computed + s.num_new
        room = (len(seq.block_table) + self.pool.num_free - self._reserved) * self.pool.block_size - target
        k = min(len(seq.draft_token_ids), spare, room)
        if k > 0:
            self.pool.grow(seq, target + k)
            s.drafts = seq.draft_token_ids[:k]
            s.num_new += k

    def _give_back(self, out: SchedulerOutput, budget: int, held: list[Sequence]) -> int:
        """Budget admission left unused goes to the sequences the threshold held back (capped,
        or left out behind an older one), oldest first, each as far as the free blocks allow.
        Returns the budget left."""
        block_size = self.pool.block_size
        candidates = [s for s in out.scheduled if not s.samples] + [ScheduledSeq(seq, 0) for seq in held]
        for s in sorted(candidates, key=_by_seq_arrival):
            seq = s.seq
            start = seq.num_computed + s.num_new
            room = (len(seq.block_table) + self.pool.num_free - self._reserved) * block_size - start
            extra = min(seq.num_tokens - start, budget, room)
            if extra <= 0:
                continue
            self.pool.grow(seq, start + extra)
            if not s.num_new:
                out.scheduled.append(s)
            s.num_new += extra
            budget -= extra
            if seq.forks and s.samples:
                budget = self._seat_forks(s, budget, len(self.running))
            if not budget:
                break
        return budget

    def _seat_forks(self, s: ScheduledSeq, budget: int, num_running: int) -> int:
        """Seat the waiting forks of ``s.seq``, whose step computes the end of its prompt, in
        order, while each finds a seat (``num_running`` sequences run, besides the forks seated
        this step), a token of budget for its sampled row and, where the prompt ends inside a
        block, a free block for its copy of that block. Returns the budget left."""
        seq = s.seq
        partial = seq.num_tokens % self.pool.block_size != 0
        for child in seq.forks:
            if (num_running + self._seated >= self.max_num_seqs or budget < 1
                    or (partial and self.pool.num_free - self._reserved < 1)):
                break
            s.forks.append(child)
            self._seated += 1
            self._reserved += partial
            budget -= 1
        return budget

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Give a waiting sequence its blocks for this step; how many tokens it computes, or
        None (changing nothing) when it does not fit."""
        free = self.pool.num_free - self._reserved
        if seq.status is Status.SWAPPED:
            num_new = self._fit(seq.num_tokens - seq.num_computed, budget)
            if num_new is None or self.pool.blocks_needed(seq, seq.num_computed + num_new) > free:
                return None
            device = self.pool.take_blocks(len(seq.host_blocks))
            out.swap_in.extend(zip(seq.host_blocks, device))
            self.swap.release(seq.host_blocks)
            seq.host_blocks, seq.block_table = [], device
            self.pool.grow(seq, seq.num_computed + num_new)
            return num_new

        if seq.kv_import is not None:
            return self._admit_transferred(seq, budget, out)
        hits = self.pool.match(seq)
        if seq.owes_prompt_logprobs:
            # a cached position is not computed, so it gives no logits to score the next prompt
            # token with: cached blocks only as far as the scores already taken (none at first, as
            # in vLLM; after a preemption by recompute, those it scored before)
            hits = hits[: (seq.prompt_scored - 1) // self.pool.block_size]
        cached = len(hits) * self.pool.block_size
        num_new = self._fit(seq.num_tokens - cached, budget)
        if num_new is None or not self.pool.can_admit(seq, hits, cached + num_new, reserve=self._reserved):
            return None
        self.pool.admit(seq, hits, cached + num_new)
        self.pool.record_lookup(seq.num_tokens, cached)
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = cached
        return num_new

    def _admit_transferred(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Admit a sequence whose prompt was computed on another instance (its first token
        sampled there): it takes blocks for all its tokens, the transferred keys and values go
        into those the prefix cache does not already hold, and it computes only its last token."""
        if budget < 1:
            return None
        hits = self.pool.match(seq)
        if not self.pool.can_admit(seq, hits, seq.num_tokens, reserve=self._reserved):
            return None
        self.pool.admit(seq, hits, seq.num_tokens)
        prompt = len(seq.prompt_token_ids)
        blocks = -(-prompt // self.pool.block_size)
        if blocks > len(hits):
            out.kv_import.append((seq.block_table[len(hits):blocks], len(hits), seq.kv_import))
        seq.kv_import = None
        seq.num_computed = seq.proposer_computed = prompt
        return 1

    def _fit(self, remaining: int, budget: int) -> int | None:
        if not self.chunked_prefill:
            return remaining if remaining <= budget else None
        limit = self.long_prefill_token_threshold
        return min(remaining, budget, limit) if limit else min(remaining, budget)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        host = self.swap.take(len(seq.block_table)) if self.swap is not None else None
        if host is not None:
            # the copies run before this step computes, so the freed blocks may be reused in it
            out.swap_out.extend(zip(seq.block_table, host))
            seq.host_blocks = host
            seq.status = Status.SWAPPED
            self.num_swapped_out += 1
        else:
            seq.num_computed = seq.proposer_computed = 0
            seq.status = Status.WAITING
            self.num_recomputed += 1
        seq.draft_token_ids = []
        self.pool.free(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)

    def reserve_ahead(self, out: SchedulerOutput, steps: int) -> bool:
        """Give each scheduled sequence the blocks for ``steps`` more tokens than the step
        computes (a round of decode steps, engine/rounds.py), if the free blocks hold them
        all; else change nothing. Never preempts."""
        targets = [(s.seq, s.seq.num_computed + s.num_new + steps - 1) for s in out.scheduled]
        need = sum(self.pool.blocks_needed(seq, target) for seq, target in targets)
        if need > self.pool.num_free - self._reserved:
            return False
        for seq, target in targets:
            self.pool.grow(seq, target)
        return True

    def advance(self, out: SchedulerOutput, steps: int = 1) -> None:
        """Record that the step ran (``steps``: as a round of that many device steps, one token
        a sequence each): its tokens are computed (less the drafts it rejected), full blocks
        join the prefix cache. A round's later tokens are still placeholders on the host, so
        the blocks holding them join at a later step's ``advance``, once they are read."""
        ahead = steps - 1
        for s in out.scheduled:
            seq = s.seq
            if seq.status is Status.FINISHED:  # ended on the previous step's token while this one ran
                continue
            seq.num_computed += s.num_new - s.rejected + ahead
            self._publish(seq, self._computed(seq) - ahead)

    def _computed(self, seq: Sequence) -> int:
        """Leading tokens whose keys and values are in the cache (the proposer's layers too,
        where it keeps its own)."""
        return min(seq.num_computed, seq.proposer_computed) if self.proposer_kv else seq.num_computed

    def _publish(self, seq: Sequence, computed: int) -> None:
        """Offer ``seq``'s full blocks within its first ``computed`` tokens to the prefix cache."""
        if self.pool.enable_caching and computed // self.pool.block_size > seq.num_committed_blocks:
            self.pool.commit(seq, computed)

    def roll_back(self, seq: Sequence) -> None:
        """After a step that rejected some of ``seq``'s drafts: release the blocks that held
        only rejected tokens' slots (no token of the sequence lies in them)."""
        self.pool.shrink(seq, seq.num_tokens)

    # -- forks and endings -----------------------------------------------------------------

    def fork(self, s: ScheduledSeq) -> list[tuple[int, int]]:
        """After the step that computed the end of ``s.seq``'s prompt (``advance`` first): the
        forks that step seated (``s.forks``, which sampled from its row) share the prompt's
        blocks and run; the others are detached and queue as ordinary sequences, to compute
        the prompt themselves (mostly from the prefix cache). Returns the block copies to make
        now."""
        parent = s.seq
        seated = {id(child) for child in s.forks}
        copies: list[tuple[int, int]] = []
        for child in parent.forks:
            child.fork_of = None
            child.num_cached_tokens = parent.num_cached_tokens
            if id(child) not in seated:
                self.add(child)
                continue
            made = self.pool.fork(parent, child)
            if made is None:  # its block was promised when the step was scheduled
                raise RuntimeError("no block for a seated fork's copy; this is a bug in fd")
            copies.extend(made)
            # the copied block may hold the parent's first token in the proposer's layers: not the child's
            child.proposer_computed = min(parent.proposer_computed, parent.num_computed)
            child.status = Status.RUNNING
            self.running.append(child)
        parent.forks = []
        return copies

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out of scheduling (finished or aborted), releasing all it holds. Its
        output must hold only tokens read (no placeholder): blocks a round filled after its
        first step, left out of the prefix cache by ``advance``, join it now as far as computed."""
        if seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER:
            raise RuntimeError("a sequence finished with a token still in flight; this is a bug in fd")
        self._publish(seq, min(self._computed(seq), seq.num_tokens - 1))
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
