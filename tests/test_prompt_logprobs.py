"""``prompt_logprobs`` through the engine, against Hugging Face transformers (the oracle) on a
tiny random-weight Llama in float32: for every prompt token after the first, its logprob given
the tokens before it is transformers' log-softmax at the position before it, its rank is its
place among them, and the top k are transformers' best — whole prompts, chunked prefill,
prefix caching, preemption by recompute and by swap, forks (``n > 1``). Steps of requests that
do not ask do no extra work, and the sampled tokens are those of the same requests without it.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")  # the oracle, and the checkpoint is built with it

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine import scheduler as scheduler_module  # noqa: E402
from fd_core.engine.model_runner import StepInputs  # noqa: E402
from fd_core.errors import InvalidRequestError  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.oracle import hf_logits  # noqa: E402

BLOCK = 4
MAX_LEN = 128
# fd's float32 logprobs against transformers' (float64 log-softmax of its float32 logits): the
# logits of this model are of order 1, and the two differ by the summation order of their matmuls
TOL = 1e-4
K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("prompt_logprobs"))


def make_prompts(lengths: list[int], seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=n).tolist() for n in lengths]


PROMPTS = make_prompts([1, 2, 5, 17, 40, 61])


@pytest.fixture(scope="module")
def oracle(model_dir):
    """Per prompt, transformers' log-softmax (float64) at every position."""
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def log_softmax(prompt: list[int]) -> np.ndarray:
        key = tuple(prompt)
        if key not in cache:
            x = hf_logits(model_dir, prompt).astype(np.float64)
            x = x - x.max(axis=-1, keepdims=True)
            cache[key] = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
        return cache[key]

    return log_softmax


def check(prompt_logprobs, prompt: list[int], oracle, k: int = K, tokenizer=None) -> None:
    """vLLM's shape (None, then one dict per token) holding transformers' numbers."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    want = oracle(prompt)
    for i in range(1, len(prompt)):
        entry, token, row = prompt_logprobs[i], prompt[i], want[i - 1]
        assert token in entry, (i, entry)
        got = entry[token]
        assert abs(got.logprob - row[token]) <= TOL, (i, got.logprob, row[token])
        # its rank: one more than the tokens more likely, up to ties within the tolerance
        assert 1 + np.sum(row > row[token] + TOL) <= got.rank <= np.sum(row >= row[token] - TOL), (i, got.rank)
        # the top k, and the prompt token when it is not among them
        assert len(entry) in (k, k + 1)
        best = sorted((lp.logprob for t, lp in entry.items()), reverse=True)[:k]
        np.testing.assert_allclose(best, np.sort(row)[::-1][:k], atol=TOL, rtol=0)
        if tokenizer is not None:
            assert got.decoded_token == tokenizer.decode([token], skip_special_tokens=False)


def generate(llm, prompts, **params):
    args = {"temperature": 0, "max_tokens": 4, "ignore_eos": True} | params
    return llm.generate(prompts, SamplingParams(**args), use_tqdm=False)


def engine(model_dir, **engine_args):
    return LLM(model=str(model_dir), max_model_len=MAX_LEN, block_size=BLOCK, **engine_args)


@pytest.mark.parametrize("engine_args", [
    {},  # the cpu backend's budget (48) and threshold (24): the longer prompts come in chunks
    {"max_num_batched_tokens": 5},  # chunks of at most 5 tokens, beside each other's
    {"enable_chunked_prefill": False, "enable_prefix_caching": False},  # each prompt whole
    {"runtime": "torch", "max_num_batched_tokens": 7},
], ids=["default", "chunks-of-5", "whole", "torch"])
def test_prompt_logprobs_match_transformers(model_dir, oracle, engine_args):
    llm = engine(model_dir, num_kv_blocks=256, **engine_args)
    outs = generate(llm, PROMPTS, prompt_logprobs=K)
    for prompt, out in zip(PROMPTS, outs):
        check(out.prompt_logprobs, prompt, oracle, tokenizer=llm.engine.tokenizer)
        assert out.num_cached_tokens == 0
    # the rows that sample are untouched: the same tokens and logprobs as without, bit for bit
    # (on engines of their own: a prefix-cache hit would change the steps' shapes, and so the
    # last bits of their sums)
    plain = generate(engine(model_dir, num_kv_blocks=256, **engine_args), PROMPTS, logprobs=2)
    scored = generate(engine(model_dir, num_kv_blocks=256, **engine_args), PROMPTS, logprobs=2, prompt_logprobs=0)
    for a, b in zip(plain, scored):
        assert a.prompt_logprobs is None
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.logprobs for c in a.outputs] == [c.logprobs for c in b.outputs]
        assert all(len(entry) == 1 for entry in b.prompt_logprobs[1:])  # k = 0: the prompt token alone
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_prefix_caching_neither_skips_nor_changes_them(model_dir, oracle):
    """A request with prompt_logprobs takes no cached blocks (their positions would have no
    logits), but publishes its own: an identical second one gets the same prompt logprobs,
    and a request without them reuses the first one's blocks."""
    llm = engine(model_dir, num_kv_blocks=256)
    prompt = PROMPTS[-1]
    first, = generate(llm, [prompt], prompt_logprobs=K)
    second, = generate(llm, [prompt], prompt_logprobs=K)
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert second.prompt_logprobs == first.prompt_logprobs
    check(second.prompt_logprobs, prompt, oracle)
    plain, = generate(llm, [prompt])
    assert plain.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert plain.outputs[0].token_ids == first.outputs[0].token_ids
    # cached by a plain request first, then asked with prompt_logprobs: computed whole again
    other = make_prompts([33], seed=9)[0]
    generate(llm, [other])
    hits = llm.engine.pool.hit_tokens
    again, = generate(llm, [other], prompt_logprobs=K)
    assert again.num_cached_tokens == 0 and llm.engine.pool.hit_tokens == hits
    check(again.prompt_logprobs, other, oracle)


PREEMPTED = make_prompts([20, 37, 45, 52, 60, 29, 41, 58, 33, 47, 55, 24], seed=11)
TIGHT = MAX_LEN // BLOCK + 1  # room for one whole sequence: a dozen preempt each other, mid-prompt too


def watch_preemptions(monkeypatch) -> list[tuple[int, int]]:
    """(prompt tokens scored, prompt length) of every sequence owing prompt logprobs when it
    was preempted."""
    seen: list[tuple[int, int]] = []
    preempt = scheduler_module.Scheduler._preempt

    def spy(self, seq, out):
        if seq.owes_prompt_logprobs:
            seen.append((seq.prompt_scored, len(seq.prompt_token_ids)))
        return preempt(self, seq, out)

    monkeypatch.setattr(scheduler_module.Scheduler, "_preempt", spy)
    return seen


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_preemption_reports_each_position_once(model_dir, oracle, monkeypatch, swap):
    """Sequences preempted part way through their prompt (by recompute: computed again from
    its start, less what they had scored; by swap: resumed) still report every prompt token
    once, with transformers' numbers."""
    seen = watch_preemptions(monkeypatch)
    llm = engine(model_dir, num_kv_blocks=TIGHT, max_num_batched_tokens=16, **({"swap_space": 0.05} if swap else {}))
    outs = generate(llm, PREEMPTED, prompt_logprobs=2, max_tokens=24)
    sched = llm.engine.scheduler
    assert (sched.num_swapped_out if swap else sched.num_recomputed) > 0
    assert any(1 < scored < length for scored, length in seen), seen  # preempted mid-prompt, scores taken
    for prompt, out in zip(PREEMPTED, outs):
        check(out.prompt_logprobs, prompt, oracle, k=2)
    roomy = generate(engine(model_dir, num_kv_blocks=1024), PREEMPTED, max_tokens=24)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_forks_get_the_prompt_once(model_dir, oracle):
    llm = engine(model_dir, num_kv_blocks=256)
    params = {"temperature": 0.7, "seed": 3, "n": 3, "max_tokens": 6}
    scored = generate(llm, PROMPTS[2:], prompt_logprobs=K, **params)
    plain = generate(llm, PROMPTS[2:], **params)
    for prompt, a, b in zip(PROMPTS[2:], scored, plain):
        check(a.prompt_logprobs, prompt, oracle)
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_a_one_token_prompt_has_only_none(model_dir):
    out, = generate(engine(model_dir, num_kv_blocks=64), [[7]], prompt_logprobs=5)
    assert out.prompt_logprobs == [None]


def test_steps_without_prompt_logprobs_do_no_extra_work(model_dir, monkeypatch):
    llm = engine(model_dir, num_kv_blocks=256)

    def forbidden(*args, **kwargs):
        raise AssertionError("scored prompts for requests that did not ask")

    monkeypatch.setattr(StepInputs, "score_prompts", forbidden)
    monkeypatch.setattr(llm.engine.runner.ops, "token_logprobs", forbidden)
    outs = generate(llm, PROMPTS, logprobs=3)
    assert all(o.prompt_logprobs is None for o in outs)


def test_bad_prompt_logprobs_are_refused_by_name(model_dir):
    llm = engine(model_dir, num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs 21 is more than") as info:
        generate(llm, PROMPTS[:1], prompt_logprobs=21)
    assert info.value.param == "prompt_logprobs"
    for bad, match in [(-1, "every token of the vocabulary"), (-2, r"in \[0, "), (1.5, "an integer"),
                       (True, "an integer")]:
        with pytest.raises(InvalidRequestError, match=match) as info:
            SamplingParams(prompt_logprobs=bad)
        assert info.value.param == "prompt_logprobs"
    # --max-logprobs caps it as it caps logprobs
    out, = generate(engine(model_dir, num_kv_blocks=64, max_logprobs=30), PROMPTS[3:4], prompt_logprobs=25)
    assert all(len(entry) >= 25 for entry in out.prompt_logprobs[1:])


def test_a_backend_without_the_op_refuses_them(model_dir):
    """token_logprobs is optional: an op table without it (the reference is never missing in
    fd's runtimes, so it is taken out here) refuses the field instead of ignoring it."""
    llm = engine(model_dir, num_kv_blocks=64)
    del llm.engine.runner.ops.choices["token_logprobs"]
    with pytest.raises(InvalidRequestError, match="prompt_logprobs is unavailable: on the cpu backend, its op table "
                                                  "has no token_logprobs op") as info:
        generate(llm, PROMPTS[:1], prompt_logprobs=1)
    assert info.value.param == "prompt_logprobs"
    assert generate(llm, PROMPTS[:1])[0].prompt_logprobs is None
