"""Speculative decoding in the engine (``--speculative-config``), on a tiny random-weight Llama
in float32: whatever the proposer guesses, the tokens emitted are those of the engine without
speculation — greedy, seeded at a temperature, with logprobs, stop rules, ``n > 1``, prefix
caching, chunked prefill, preemption by recompute and by swap — and every block comes back."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine.config import EngineConfig  # noqa: E402
from fd_core.engine.speculative.proposer import room  # noqa: E402
from fd_core.errors import ConfigError  # noqa: E402
from tests import checkpoints  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("spec"))


def prompts(n: int = 12) -> list[list[int]]:
    """Prompts that repeat a random phrase, so that a prompt lookup finds something to propose
    (right or wrong: a random model rarely continues the phrase)."""
    rng = np.random.default_rng(5)
    out = []
    for _ in range(n):
        phrase = rng.integers(3, 400, size=int(rng.integers(2, 6))).tolist()
        out.append((phrase * int(rng.integers(2, 5)) + rng.integers(3, 400, size=int(rng.integers(1, 12))).tolist()))
    return out


class Oracle:
    """A proposer that knows the engine's output without speculation (``reference``: per
    prompt, per output index) and proposes it with about a third of the drafts changed: at any
    temperature most drafts hold and some do not."""

    holds_kv = False

    def __init__(self, reference: dict[tuple, list[list[int]]], k: int = 3) -> None:
        self.reference, self.k = reference, k
        self.rng = np.random.default_rng(0)

    def propose(self, scheduled, decoding) -> None:
        for seq in decoding:
            want = self.reference[tuple(seq.prompt_token_ids)][seq.index]
            at = len(seq.output_token_ids)
            drafts = want[at : at + room(seq, self.k, 128)]
            seq.draft_token_ids = [t if self.rng.random() > 0.3 else (t + 1) % 500 for t in drafts]


def run(model_dir, params, speculative=None, n_prompts: int = 12, oracle=None, **engine_args):
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, speculative_config=speculative,
              **{"num_kv_blocks": 512, **engine_args})
    if oracle is not None:
        llm.engine.core.proposer = Oracle(oracle)
    outs = llm.generate(prompts(n_prompts), params, use_tqdm=False)
    pool = llm.engine.pool
    assert pool.num_free == pool.capacity  # no block held by a finished or rejected token
    return outs, llm.engine.stats


def tokens(outs):
    return [[o.token_ids for o in out.outputs] for out in outs]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def references(model_dir):
    return {name: tokens(run(model_dir, params)[0]) for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


@pytest.mark.parametrize("name, params, proposer", [("greedy", GREEDY, "ngram"), ("greedy", GREEDY, "oracle"),
                                                    ("seeded", SEEDED, "oracle")])
@pytest.mark.parametrize("engine_args", [
    {},
    {"num_kv_blocks": 4 * 15 + 1},  # the scheduler preempts and recomputes
    {"num_kv_blocks": 4 * 15 + 1, "swap_space": 0.01},  # preempted by swap
    {"max_num_batched_tokens": 7},  # prompts in chunks; drafts cut to the budget
    {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 4},
    {"max_num_seqs": 3},
    {"enable_prefix_caching": False},
], ids=["plain", "recompute", "swap", "chunked", "threshold", "few-seqs", "no-prefix-cache"])
def test_speculation_does_not_change_outputs(model_dir, references, name, params, proposer, engine_args):
    """The prompt lookup proposes what it finds (on a random model, most of it wrong); the oracle
    mostly right, which at a temperature shows accepted drafts sampled exactly as without
    speculation (the counter-based noise of each row's own step)."""
    oracle = None
    if proposer == "oracle":
        oracle = {tuple(p): ref for p, ref in zip(prompts(), references[name])}
    outs, stats = run(model_dir, params, NGRAM, oracle=oracle, **engine_args)
    assert tokens(outs) == references[name]
    # the drafts were verified, and some of them held, some not
    assert stats["spec_drafts"] > 10 and 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert sum(stats["spec_accepted_per_pos"]) == stats["spec_accepted_tokens"]
    assert stats["generation_tokens"] == 12 * 24
    if "num_kv_blocks" in engine_args:
        assert stats["preemptions"] > 0


def test_logprobs_stop_rules_and_forks(model_dir):
    """Logprobs of each emitted token are those of its position; EOS, a stop token, max_tokens
    and n > 1 end and fork sequences as without speculation."""
    base = SamplingParams(temperature=0.8, seed=3, max_tokens=20, logprobs=3, n=2)
    reference, _ = run(model_dir, base)
    stop = reference[0].outputs[0].token_ids[5]
    cases = [base, SamplingParams(temperature=0, max_tokens=17, stop_token_ids=[stop], logprobs=2),
             SamplingParams(temperature=0, max_tokens=9, min_tokens=4, stop_token_ids=[stop])]
    for params in cases:
        want, _ = run(model_dir, params) if params is not base else (reference, None)
        oracle = {tuple(p): [o.token_ids for o in out.outputs] for p, out in zip(prompts(), want)}
        got, stats = run(model_dir, params, NGRAM, oracle=oracle)
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        for a, b in zip(got, want):
            for x, y in zip(a.outputs, b.outputs):
                assert (x.token_ids, x.finish_reason, x.stop_reason) == (y.token_ids, y.finish_reason, y.stop_reason)
                if params.logprobs is not None:
                    for lx, ly in zip(x.logprobs, y.logprobs):
                        assert lx.keys() == ly.keys()
                        np.testing.assert_allclose([v.logprob for v in lx.values()],
                                                   [v.logprob for v in ly.values()], atol=1e-4)


def test_prefix_cache_publishes_accepted_tokens_only(model_dir):
    """A block whose slots the step filled with drafts is published once its tokens are the
    accepted ones: a second request continuing the first's output finds the first's blocks."""
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, speculative_config=NGRAM)
    prompt = prompts(1)[0]
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.stats["spec_accepted_tokens"] > 0
    again = llm.generate([prompt + first], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    # every full block of prompt + output but the last token's was cached from the first run
    assert again.num_cached_tokens == (len(prompt) + len(first) - 1) // 4 * 4


def test_a_sequence_near_its_limits_proposes_no_more_than_fits(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=40, block_size=4, num_kv_blocks=64, speculative_config=NGRAM)
    prompt = prompts(3)[2][:30]
    for limit in (1, 2, 5):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=limit, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == limit and out.finish_reason == "length"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert llm.engine.stats["spec_accepted_tokens"] > 0
    assert len(prompt) + len(out.token_ids) == 40 and out.finish_reason == "length"


def test_asynchronous_scheduling_is_refused_with_speculation():
    with pytest.raises(ConfigError, match=r"^--async-scheduling: speculative decoding \(--speculative-config\)"):
        EngineConfig(model="x", async_scheduling=True, speculative_config=NGRAM).validate()
    config = EngineConfig(model="x", speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    config.validate()
    assert config.speculative_config.num_speculative_tokens == 2


def bad_words(model_dir) -> list[str]:
    """Words of two tokens that greedy decoding writes (so banning their second token after the
    first changes the output)."""
    from fd_core.loader import load_checkpoint

    tok = load_checkpoint(str(model_dir)).tokenizer
    out, words = tokens(run(model_dir, GREEDY)[0]), []
    for seq in out:
        ids = seq[0]
        for i in range(2, len(ids) - 1):
            word = tok.decode(ids[i : i + 2])
            if tok.encode(word, add_special_tokens=False) == ids[i : i + 2]:
                words.append(word)
                break
    return words[:6]


@pytest.mark.parametrize("case", ["penalties", "bad-words-and-bias", "allowed-ids"])
def test_sampling_that_reads_the_output_so_far(model_dir, case):
    """The row after a draft samples as if the draft were output: penalties count it, a bad
    word it begins is banned after it."""
    params = {
        "penalties": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=3.0,
                                    presence_penalty=2.0, frequency_penalty=1.0),
        "bad-words-and-bias": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                             bad_words=bad_words(model_dir) if case == "bad-words-and-bias" else None,
                                             logit_bias={7: 5.0, 9: -100}),
        "allowed-ids": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                      allowed_token_ids=list(range(3, 300))),
    }[case]
    want, _ = run(model_dir, params)
    oracle = {tuple(p): [o.token_ids for o in out.outputs] for p, out in zip(prompts(), want)}
    got, stats = run(model_dir, params, NGRAM, oracle=oracle)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert tokens(got) == tokens(want)


def test_constrained_sequences_do_not_speculate(model_dir):
    """A sequence under a grammar verifies no drafts (its mask follows one token a step) and
    still gives its output; one beside it without a grammar speculates."""
    from fd_core.engine.structured.params import StructuredOutputsParams

    # a grammar whose output repeats itself, so a prompt lookup would have drafts to offer
    json_params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(
        regex="(ab){6}x"))
    free = GREEDY
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, speculative_config=NGRAM)
    base = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512)
    ps = prompts(2)
    constrained_drafts = []
    schedule = llm.engine.core.scheduler.schedule

    def spy():
        out = schedule()
        constrained_drafts.extend(len(s.drafts) for s in out.scheduled if s.seq.grammar is not None)
        return out

    llm.engine.core.scheduler.schedule = spy
    got = llm.generate(ps, [json_params, free], use_tqdm=False)
    assert constrained_drafts and not any(constrained_drafts)
    want = base.generate(ps, [json_params, free], use_tqdm=False)
    assert tokens(got) == tokens(want)
    assert llm.engine.stats["spec_drafts"] > 0
    assert got[0].outputs[0].text == "ab" * 6 + "x"


def test_each_row_samples_as_if_its_drafts_were_output():
    """``sampling_batch`` with ``drafts_ahead``: the row after ``j`` drafts has step index
    ``len(output) + j``, penalties over the output and those drafts, a bad word they begin
    banned, and min_tokens' suppression lifted once they reach it."""
    from fd_core.engine.model_runner import drafts_ahead, prepare_inputs, sampling_batch
    from fd_core.engine.scheduler import ScheduledSeq
    from fd_core.engine.sequence import Sequence

    params = SamplingParams(min_tokens=3, stop_token_ids=[50], repetition_penalty=1.2)
    seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=[1, 2, 3], params=params, seed=7,
                   arrival=0, output_token_ids=[9], num_computed=3, block_table=[1, 2], bad_words=((4, 5),))
    other = Sequence(seq_id=1, request_id="s", index=0, prompt_token_ids=[6, 7], params=SamplingParams(), seed=8,
                     arrival=1, output_token_ids=[4], num_computed=2, block_table=[3])
    scheduled = [ScheduledSeq(seq, 3, drafts=[4, 8]), ScheduledSeq(other, 1)]
    inputs, sampled = prepare_inputs(scheduled, 4)
    assert sampled == [seq, seq, seq, other]
    np.testing.assert_array_equal(inputs.input_ids, [9, 4, 8, 4])
    np.testing.assert_array_equal(inputs.positions, [3, 4, 5, 2])
    np.testing.assert_array_equal(inputs.logit_rows, [0, 1, 2, 3])
    ahead = drafts_ahead(scheduled)
    assert ahead == [[], [4], [4, 8], []]
    batch = sampling_batch(sampled, np.array([2]), ahead)
    np.testing.assert_array_equal(batch.steps, [1, 2, 3, 1])
    # only penalised rows carry their tokens (another row's may be in flight: PLACEHOLDER)
    assert [o.tolist() for o in batch.output_token_ids] == [[9], [9, 4], [9, 4, 8], []]
    # min_tokens 3: the ways to end are banned until three tokens are out; the word (4, 5) is
    # banned after its 4, which the row after the first draft has (and `other`, which has none)
    assert [b.tolist() for b in batch.suppress_token_ids] == [[2, 50], [2, 5, 50], [], []]
    assert drafts_ahead([ScheduledSeq(other, 1)]) is None


def test_padded_drafts_where_the_backend_wants_one_shape(model_dir, references):
    """A backend whose verification steps replay one captured shape (``uniform_drafts``) gets
    every decoding sequence padded to k drafts where its limits allow; the output is unchanged."""
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, speculative_config=NGRAM,
              max_num_batched_tokens=256)  # room for 12 sequences' 4 tokens (the CPU's budget is 48)
    llm.engine.core._pad_drafts = True  # as ModelRunner.pads_drafts() says on such a backend
    shapes = []
    schedule = llm.engine.core.scheduler.schedule

    def spy():
        out = schedule()
        shapes.append([len(s.drafts) for s in out.scheduled if s.samples])
        return out

    llm.engine.core.scheduler.schedule = spy
    got = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    assert got == references["greedy"]
    decode_steps = [s for s in shapes[1:] if s]
    # after the prompts every step verifies 3 drafts a sequence, until max_tokens leaves less room
    assert all(all(k == 3 for k in s) for s in decode_steps[:6])


def test_prompt_logprobs_and_tensor_parallel_ranks_with_ngram(model_dir):
    """Prompt logprobs are scored while the prompt prefills (no drafts then), and two gloo
    ranks verify drafts as one process does."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    want, _ = run(model_dir, params, n_prompts=4)
    got, stats = run(model_dir, params, NGRAM, n_prompts=4)
    assert stats["spec_draft_tokens"] > 0
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            np.testing.assert_allclose([v.logprob for v in x.values()], [v.logprob for v in y.values()], atol=1e-4)
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=256, tensor_parallel_size=2,
              speculative_config=NGRAM)
    try:
        two = tokens(llm.generate(prompts(4), GREEDY, use_tqdm=False))
        assert llm.engine.stats["spec_accepted_tokens"] > 0
    finally:
        llm.engine.core.shutdown()
    assert two == tokens(run(model_dir, GREEDY, n_prompts=4)[0])
