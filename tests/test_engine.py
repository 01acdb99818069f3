"""Engine behaviour on a tiny random-weight Llama: scheduling choices never change outputs."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine import detokenizer  # noqa: E402
from tests import checkpoints  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("engine"))


def prompts(n: int, vocab: int = 400) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, vocab, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


def run(model_dir, params, **engine_args):
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, **engine_args)
    outs = llm.generate(prompts(16), params, use_tqdm=False)
    pool = llm.engine.pool
    assert pool.num_free == pool.capacity
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_preemption_and_chunking_do_not_change_outputs(model_dir, params):
    reference, stats = run(model_dir, params, num_kv_blocks=512)
    assert stats["preemptions"] == 0
    # room for about four sequences at a time: the scheduler must preempt and recompute
    tight, stats = run(model_dir, params, num_kv_blocks=4 * 15 + 1)
    assert stats["preemptions"] > 0
    assert tight == reference
    chunked, _ = run(model_dir, params, num_kv_blocks=512, max_num_batched_tokens=7)
    assert chunked == reference
    capped, _ = run(model_dir, params, num_kv_blocks=512, max_num_batched_tokens=24, long_prefill_token_threshold=4)
    assert capped == reference
    capped_tight, _ = run(model_dir, params, num_kv_blocks=4 * 15 + 1, long_prefill_token_threshold=8)
    assert capped_tight == reference
    unchunked, _ = run(model_dir, params, num_kv_blocks=512, max_num_batched_tokens=64,
                       enable_chunked_prefill=False)
    assert unchunked == reference
    few_seqs, _ = run(model_dir, params, num_kv_blocks=512, max_num_seqs=3)
    assert few_seqs == reference


def test_min_tokens_suppresses_stop_tokens(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64)
    prompt = prompts(1)[0]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    token = first.outputs[0].token_ids[0]
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[token]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [token] and stopped.finish_reason == "stop" and stopped.stop_reason == token
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=3,
                                                 stop_token_ids=[token]), use_tqdm=False)[0].outputs[0]
    assert token not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_incremental_detokenization_equals_full_decode(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    text = "naïve café 東京 🎉 — ok\n  done"
    ids = tok.encode(text, add_special_tokens=False)
    state = detokenizer.TextState([5, 6], SamplingParams())
    pieces = []
    for t in ids:
        state.output_token_ids.append(t)
        pieces.append(detokenizer.append_text(tok, state))
    assert "".join(pieces) == state.text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_catching_up_on_unread_tokens_equals_token_by_token(model_dir):
    """``catch_up`` (what a final_only step leaves for the end) gives the text that decoding
    after every token gives, also where the tokens stop inside a multi-byte character."""
    llm = LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    ids = tok.encode("naïve café 東京 🎉 — ok\n  done 🎉", add_special_tokens=False)
    cuts = [len(ids)] + [n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd")][:3]
    assert len(cuts) > 1  # some prefix ends inside a character
    for n in cuts:
        stepwise = detokenizer.TextState([5, 6], SamplingParams())
        for t in ids[:n]:
            stepwise.output_token_ids.append(t)
            detokenizer.append_text(tok, stepwise)
        at_once = detokenizer.TextState([5, 6], SamplingParams())
        at_once.output_token_ids.extend(ids[:n])
        added = detokenizer.catch_up(tok, at_once)
        assert added == at_once.text == stepwise.text and at_once.read_offset == stepwise.read_offset
    texts = [o.outputs[0].text for o in llm.generate(prompts(3), SamplingParams(temperature=0, max_tokens=12),
                                                     use_tqdm=False)]
    engine = llm.engine  # streamed: a snapshot every step
    for i, p in enumerate(prompts(3)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=12))
    streamed = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed[o.request_id] = o.outputs[0].text
    assert [streamed[str(i)] for i in range(3)] == texts


def test_catching_up_many_sequences_at_once_equals_one_by_one(model_dir):
    """``catch_up_all`` (what the output processor runs on a step's sequences) leaves every
    state as ``catch_up`` on each would: cuts inside a character, special tokens skipped or
    kept, a state listed twice, one with nothing unread; and it decodes them in one batch call
    a ``skip_special_tokens`` value, however many sequences there are."""
    llm = LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    ids = tok.encode("naïve café 東京 🎉 — ok\n  done 🎉", add_special_tokens=False)
    special = sorted(tok.all_special_ids)[:1]
    cuts = [len(ids)] + [n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd")][:3]
    assert len(cuts) > 1 and special
    cases = [(ids[:n] + special * (i % 2), SamplingParams(skip_special_tokens=bool(i % 3)))
             for i, n in enumerate(cuts * 3)]

    def states():
        made = []
        for i, (tokens, params) in enumerate(cases):
            state = detokenizer.TextState([5, 6], params)
            state.output_token_ids.extend(tokens[: len(tokens) // 2])
            detokenizer.catch_up(tok, state)  # some text read already
            state.output_token_ids.extend(tokens[len(tokens) // 2:])
            made.append(state)
        return made

    one_by_one, together = states(), states()
    for state in one_by_one:
        detokenizer.catch_up(tok, state)
    idle = detokenizer.TextState([5, 6], SamplingParams())
    batches = []
    batch = tok.decode_batch

    def counted(windows, **kwargs):
        batches.append(len(windows))
        return batch(windows, **kwargs)

    tok.decode_batch = counted
    try:
        detokenizer.catch_up_all(tok, together + together[:2] + [idle])
    finally:
        del tok.decode_batch
    assert [(s.text, s.read_offset, s.prefix_offset) for s in together] == \
        [(s.text, s.read_offset, s.prefix_offset) for s in one_by_one]
    assert idle.text == "" and len(batches) == 2 and sum(batches) == 2 * len(cases)


def test_a_stream_of_bytes_that_never_completes_a_character_costs_constant_decodes(model_dir):
    """A degenerate model's output of bytes that form no character (here 0xFF, never valid
    UTF-8) renders nothing new step after step; catching up each step decodes the newest
    prefix only, not every pending one again, and the text is that of decoding token by
    token. A character split over tokens after it still comes out whole."""
    llm = LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    junk = tok.backend.token_to_id("ÿ")  # the byte-level alphabet's 0xFF
    assert tok.decode([junk]) == "\ufffd"
    tail = tok.encode(" 🎉 ok", add_special_tokens=False)
    ids = [junk] * 200 + tail
    calls = []
    decode = tok.decode

    def counted(*args, **kwargs):
        calls.append(1)
        return decode(*args, **kwargs)

    state = detokenizer.TextState([5, 6], SamplingParams())
    stepwise = detokenizer.TextState([5, 6], SamplingParams())
    most = 0
    for t in ids:
        state.output_token_ids.append(t)
        tok.decode = counted
        calls.clear()
        detokenizer.catch_up(tok, state)
        tok.decode = decode
        most = max(most, len(calls))
        stepwise.output_token_ids.append(t)
        detokenizer.append_text(tok, stepwise)
    assert most <= 4  # two for the whole, two more at most where the tail ends a character
    assert state.text == stepwise.text and state.text.endswith("🎉 ok")
    assert state.read_offset == stepwise.read_offset == len(ids) + 2


def test_memory_profiling_step_and_kv_budget(model_dir, monkeypatch):
    """The profiling step behind --gpu-memory-utilization, run through the shared runner on the
    CPU with the device's numbers faked: it runs the forward and the sampler once on its own
    cache, leaves the engine's cache in place, and the engine sizes the cache from what it
    reports (utilization of total, less what is in use, less the step's peak)."""
    from fd_core.engine.config import GiB
    from fd_core.errors import ConfigError

    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=64)
    core = llm.engine.core
    runner = core.executor.runner
    caches, seen = runner.kv_caches, {}
    sample = runner.ops.sample

    def counting_sample(logits, batch):
        seen["rows"], seen["blocks"] = logits.shape[0], runner.kv_caches[0][0].shape[0] // 4
        return sample(logits, batch)

    monkeypatch.setattr(runner.ops, "sample", counting_sample)
    monkeypatch.setattr(runner.memory, "profile", lambda run: (run(), 3 * GiB)[1], raising=False)
    monkeypatch.setattr(runner.memory, "memory_info", lambda: (60 * GiB, 80 * GiB))
    free, total, peak = runner.profile_memory(300, 8, 128, "float32")
    assert (free, total, peak) == (60 * GiB, 80 * GiB, 3 * GiB)
    assert seen == {"rows": 8, "blocks": 1 + 32 + 32 + 11}  # 128 + 128 + 44 tokens, block 0 kept free
    assert runner.kv_caches is caches
    core.config.gpu_memory_utilization, core.config.max_num_batched_tokens = 0.5, 300
    expected = int((40 - 20 - 3) * GiB // core._kv_block_bytes())
    assert core._profiled_kv_blocks(core._kv_block_bytes()) == expected
    core.config.gpu_memory_utilization = 0.25  # 20 GiB, all in use already
    with pytest.raises(ConfigError, match=r"gpu-memory-utilization 0.25: .*20.00 GiB of the device's 80.00 GiB, "
                       r"less 20.00 GiB in use after loading .* largest step's 3.00 GiB"):
        core._profiled_kv_blocks(core._kv_block_bytes())


def test_kv_budget_without_a_memory_query(model_dir, monkeypatch):
    """A backend that declares no memory_query (a chip whose free memory Paddle cannot report)
    gets the KV cache it asks for; its Memory.memory_info is never called."""
    from dataclasses import replace

    from fd_core.engine.config import GiB

    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=64)
    core = llm.engine.core

    def unanswerable():
        raise NotImplementedError("memory_info is not available for device 'xpu:0'")

    monkeypatch.setattr(core.executor.runner.memory, "memory_info", unanswerable)
    monkeypatch.setattr(core, "capabilities", replace(core.capabilities, memory_query=False))
    core.config.num_kv_blocks, core.config.kv_cache_memory_gb = None, 0.001
    assert core._num_kv_blocks() == int(0.001 * GiB // core._kv_block_bytes())


def test_aborts_between_steps_end_requests_at_once(model_dir):
    """An abort reaching the core between steps (``fd serve`` drains its messages before each
    step) ends a running sequence, a waiting one and a sibling not yet forked at once, frees
    their blocks, and nothing of theirs is scheduled after it; the others' outputs are those
    of a run without the aborts."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.5, seed=9, max_tokens=8, ignore_eos=True, n=4)
    long_prompt = prompts(16)[5] + prompts(16)[7] + prompts(16)[9]  # prefills over a few steps

    def engine():
        llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, max_num_seqs=2,
                  max_num_batched_tokens=16, long_prefill_token_threshold=8)
        core = llm.engine.core
        core.add_request("run", prompts(16)[0][:5], greedy)
        core.add_request("forky", long_prompt, seeded)  # its parent prefills, its forks wait in it
        core.add_request("sib", prompts(16)[1], SamplingParams(temperature=0.5, seed=4, max_tokens=8,
                                                               ignore_eos=True, n=3))
        core.add_request("wait", prompts(16)[2], greedy)
        return llm, core

    def finish(core):
        tokens: dict[tuple[str, int], list[int]] = {}
        while core.has_unfinished_requests():
            for o in core.step():
                tokens.setdefault((o.request_id, o.index), []).extend(o.token_ids)
        return tokens

    _, core = engine()
    reference = finish(core)

    llm, core = engine()
    core.step()
    core.step()
    by_key = {(s.request_id, s.index): s for seqs in core.seqs.values() for s in seqs}
    run, wait = by_key["run", 0], by_key["wait", 0]
    forky, forky2, sib1 = by_key["forky", 0], by_key["forky", 2], by_key["sib", 1]
    assert run in core.scheduler.running and run.output_token_ids  # decoding
    assert wait in core.scheduler.waiting
    assert forky in core.scheduler.running and 0 < forky.num_computed < len(long_prompt)
    assert forky2.fork_of is forky and sib1.fork_of is by_key["sib", 0]  # siblings not yet forked
    free_before = llm.engine.pool.num_free

    core.abort("run")
    core.abort("wait")
    core.abort("forky", 2)
    core.abort("sib", 1)
    aborted = [run, wait, forky2, sib1]
    for seq in aborted:
        assert seq.finished and seq.finish_reason == "abort" and not seq.block_table
        assert seq not in core.scheduler.running and seq not in core.scheduler.waiting and seq.fork_of is None
    assert forky2 not in forky.forks and sib1 not in by_key["sib", 0].forks
    assert llm.engine.pool.num_free > free_before  # the running one's blocks are back at once

    scheduled: list[set[int]] = []
    schedule = core.scheduler.schedule

    def spy():
        out = schedule()
        scheduled.append({id(s.seq) for s in out.scheduled} | {id(f) for s in out.scheduled for f in s.forks})
        return out

    core.scheduler.schedule = spy
    tokens = finish(core)
    assert not set(map(id, aborted)) & set().union(*scheduled), "an aborted sequence was computed"
    assert {("run", 0), ("wait", 0), ("forky", 2), ("sib", 1)}.isdisjoint(tokens)
    for key, seq in by_key.items():
        if seq not in aborted:  # the others are untouched: their tokens (those before the abort too)
            assert seq.output_token_ids == reference[key], key
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_a_short_request_behind_a_long_prompt_starts_in_the_next_step(model_dir):
    """Issue 14: a prefilling prompt took every step's budget until it was done. With the
    long-prefill threshold a request arriving behind it is admitted, and samples, in the next
    step; the long prompt still gets the rest of every step."""
    long_prompt = np.random.default_rng(5).integers(3, 400, size=100).tolist()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def steps_to_first_token(threshold):
        llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512,
                  max_num_batched_tokens=16, long_prefill_token_threshold=threshold)
        engine = llm.engine
        engine.add_request("long", long_prompt, params)
        engine.step()
        engine.add_request("short", [5, 6, 7], params)
        steps, outs = 0, {}
        short = engine.core.seqs["short"][0]
        while engine.has_unfinished_requests():
            for o in engine.step(final_only=True):
                outs[o.request_id] = o.outputs[0].token_ids
            steps += 1
            if short.output_token_ids and "first" not in outs:
                outs["first"] = steps
        return outs, engine.stats["steps"]

    capped, capped_steps = steps_to_first_token(4)
    assert capped["first"] == 1
    uncapped, uncapped_steps = steps_to_first_token(0)
    assert uncapped["first"] == -(-(100 - 16) // 16)  # behind the whole prompt
    assert capped["long"] == uncapped["long"] and capped["short"] == uncapped["short"]
    assert capped_steps == uncapped_steps  # the long prompt lost nothing
    # left unsaid, the CPU backend's threshold applies
    assert LLM(model=str(model_dir), device="cpu", max_model_len=128, num_kv_blocks=64).engine.config.long_prefill_token_threshold == 24


@pytest.mark.parametrize("break_it", ["tokens", "forks"])
def test_the_engine_refuses_a_step_past_its_limits(model_dir, break_it):
    """The scheduler never builds such a step (tests/test_scheduler_properties.py); if a change
    made it, the core stops before running it rather than run a step of unbounded length."""
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=128, max_num_seqs=4,
              max_num_batched_tokens=16)
    core = llm.engine.core
    core.add_request("a", prompts(16)[3], SamplingParams(max_tokens=2, n=8))
    schedule = core.scheduler.schedule

    def broken():
        out = schedule()
        s = out.scheduled[0]
        if break_it == "tokens":
            s.num_new += 16
        else:
            s.forks = list(s.seq.forks)  # every fork a row, past max_num_seqs
        return out

    core.scheduler.schedule = broken
    with pytest.raises(RuntimeError, match="the scheduler exceeded its limits"):
        while core.has_unfinished_requests():
            core.step()


def test_prompt_logits_leave_the_prefix_cache_consistent(model_dir):
    """``fd_core.bench.perplexity`` prefills outside the scheduler, over blocks the prefix cache
    may hold: afterwards a cached prompt is computed again and answers as before."""
    from fd_core.bench.perplexity import prompt_logits

    llm = LLM(model=str(model_dir), device="cpu", max_model_len=128, block_size=4, num_kv_blocks=64)
    prompt, params = list(range(3, 40)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    logits = prompt_logits(llm, [50 + (7 * i) % 200 for i in range(100)])  # over the cached blocks
    assert logits.shape == (99, llm.engine.model_config.vocab_size)
    assert llm.reset_prefix_cache() == 0  # already forgotten
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == before


def test_outputs_carry_token_times_when_the_caller_times_them(model_dir):
    """The core sends a request's queue and prefill time with its first token; the output
    processor, given each step's arrival time, stamps the outputs with the first and latest
    token time and each sequence's gap since its previous token."""
    from fd_core.engine.output_processor import OutputProcessor

    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4)
    core = llm.engine.core
    params = SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True)
    ids = prompts(1)[0]
    core.add_request("r", ids, params)
    processor = OutputProcessor(core.tokenizer)
    processor.add_request("r", None, ids, params)
    outputs, step = [], 0
    while core.has_unfinished_requests():
        step += 1
        results, _ = processor.process(core.step(), now=float(step))
        outputs += results
    first, *rest = outputs
    m = first.metrics
    assert m.first_token_time == m.last_token_time and m.inter_token_latencies == []
    assert m.time_in_queue >= 0 and m.prefill_time > 0
    assert [o.metrics.inter_token_latencies for o in rest] == [[1.0, 1.0]] * 3  # two sequences, 4 tokens each
    assert all(o.metrics.first_token_time == m.first_token_time for o in rest)
    assert rest[-1].finished and rest[-1].metrics.last_token_time == m.first_token_time + 3
    offline = llm.generate([ids], params, use_tqdm=False)[0]
    assert offline.metrics is None  # nobody times the offline API's steps


def test_an_offline_engine_keeps_its_start_up_heap_out_of_collections(model_dir):
    """As fd serve's processes: once the in-process engine is built, what start-up made is
    frozen (a full collection no longer walks it); shutting the engine down gives it back, and
    a new engine first frees what was dropped in cycles since the last froze."""
    import gc
    import weakref

    from fd_core import LLM

    class Cycle:
        pass

    first = LLM(model=str(model_dir), device="cpu", num_kv_blocks=64)
    assert gc.get_freeze_count() > 0
    dropped = Cycle()
    dropped.me = dropped  # unreachable in a cycle once dropped: only a collection frees it
    gone = weakref.ref(dropped)
    gc.collect()
    gc.freeze()  # as a later engine's start-up would have frozen it while it was alive
    del dropped
    gc.collect()
    assert gone() is not None  # frozen: collections pass it by
    second = LLM(model=str(model_dir), device="cpu", num_kv_blocks=64)
    assert gone() is None and gc.get_freeze_count() > 0
    first.engine.core.shutdown()
    second.engine.core.shutdown()
    assert gc.get_freeze_count() == 0
