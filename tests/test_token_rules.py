"""``allowed_token_ids`` and ``bad_words`` in the engine: the rules hold on a model whose random
weights would otherwise write anything, they change nothing before the step they constrain,
they combine with structured output, asynchronous scheduling gives the synchronous outputs,
and bad values are refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine import bad_words  # noqa: E402
from fd_core.engine.wire import params_from_wire, params_to_wire  # noqa: E402
from fd_core.engine.structured import StructuredOutputsParams as S  # noqa: E402
from fd_core.errors import InvalidRequestError  # noqa: E402
from fd_core.plugins import registry as registry_module  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.test_async_scheduling import HostFed, async_cpu  # noqa: E402, F401 - the fixture
from tests.test_structured_engine import _registry_with_sample  # noqa: E402

PROMPTS = [f"prompt number {i} says" for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("rules"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512)


def generate(llm, params, prompts=PROMPTS):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.pool.num_free == llm.engine.pool.capacity
    return [c for o in outs for c in o.outputs]


def contains(tokens, word):
    return any(tuple(tokens[i:i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


# -- bad_words -------------------------------------------------------------------------------


def test_a_word_is_banned_only_where_its_head_was_written():
    words = ((5,), (7, 8, 9))
    assert bad_words.banned(words, []).tolist() == [5]
    assert bad_words.banned(words, [1, 7]).tolist() == [5]
    assert bad_words.banned(words, [1, 7, 8]).tolist() == [5, 9]
    assert bad_words.banned(words, [7, 8, 1]).tolist() == [5]
    assert not bad_words.needs_history([(5,), (6,)]) and bad_words.needs_history(words)


def test_both_spellings_are_tokenized(llm):
    tokenizer = llm.engine.core.tokenizer
    words = bad_words.tokenize_bad_words(tokenizer, ["  hello"])
    assert tuple(tokenizer.encode("hello", add_special_tokens=False)) in words
    assert tuple(tokenizer.encode(" hello", add_special_tokens=False)) in words


def _a_word_from(llm, tokens):
    """Text of two consecutive output tokens whose tokenization is exactly those two tokens."""
    tokenizer = llm.engine.core.tokenizer
    for i in range(2, len(tokens) - 1):
        text = tokenizer.decode(tokens[i:i + 2])
        if text.strip() and tuple(tokenizer.encode(text, add_special_tokens=False)) == tuple(tokens[i:i + 2]):
            return i, text
    pytest.skip("no two-token word in this output")


def test_a_multi_token_word_never_appears_and_nothing_before_it_changes(llm):
    base = generate(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), PROMPTS[:1])[0].token_ids
    at, text = _a_word_from(llm, base)
    out = generate(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[text]),
                   PROMPTS[:1])[0].token_ids
    words = bad_words.tokenize_bad_words(llm.engine.core.tokenizer, [text])
    assert not any(contains(out, w) for w in words)
    assert out[:at + 1] == base[:at + 1] and out[at + 1] != base[at + 1]


def test_single_token_words_hold_under_sampling(llm):
    tokenizer = llm.engine.core.tokenizer
    free = generate(llm, SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True))
    common = max({t for o in free for t in o.token_ids}, key=lambda t: sum(o.token_ids.count(t) for o in free))
    text = tokenizer.decode([common])
    words = bad_words.tokenize_bad_words(tokenizer, [text])
    out = generate(llm, SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True, bad_words=[text]))
    assert all(not contains(o.token_ids, w) for o in out for w in words)


# -- allowed_token_ids ----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_only_allowed_tokens_are_sampled(llm, temperature):
    allowed = [11, 12, 40, 41, 300]
    out = generate(llm, SamplingParams(temperature=temperature, seed=1, max_tokens=12, allowed_token_ids=allowed))
    assert all(set(o.token_ids) <= set(allowed) for o in out)
    assert all(len(o.token_ids) == 12 for o in out)  # no EOS among them: each runs to max_tokens


def test_allowed_tokens_narrow_a_grammar(llm):
    """The static mask and the grammar's are intersected: of two choices, only the one whose
    tokens are allowed can be written, though the grammar alone picks the other."""
    tokenizer = llm.engine.core.tokenizer
    choices = ["alpha", "beta"]
    picked = generate(llm, SamplingParams(temperature=0, max_tokens=10, structured_outputs=S(choice=choices)),
                      PROMPTS[:1])[0].text
    other = choices[1 - choices.index(picked)]
    ids = tokenizer.encode(other, add_special_tokens=False) + sorted(llm.engine.core.eos_token_ids)
    out = generate(llm, SamplingParams(temperature=0, max_tokens=10, allowed_token_ids=ids,
                                       structured_outputs=S(choice=choices)), PROMPTS[:1])
    assert [o.text for o in out] == [other]


def test_rows_with_and_without_rules_share_a_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = generate(llm, free, PROMPTS[:2])
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[:1], [free, free, SamplingParams(
        temperature=0, max_tokens=10, allowed_token_ids=[20, 21])], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert set(mixed[2].outputs[0].token_ids) <= {20, 21}


@pytest.mark.parametrize("kind", ["single-token words", "longer words", "allowed"])
def test_async_scheduling_gives_the_synchronous_outputs(async_cpu, model_dir, kind):  # noqa: F811
    """Single-token words and allowed ids are static: those rows still run ahead. A longer word
    needs the last tokens on the host, so its rows are read before the next step."""
    def outputs(**engine_args):
        llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, **engine_args)
        tokenizer = llm.engine.core.tokenizer
        words = [w for w in (tokenizer.decode([t]) for t in range(40, 400))
                 if w.strip() and not bad_words.needs_history(bad_words.tokenize_bad_words(tokenizer, [w]))][:20]
        assert len(words) >= 5
        rule = {"single-token words": {"bad_words": words}, "longer words": {"bad_words": words + ["the cat"]},
                "allowed": {"allowed_token_ids": list(range(30, 90))}}[kind]
        params = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=20, **rule)
        return llm, [(c.token_ids, c.finish_reason) for o in llm.generate(PROMPTS, params, use_tqdm=False)
                     for c in o.outputs]

    _, sync = outputs(async_scheduling=False)
    before = HostFed.fed
    llm, overlapped = outputs()
    assert llm.engine.core.async_scheduling
    assert (HostFed.fed > before) == (kind != "longer words")
    assert overlapped == sync


# -- the request -----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"bad_words": ["ok", "  "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": ["x"] * 257}, "bad_words"),
])
def test_bad_values_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_ids_past_the_vocabulary_are_refused(llm):
    vocab = llm.engine.core.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="below the vocabulary size") as info:
        llm.generate(["x"], SamplingParams(allowed_token_ids=[1, vocab]), use_tqdm=False)
    assert info.value.param == "allowed_token_ids"


def test_the_wire_form_round_trips():
    params = SamplingParams(allowed_token_ids=[3, 4], bad_words=["a b", "c"])
    back = params_from_wire(params_to_wire(params))
    assert back.allowed_token_ids == [3, 4] and back.bad_words == ["a b", "c"]


def test_a_sample_op_older_than_the_bitmask_refuses_allowed_token_ids(monkeypatch, model_dir):
    from fd_core.runtimes.paddle.ops import REFERENCE_OPS

    monkeypatch.setattr(registry_module, "_registry", _registry_with_sample("fd-backend-old", "1.9",
                                                                           REFERENCE_OPS["sample"]))
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids is unavailable: on the cpu backend") as info:
        llm.generate(["x"], SamplingParams(max_tokens=4, allowed_token_ids=[5]), use_tqdm=False)
    assert info.value.param == "allowed_token_ids"
    # bad_words need no bitmask: suppression is as old as the contract
    assert generate(llm, SamplingParams(max_tokens=4, bad_words=["x"]), ["x"])[0].token_ids


def test_without_a_tokenizer_bad_words_are_refused(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="bad_words is unavailable: it needs the model's tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, bad_words=["x"]), use_tqdm=False)
