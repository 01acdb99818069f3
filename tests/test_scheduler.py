"""The runtime-free parts of the engine: block pool, scheduler, sampling parameters."""

from __future__ import annotations

import pytest

from fd_core import SamplingParams
from fd_core.engine.block_pool import BlockPool
from fd_core.engine.scheduler import Scheduler
from fd_core.engine.sequence import Sequence, Status
from fd_core.engine.swap import SwapSpace
from fd_core.errors import InvalidRequestError


def make_seq(i: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), index=0, prompt_token_ids=list(range(prompt_len)),
                    params=SamplingParams(max_tokens=max_tokens), seed=i, arrival=i, max_tokens=max_tokens)


def run_step(sched: Scheduler, finished_after: int | None = None):
    """Simulate the engine: compute what was scheduled, sample for rows that reach the end."""
    out = sched.schedule()
    sampling = [s.seq for s in out.scheduled if s.samples]
    sched.advance(out)
    for seq in sampling:
        seq.output_token_ids.append(7)
        if len(seq.output_token_ids) >= seq.max_tokens:
            sched.finish(seq)
            seq.status = seq.status.FINISHED
    return out


def test_block_pool_accounting():
    pool = BlockPool(num_blocks=9, block_size=4)
    a, b = make_seq(0, 5), make_seq(1, 3)
    assert pool.blocks_needed(a, 5) == 2
    pool.grow(a, 5)
    pool.grow(b, 3)
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    assert 0 not in a.block_table + b.block_table  # block 0 is reserved for padding
    assert len(set(a.block_table + b.block_table)) == 3
    pool.grow(a, 8)  # still fits in 2 blocks
    assert len(a.block_table) == 2
    pool.grow(a, 9)
    assert len(a.block_table) == 3
    pool.free(a)
    pool.free(b)
    assert pool.num_free == pool.capacity == 8


def test_token_budget_and_max_num_seqs_bound_a_step():
    pool = BlockPool(num_blocks=200, block_size=4)
    sched = Scheduler(pool, max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(5):
        sched.add(make_seq(i, 6))
    out = sched.schedule()
    assert out.num_tokens <= 10
    assert [s.num_new for s in out.scheduled] == [6, 4]  # the second prompt is chunked
    assert not out.scheduled[1].samples and out.scheduled[0].samples
    for _ in range(50):
        out = run_step(sched)
        assert out.num_tokens <= 10 and len(sched.running) <= 3
        if not sched.has_work():
            break
    assert not sched.has_work() and pool.num_free == pool.capacity


def test_no_chunking_waits_for_room():
    pool = BlockPool(num_blocks=200, block_size=4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=10, chunked_prefill=False)
    sched.add(make_seq(0, 6))
    sched.add(make_seq(1, 6))
    out = sched.schedule()
    assert [s.num_new for s in out.scheduled] == [6]


def test_preemption_frees_newest_and_recomputes():
    # 6 usable blocks of 4 slots: two sequences of 8 prompt tokens + 8 new ones cannot both fit
    pool = BlockPool(num_blocks=7, block_size=4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq(0, 8, max_tokens=8), make_seq(1, 8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    preempted = 0
    for _ in range(100):
        out = run_step(sched)
        preempted += len(out.preempted)
        assert all(s.seq is not b or s.seq.num_computed <= s.seq.num_tokens for s in out.scheduled)
        if not sched.has_work():
            break
    assert preempted >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0  # the newest goes first
    assert len(a.output_token_ids) == 8 and len(b.output_token_ids) == 8
    assert pool.num_free == pool.capacity


def test_preemption_by_swap_keeps_progress_and_comes_back_first():
    pool = BlockPool(num_blocks=7, block_size=4)
    swap = SwapSpace(num_blocks=8)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, swap=swap)
    a, b, c = make_seq(0, 8, max_tokens=8), make_seq(1, 8, max_tokens=8), make_seq(2, 4, max_tokens=2)
    for seq in (a, b, c):
        sched.add(seq)
    swapped_out = swapped_in = 0
    for _ in range(100):
        out = run_step(sched)
        for seq in out.preempted:
            assert seq.status is Status.SWAPPED and seq.num_computed > 0  # nothing to recompute
            assert len(seq.host_blocks) == -(-seq.num_computed // 4)
        swapped_out += len(out.swap_out)
        swapped_in += len(out.swap_in)
        assert not (out.swap_out and out.swap_in)  # never both in one step: no block is read after reuse
        if not sched.has_work():
            break
    assert swapped_out > 0 and swapped_in == swapped_out
    assert sched.num_recomputed == 0 and sched.num_swapped_out > 0
    assert all(len(s.output_token_ids) == s.max_tokens for s in (a, b, c))
    assert pool.num_free == pool.capacity and swap.num_free == swap.num_blocks


def test_admission_matches_the_prefix_cache_and_computes_the_rest():
    pool = BlockPool(num_blocks=32, block_size=4, enable_caching=True)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    first = make_seq(0, 14, max_tokens=1)
    sched.add(first)
    run_step(sched)  # computes 14 tokens: 3 full blocks published, then finishes
    assert first.finished and pool.num_cached == 3
    second = Sequence(seq_id=1, request_id="1", index=0, prompt_token_ids=list(range(13)) + [99],
                      params=SamplingParams(max_tokens=1), seed=1, arrival=1, max_tokens=1)
    sched.add(second)
    out = sched.schedule()
    assert [s.num_new for s in out.scheduled] == [14 - 12]  # 12 tokens came from the cache
    assert second.num_cached_tokens == 12 and pool.hit_tokens == 12 and pool.queried_tokens == 14 + 14


def test_admission_is_first_come_first_served():
    pool = BlockPool(num_blocks=200, block_size=4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=10, chunked_prefill=False)
    sched.add(make_seq(0, 4))
    sched.add(make_seq(1, 9))  # does not fit what the first leaves
    sched.add(make_seq(2, 2))  # would fit, but must not overtake
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0]


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"temperature": -0.1}, "temperature must be"),
    ({"n": 0}, "n must be at least 1"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"stop": [""]}, "stop must be"),
    ({"logprobs": 50}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"temperature": "hot"}, "temperature must be a number"),
])
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop_strings == ("###",) and p.top_k == 0 and p.greedy


@pytest.mark.parametrize("start, end", [(0, 3), (2, 7), (5, 6), (6, 9), (0, 9), (8, 20)])
def test_tokens_between_is_a_slice_of_tokens(start, end):
    seq = make_seq(0, 6)
    seq.output_token_ids = [100, 101, 102]
    assert seq.tokens_between(start, end) == seq.tokens[start:end]
