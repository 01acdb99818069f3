"""The runtime-free parts of the engine: block pool, scheduler, sampling parameters."""

from __future__ import annotations

import pytest

from fd_core import SamplingParams
from fd_core.engine.block_pool import BlockPool
from fd_core.engine.model_runner import prepare_inputs
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


def engine_step(sched: Scheduler, block_size: int):
    """One step as EngineCore runs it: schedule, the rows the model samples (the real
    ``prepare_inputs``), record the step, fork, then the tokens and the ``max_tokens`` rule."""
    out = sched.schedule()
    _, sampled = prepare_inputs(out.scheduled, block_size) if out.scheduled else (None, [])
    parents = [s for s in out.scheduled if s.seq.forks and s.samples]
    sched.advance(out)
    for s in parents:
        sched.fork(s)
    for seq in sampled:
        seq.output_token_ids.append(7)
        if len(seq.output_token_ids) >= seq.max_tokens:
            sched.finish(seq)
            seq.status = Status.FINISHED
    return out, sampled


def request(first_id: int, prompt: list[int], n: int, max_tokens: int) -> list[Sequence]:
    """The ``n`` sequences of one request, as EngineCore.add_request makes them."""
    seqs = [Sequence(seq_id=first_id + i, request_id=str(first_id), index=i, prompt_token_ids=prompt,
                     params=SamplingParams(max_tokens=max_tokens, n=n), seed=i, arrival=first_id + i,
                     max_tokens=max_tokens) for i in range(n)]
    seqs[0].forks = seqs[1:]
    for child in seqs[1:]:
        child.fork_of = seqs[0]
    return seqs


def test_forks_are_seated_within_max_num_seqs_and_the_budget():
    """Issue 14: 64 prompts x n=128 with max_tokens=1 once sampled all 8,192 forks in the step
    that completed the prompts. Every step now samples at most max_num_seqs rows and computes
    at most the budget, counting a row per fork; every output still comes out."""
    pool = BlockPool(num_blocks=200, block_size=16, enable_caching=True)
    sched = Scheduler(pool, max_num_seqs=64, max_num_batched_tokens=256)
    requests = [request(i * 128, [1, 2, 3], n=128, max_tokens=1) for i in range(64)]
    for seqs in requests:
        sched.add(seqs[0])
    steps = 0
    while sched.has_work():
        out, sampled = engine_step(sched, 16)
        steps += 1
        assert len(sampled) <= 64 and out.num_tokens + out.num_forks <= 256
        assert steps <= 200
    assert all(len(seq.output_token_ids) == 1 for seqs in requests for seq in seqs)
    assert pool.num_free == pool.capacity
    # the first step: the first request's prompt and 63 of its forks (they arrived before the
    # second request); the other 65 forks queue and compute the prompt themselves
    assert steps == 1 + (64 * 128 - 64) // 64


def test_forks_without_a_seat_compute_the_prompt_from_the_prefix_cache():
    pool = BlockPool(num_blocks=64, block_size=4, enable_caching=True)
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=64)
    parent, a, b = request(0, list(range(10)), n=3, max_tokens=3)
    sched.add(parent)
    out = sched.schedule()
    assert [(s.seq, s.num_new, s.forks) for s in out.scheduled] == [(parent, 10, [a])]  # one seat left
    sched.advance(out)
    assert sched.fork(out.scheduled[0]) == [(parent.block_table[2], a.block_table[2])]  # the partial block
    assert a.block_table[:2] == parent.block_table[:2] and a in sched.running
    assert b in sched.waiting and b.fork_of is None and b.output_token_ids == []  # detached, unsampled
    for seq in (parent, a):
        seq.output_token_ids.append(7)
    for seq in (parent, a):  # they finish; b comes in, mostly from the cache
        sched.finish(seq)
    out = sched.schedule()
    assert [(s.seq, s.num_new) for s in out.scheduled] == [(b, 10 - 8)] and b.num_computed == 8


def test_fork_copies_need_a_free_block_each():
    # 3 usable blocks: the parent's prompt takes 2 (the second partly filled), one is left
    pool = BlockPool(num_blocks=4, block_size=4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    parent, a, b = request(0, list(range(6)), n=3, max_tokens=2)
    sched.add(parent)
    out = sched.schedule()
    assert out.scheduled[0].forks == [a] and out.num_forks == 1
    sched.advance(out)
    sched.fork(out.scheduled[0])
    assert pool.num_free == 0 and b in sched.waiting


def long_and_short(threshold: int, arrive_after: int = 1, short_len: int = 10):
    """A 4,486-token prompt, then a short one ``arrive_after`` steps later, at the CPU budget:
    the steps until the short one's first token, and the long one's chunk per step."""
    pool = BlockPool(num_blocks=400, block_size=16, enable_caching=True)
    sched = Scheduler(pool, max_num_seqs=64, max_num_batched_tokens=256, long_prefill_token_threshold=threshold)
    long = Sequence(seq_id=0, request_id="long", index=0, prompt_token_ids=[5] * 4486,
                    params=SamplingParams(max_tokens=1), seed=0, arrival=0, max_tokens=1)
    short = Sequence(seq_id=1, request_id="short", index=0, prompt_token_ids=list(range(short_len)),
                     params=SamplingParams(max_tokens=4), seed=1, arrival=1, max_tokens=4)
    sched.add(long)
    chunks, waited = [], None
    for step in range(100):
        if step == arrive_after:
            sched.add(short)
        out, _ = engine_step(sched, 16)
        chunks += [s.num_new for s in out.scheduled if s.seq is long]
        if waited is None and short.output_token_ids:
            waited = step + 1 - arrive_after
        if not sched.has_work():
            break
    return waited, chunks


def test_a_short_request_behind_a_long_prompt_starts_at_once():
    """Issue 14: a prefilling prompt took the whole budget until it was done, so a request
    behind it waited for all of it (17 steps here; 128.7 s on the CPU)."""
    waited, chunks = long_and_short(threshold=64)
    assert waited == 1  # admitted in the first step after it arrived, and sampled there
    assert chunks[:3] == [256, 256 - 10, 256 - 1]  # the rest of the budget goes back to the long prompt
    assert sum(chunks) == 4486 and len(chunks) == -(-(4486 + 10 + 3) // 256)  # every step full
    alone = long_and_short(threshold=64, arrive_after=1000)[1]
    assert alone == long_and_short(threshold=0, arrive_after=1000)[1]  # no loss when it is alone
    assert set(alone[:-1]) == {256}
    # a prompt longer than the cap prefills at the cap beside the older one, which gets the rest
    waited, chunks = long_and_short(threshold=64, short_len=300)
    assert waited == 5 and chunks[1:6] == [192, 192, 192, 192, 256 - 44]
    # without the cap the request waits for the whole prompt
    assert long_and_short(threshold=0)[0] == 17


def test_the_threshold_shares_the_budget_among_prompts_oldest_first():
    pool = BlockPool(num_blocks=400, block_size=16)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=256, long_prefill_token_threshold=64)
    a, b, c = (make_seq(i, 1000) for i in range(3))
    for seq in (a, b, c):
        sched.add(seq)

    def step():
        out, _ = engine_step(sched, 16)
        return [(s.seq.seq_id, s.num_new) for s in out.scheduled]

    assert step() == [(0, 128), (1, 64), (2, 64)]  # admitted at 64 each; the 64 left go to the oldest
    # running: a takes its 64; b and c, with no fewer tokens left than a, wait for leftovers;
    # d comes in; what is left goes to a, the oldest
    sched.add(make_seq(3, 20))
    assert step() == [(0, 64 + 172), (3, 20)]
    # e, shorter than a, keeps its share beside it once running
    sched.add(make_seq(4, 200))
    assert step() == [(0, 64 + 127), (3, 1), (4, 64)]
    assert step() == [(0, 64 + 127), (3, 1), (4, 64)]
    assert step() == [(0, 64 + 127), (3, 1), (4, 64)]
    # a ends its prompt; b, the oldest still prefilling, takes the share and what is left
    assert step() == [(0, 63), (1, 64 + 120), (3, 1), (4, 8)]
    # the prompts finish in arrival order, a short one never waits behind them
    done = {}
    for n in range(200):
        if n == 3:
            sched.add(make_seq(5, 10, max_tokens=1))
        _, sampled = engine_step(sched, 16)
        for seq in sampled:
            done.setdefault(seq.seq_id, n)
        if not sched.has_work():
            break
    assert done[5] == 3 and done[0] < done[1] < done[2]


def test_without_chunked_prefill_there_is_no_cap():
    pool = BlockPool(num_blocks=200, block_size=4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=512, chunked_prefill=False,
                      long_prefill_token_threshold=64)
    sched.add(make_seq(0, 300))
    assert [s.num_new for s in sched.schedule().scheduled] == [300]


def test_long_prefill_token_threshold_config():
    from fd_core.engine.config import EngineConfig
    from fd_core.errors import ConfigError
    from fd_core.interfaces import Capabilities

    with pytest.raises(ConfigError, match="long_prefill_token_threshold must be an integer >= 0"):
        EngineConfig(model="m", long_prefill_token_threshold=-1).validate()
    with pytest.raises(ConfigError, match="--long-prefill-token-threshold caps a prompt's chunks, but chunked prefill is off"):
        EngineConfig(model="m", long_prefill_token_threshold=64, enable_chunked_prefill=False).check_against(
            "toy", Capabilities(chunked_prefill=True))
    with pytest.raises(ConfigError, match="the toy backend does not support chunked prefill"):
        EngineConfig(model="m", long_prefill_token_threshold=64).check_against("toy", Capabilities())
    for given, chunked, platform, resolved in [(None, True, 64, 64), (None, True, None, 0), (0, True, 64, 0),
                                               (100, True, 64, 100), (None, False, 64, 0)]:
        config = EngineConfig(model="m", long_prefill_token_threshold=given, enable_chunked_prefill=chunked)
        config.check_against("toy", Capabilities(chunked_prefill=True))
        config.resolve_budget(4096, 256, platform)
        assert config.long_prefill_token_threshold == resolved


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, r"max_tokens must be an integer in \[1, "),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"temperature": -0.1}, "temperature must be"),
    ({"n": 0}, r"n must be an integer in \[1, 128\]"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"stop": [""]}, "stop must be"),
    ({"logprobs": -1}, "logprobs"),  # the upper bound is the engine's --max-logprobs (test_vllm_cli)
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


def test_drafts_take_spare_budget_and_free_blocks_only():
    """A decoding sequence's drafts (speculative decoding) join its step as far as the budget
    leaves a token for every running sequence behind it and free blocks hold them: they never
    preempt. Rejected drafts' blocks go back (roll_back); a proposer that keeps keys and values
    in the blocks holds back their publication until it has computed them."""
    pool = BlockPool(num_blocks=7, block_size=4, enable_caching=True)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=6)
    a, b, c = make_seq(0, 4, max_tokens=20), make_seq(1, 4, max_tokens=20), make_seq(2, 4, max_tokens=20)
    for seq in (a, b, c):
        sched.add(seq)
    run_step(sched)  # a and b prefill (budget 6: a whole, b 2 tokens)
    run_step(sched)  # a decodes, b finishes its prompt, c starts
    assert a.num_computed == 5 and b.num_computed == 4
    a.draft_token_ids = [11, 12, 13, 14, 15]
    out = sched.schedule()
    s = out.scheduled[0]
    # budget 6, two running sequences behind a: a takes 1 + 3 drafts, leaving one token each
    assert s.seq is a and s.drafts == [11, 12, 13] and s.num_new == 4 and s.samples and s.num_rows == 4
    assert [x.num_new for x in out.scheduled[1:]] == [1, 1] and out.num_rows == 6
    assert len(a.block_table) == 3  # positions 5..8: a third block
    s.rejected = 2  # the step accepted one draft: a's last token, 11, then the bonus
    sched.advance(out)
    a.output_token_ids += [11, 16]
    assert a.num_computed == 7 and a.num_tokens == 8
    sched.roll_back(a)
    assert len(a.block_table) == 2  # slots 8.. held rejected drafts only
    assert a.num_committed_blocks == 1  # the first block; the second is not full of computed tokens
    # free blocks only: with none free, drafts are dropped (a's own token fits its last block)
    for seq in (b, c):
        sched.finish(seq)
    taken = pool.take_blocks(pool.num_free)
    a.draft_token_ids = [1, 2]
    out = sched.schedule()
    assert not out.preempted and out.scheduled[0].drafts == [] and out.scheduled[0].num_new == 1
    assert len(taken) == 4  # 6 usable blocks, a holds 2


def test_a_proposer_with_its_own_cache_holds_back_publication():
    pool = BlockPool(num_blocks=8, block_size=4, enable_caching=True)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    sched.proposer_kv = True
    a = make_seq(0, 9)
    sched.add(a)
    out = sched.schedule()
    a.proposer_computed = 5  # its proposer has computed one block's worth
    sched.advance(out)
    assert a.num_computed == 9 and a.num_committed_blocks == 1
    a.proposer_computed = 9
    out = sched.schedule()
    a.output_token_ids.append(3)
    sched.advance(out)
    assert a.num_committed_blocks == 2
    # a sequence admitted on the cached blocks takes its proposer's part of them too
    b = make_seq(1, 12)
    sched.add(b)
    sched.schedule()
    assert b.num_computed == b.proposer_computed == 8
