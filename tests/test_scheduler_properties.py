"""Property-based tests of the scheduler's limits (``fd_core.engine.scheduler``).

Hypothesis draws an engine configuration (block size and count, ``max_num_seqs``, the token
budget, ``long_prefill_token_threshold``, chunked prefill, prefix caching, swap space) and a
workload (requests with ``n`` outputs, arriving between steps, some aborted), and drives the
real scheduler and block pool the way ``EngineCore`` does — schedule, build the step's rows with
the real ``prepare_inputs``, record the step, fork, append the sampled tokens, finish — checking
after every schedule what no step may do:

- compute more tokens, plus one per fork it seats (each samples a row), than the budget;
- run more than ``max_num_seqs`` sequences, counting the forks it seats, or sample more rows;
- give a sequence more than the threshold, unless the budget it takes was left over once
  admission had stopped for another reason (no one waiting, every seat taken, a preemption,
  no free blocks for the next waiting sequence) — checked at the moment the scheduler hands
  that budget back, and never without it;
- schedule anything of an aborted request;

and that every request ends with its tokens, every block back in the pool.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fd_core.engine.block_pool import BlockPool
from fd_core.engine.model_runner import prepare_inputs
from fd_core.engine.sampling_params import SamplingParams
from fd_core.engine.scheduler import Scheduler, SchedulerOutput
from fd_core.engine.sequence import Sequence, Status
from fd_core.engine.swap import SwapSpace

PREFIXES = ((1, 2, 1, 2, 1, 2, 1, 2, 1, 2), (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
MAX_PROMPT = 40
MAX_OUTPUT = 5


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Config:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    budget: int
    threshold: int
    chunked: bool
    caching: bool
    swap_blocks: int


@st.composite
def configs(draw) -> Config:
    bs = draw(st.sampled_from([1, 2, 4]), label="block_size")
    chunked = draw(st.booleans(), label="chunked")
    # without chunked prefill the engine's budget holds any sequence whole
    budget = draw(st.integers(1, 64) if chunked else st.integers(MAX_PROMPT + MAX_OUTPUT, 96), label="budget")
    threshold = draw(st.one_of(st.just(0), st.integers(1, 8), st.integers(1, budget + 2)),
                     label="threshold") if chunked else 0
    # room for one longest sequence alone, as the engine checks at start-up
    spare = draw(st.one_of(st.integers(0, 3), st.integers(0, 40)), label="spare_blocks")  # few: preemption
    num_blocks = 1 + ceil_div(MAX_PROMPT + MAX_OUTPUT, bs) + spare
    return Config(bs, num_blocks, draw(st.integers(1, 8), label="max_num_seqs"), budget, threshold, chunked,
                  draw(st.booleans(), label="caching"), draw(st.sampled_from([0, 0, 4, 64]), label="swap_blocks"))


@st.composite
def requests(draw):
    prefix = draw(st.sampled_from(((),) + PREFIXES), label="prefix")
    prefix = prefix[:draw(st.integers(0, len(prefix)), label="prefix_len")]
    size = draw(st.one_of(st.integers(0, 6), st.integers(0, MAX_PROMPT - len(prefix))), label="tail_len")
    tail = draw(st.lists(st.integers(0, 2), min_size=size, max_size=size), label="tail")
    prompt = (list(prefix) + tail) or [0]
    return prompt, draw(st.integers(1, 6), label="n"), draw(st.integers(1, MAX_OUTPUT), label="max_tokens")


ACTIONS = st.one_of(
    st.tuples(st.just("add"), requests()),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.one_of(st.none(), st.integers(0, 5))),
)


class Checked(Scheduler):
    """The scheduler, recording what admission left when it hands budget back
    (``_give_back``): the one place a sequence may exceed the threshold."""

    def _give_back(self, out: SchedulerOutput, budget: int, held: list[Sequence]) -> int:
        # the step as admission left it: each sequence's tokens and forks so far
        shares = {s.seq.seq_id: (s.num_new, len(s.forks)) for s in out.scheduled}
        self.gave_back = (budget, admission_blocked(self, out, budget), shares)
        return super()._give_back(out, budget, held)


def admission_blocked(sched: Checked, out: SchedulerOutput, budget: int) -> str | None:
    """Why admission could take nothing more, seen right after it stopped; None: it could
    have (the budget it left should have gone to the next waiting sequence)."""
    if out.preempted:
        return "preempted"
    if not sched.waiting:
        return "nobody waiting"
    if len(sched.running) + sched._seated >= sched.max_num_seqs:
        return "seats full"
    return "no blocks" if not fits(sched, sched.waiting[0], budget) else None


def fits(sched: Scheduler, seq: Sequence, budget: int) -> bool:
    """Whether ``seq`` could be admitted now with the chunk the policy gives it, computed here
    from the pool's state (not by the scheduler's own admission)."""
    pool, bs, limit = sched.pool, sched.pool.block_size, sched.long_prefill_token_threshold
    free = pool.num_free - sched._reserved
    if seq.status is Status.SWAPPED:
        chunk = min(seq.num_tokens - seq.num_computed, budget, limit or budget)
        return ceil_div(seq.num_computed + chunk, bs) <= free
    hits = pool.match(seq)
    cached = len(hits) * bs
    chunk = min(seq.num_tokens - cached, budget, limit or budget)
    taken_from_free = sum(1 for b in hits if pool.blocks[b].ref_count == 0)
    return max(0, ceil_div(cached + chunk, bs) - len(hits)) + taken_from_free <= free


class Sim:
    """The engine core's loop around the scheduler, without a model: each sampled row appends
    a token; a sequence finishes at ``max_tokens``."""

    def __init__(self, c: Config) -> None:
        self.c = c
        self.pool = BlockPool(c.num_blocks, c.block_size, enable_caching=c.caching)
        self.swap = SwapSpace(c.swap_blocks) if c.swap_blocks else None
        self.sched = Checked(self.pool, c.max_num_seqs, c.budget, c.chunked, self.swap, c.threshold)
        self.requests: list[list[Sequence]] = []
        self.aborted: set[int] = set()  # seq ids
        self.ids = itertools.count()
        self.steps = 0

    def add(self, prompt: list[int], n: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, n=n)
        seqs = [Sequence(seq_id=next(self.ids), request_id=str(len(self.requests)), index=i,
                         prompt_token_ids=prompt, params=params, seed=i, arrival=next(self.ids),
                         max_tokens=max_tokens) for i in range(n)]
        seqs[0].forks = seqs[1:]
        for child in seqs[1:]:
            child.fork_of = seqs[0]
        self.sched.add(seqs[0])
        self.requests.append(seqs)

    def abort(self, which: int, index: int | None) -> None:
        if not self.requests:
            return
        for seq in self.requests[which % len(self.requests)]:
            if (index is None or seq.index == index) and not seq.finished:
                event("abort a not-yet-forked sibling" if seq.fork_of is not None
                      else f"abort a {seq.status.value} sequence")
                self.sched.finish(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                self.aborted.add(seq.seq_id)

    def step(self) -> None:
        sched, c = self.sched, self.c
        running_before = set(map(id, sched.running))
        sched.gave_back = None
        out = sched.schedule()
        self.steps += 1
        if out.preempted:
            event("preempted" + (" by swap" if out.swap_out else ""))
        if not out.scheduled:
            assert out.preempted or not sched.has_work(), "no progress with work to do"
            return
        inputs, sampled = prepare_inputs(out.scheduled, c.block_size)  # the rows the model samples
        tokens, forks = out.num_tokens, out.num_forks
        scheduled_ids = {s.seq.seq_id for s in out.scheduled} | {f.seq_id for s in out.scheduled for f in s.forks}

        # the limits
        assert tokens + forks <= c.budget, f"{tokens} tokens + {forks} fork rows > budget {c.budget}"
        assert len(inputs.input_ids) == tokens
        assert len(sampled) == out.num_rows <= c.max_num_seqs, f"{len(sampled)} rows > {c.max_num_seqs}"
        assert len(sched.running) + forks <= c.max_num_seqs
        assert len({id(s) for s in sampled}) == len(sampled), "a sequence samples twice"
        assert not scheduled_ids & self.aborted, "an aborted sequence was scheduled"
        for s in out.scheduled:
            assert s.num_new >= 1 and s.seq.num_computed + s.num_new <= s.seq.num_tokens
            assert len(s.seq.block_table) * c.block_size >= s.seq.num_computed + s.num_new
            if s.forks:
                assert s.samples and s.forks == s.seq.forks[:len(s.forks)], "forks seated out of order"
        if not c.chunked:
            assert all(s.samples for s in out.scheduled), "a prompt split without chunked prefill"

        # the threshold
        limit = c.threshold
        over = [s for s in out.scheduled if limit and s.num_new > limit]
        if over:
            event("a sequence took leftover budget past the threshold")
            assert sched.gave_back is not None, "past the threshold without leftover budget"
            left, blocked, shares = sched.gave_back
            assert all(n <= limit for n, _ in shares.values()), "past the threshold before the hand-back"
            expected = c.budget - sum(n + f for n, f in shares.values())
            assert left == expected, f"handed back {left}, admission left {expected}"
            assert blocked is not None, "budget handed back while the next waiting sequence fit"
            event(f"admission stopped: {blocked}")
            new = {s.seq.seq_id: s.num_new for s in out.scheduled}
            for s in over:  # leftover goes oldest first: an older one left short had filled its blocks
                for seq in sched.running:
                    if seq.arrival < s.seq.arrival and seq.num_computed + new.get(seq.seq_id, 0) < seq.num_tokens:
                        assert seq.num_computed + new.get(seq.seq_id, 0) == len(seq.block_table) * c.block_size
        for s in out.scheduled:
            if not s.samples and (not limit or s.num_new < limit) and tokens + forks < c.budget:
                # only leftover budget, cut short by the free blocks
                assert s.seq.num_computed + s.num_new == len(s.seq.block_table) * c.block_size, (
                    "a chunk cut short with budget to spare")
                assert self.pool.num_free - sched._reserved == 0
        # a running sequence with work is left out only when the budget ran out, or when it is
        # past the threshold behind an older one, prefilling past it too, with no more tokens left
        left = {s.seq.seq_id: s.seq.num_tokens - s.seq.num_computed for s in out.scheduled}
        for seq in sched.running:
            if id(seq) not in running_before or seq.seq_id in left:
                continue
            if tokens + forks < c.budget:
                mine = seq.num_tokens - seq.num_computed
                assert limit and mine > limit, "a running sequence left out with budget to spare"
                assert any(o.seq.arrival < seq.arrival and limit < left[o.seq.seq_id] <= mine
                           for o in out.scheduled), "held back behind nobody"
                event("held behind an older prefill")
        if forks:
            event("forks seated")
        if any(s.seq.forks and s.samples and len(s.forks) < len(s.seq.forks) for s in out.scheduled):
            event("forks detached to queue alone")

        # record the step as EngineCore does: advance, fork, then the tokens and finish rules
        parents = [s for s in out.scheduled if s.seq.forks and s.samples]
        sched.advance(out)
        for s in parents:
            copies = sched.fork(s)
            assert len(copies) == (len(s.forks) if s.seq.num_tokens % c.block_size else 0)
        for seq in sampled:
            seq.output_token_ids.append((seq.seed + len(seq.output_token_ids)) % 3)
            if len(seq.output_token_ids) >= seq.max_tokens:
                seq.status, seq.finish_reason = Status.FINISHED, "length"
                sched.finish(seq)
        assert len(sched.running) <= c.max_num_seqs

    def drain(self) -> None:
        limit = 200 + 50 * sum(len(r) for r in self.requests)
        while self.sched.has_work():
            self.step()
            assert self.steps < limit, "the engine does not finish"


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=configs(), first=st.lists(requests(), min_size=1, max_size=8), actions=st.lists(ACTIONS, max_size=30))
def test_no_step_exceeds_the_limits(c: Config, first, actions) -> None:
    sim = Sim(c)
    for request in first:
        sim.add(*request)
    for action in actions:
        if action[0] == "add":
            sim.add(*action[1])
        elif action[0] == "step":
            for _ in range(action[1]):
                if sim.sched.has_work():
                    sim.step()
        else:
            sim.abort(action[1], action[2])
    sim.drain()
    for seqs in sim.requests:
        for seq in seqs:
            assert seq.finished
            if seq.seq_id not in sim.aborted:
                assert len(seq.output_token_ids) == seq.max_tokens
    assert sim.pool.num_free == sim.pool.capacity, "a block leaked"
    assert sim.swap is None or sim.swap.num_free == sim.swap.num_blocks
    assert not sim.sched.waiting and not sim.sched.running
