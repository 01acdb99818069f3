"""``--speculative-config`` parsing, and the prompt-lookup proposer."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.engine.speculative.config import SpeculativeConfig
from fd_core.engine.speculative.ngram import propose
from fd_core.errors import ConfigError


def test_the_flag_reads_vllms_keys():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 3, 3)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.parse({"model": "/ckpt/draft", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(c) is c


@pytest.mark.parametrize("value, message", [
    ("{nope", r"is not valid JSON"),
    ("[1, 2]", r"must be a JSON object"),
    ({"method": "ngram"}, r"needs 'num_speculative_tokens'"),
    ({"num_speculative_tokens": 2}, r"needs 'method'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, r"method 'eagle' is not one of ngram, draft_model, mtp"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"from 1 to 16, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 17}, r"from 1 to 16, got 17"),
    ({"method": "ngram", "num_speculative_tokens": True}, r"from 1 to 16, got True"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"1 <= prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "max_ngram": 3}, r"unknown key\(s\) 'max_ngram'"),
])
def test_mistakes_name_the_flag(value, message):
    with pytest.raises(ConfigError, match=r"^--speculative-config.*" + message):
        SpeculativeConfig.parse(value)


def test_a_method_the_backend_does_not_declare_is_refused():
    c = SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1})
    c.check_against("cuda", frozenset({"ngram", "mtp"}))
    with pytest.raises(ConfigError, match=r"^--speculative-config: method 'mtp' is not available on the cpu backend "
                                          r"\(it declares: ngram\)"):
        c.check_against("cpu", frozenset({"ngram"}))
    with pytest.raises(ConfigError, match=r"\(it declares: none\)"):
        c.check_against("xpu", frozenset())


def test_prompt_lookup_takes_the_latest_longest_match():
    seq = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3])
    # suffix (2, 3): its latest earlier occurrence is at 6 (then 5, 7, 2); (1, 2, 3) does not end the sequence
    assert propose(seq, 3, 1, 4) == [5, 7, 2]
    assert propose(seq, 10, 1, 4) == [5, 7, 2, 3]  # up to the end
    assert propose(np.array([1, 2, 3, 1, 2]), 2, 1, 4) == [3, 1]  # (1, 2) recurs
    assert propose(np.array([1, 2, 3, 4]), 2, 1, 4) == []  # nothing recurs
    assert propose(np.array([5, 6, 5]), 2, 2, 4) == []  # only a 1-gram recurs, and 2 is the least asked
    assert propose(np.array([5, 6, 5]), 2, 1, 4) == [6, 5]
    assert propose(np.array([7]), 3, 1, 4) == []
    assert propose(np.array([8, 8, 8, 8]), 2, 1, 3) == [8]  # (8, 8, 8) at 0, followed by one 8


def _lookup(tokens, k, n_min, n_max):
    """The rule written plainly: every window of every length, longest first, latest first."""
    tokens = list(tokens)
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n :]
        for start in range(size - 1 - n, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_prompt_lookup_equals_the_plain_rule():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        size = int(rng.integers(1, 60))
        seq = rng.integers(0, int(rng.integers(2, 8)), size=size)  # few distinct tokens: many repeats
        k, low = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 4))
        assert propose(seq, k, low, high) == _lookup(seq, k, low, high), (seq.tolist(), k, low, high)
