"""Hypothesis strategies for request bodies biased to the edges: a valid request of either
endpoint with one to three fields replaced by an edge value of any JSON type (huge and negative
integers, NaN and infinities, long lists, odd Unicode, template-looking text), sometimes sent as
broken JSON. Used by the fuzz test of tests/test_hardening_e2e.py."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

EDGE_INTS = [0, 1, -1, 2, 3, 20, 21, 128, 129, 255, 256, 257, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
             2**63 - 1, 2**63, 2**64, -(2**31), -(2**63), -(2**64), 10**30, -(10**30)]
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-308, 1e-6, 1e-5, 0.5, 0.9999999, 1.0, 1.0000001, 2.0, 2.5, 1e10, 1e308,
               -1e308, -1.0, -2.0, float("nan"), float("inf"), float("-inf")]
ODD_TEXT = ["", " ", "\x00", "\ud800", "\udfff", "a\ud83d", "\U0001F600" * 3, "e\u0301", "\u202eevil\u202c",
            "\ufeff", "\uffff", "\u2028\u2029", "<|im_start|>", "<|im_end|>", "</s>", "<s>", "{{ 7 * 7 }}",
            "{% for x in range(10**9) %}{% endfor %}", "%s%n%x", "\\", '"', "a" * 5000, "word " * 3000]

# values each field accepts, at the ends of its range: these reach the engine and run
VALID_EDGES: dict[str, list[Any]] = {
    "n": [1, 2, 16, 128], "temperature": [0.0, 1e-6, 1e-5, 2.0, 1e10, 1e308], "top_p": [5e-324, 1e-6, 1.0],
    "top_k": [-1, 0, 1, 2**31 - 1], "min_p": [0.0, 1e-6, 1.0], "max_tokens": [1, 200, 2**31 - 1],
    "stop": ["a", [" "] * 64, ["\U0001F600", "\x00"], "x" * 1024], "seed": [0, 2**63 - 1],
    "presence_penalty": [-2.0, 2.0], "frequency_penalty": [-2.0, 2.0], "repetition_penalty": [5e-324, 1e-6, 1e10, 1e308],
    "min_tokens": [0, 1, 200, 255], "stop_token_ids": [[0], [2**31 - 1], list(range(1024))],
    "ignore_eos": [True], "logprobs": [0, 5], "top_logprobs": [0, 20], "echo": [True],
    "prompt": [[0], [511] * 200, "\U0001F600" * 20, ["a", "b"] * 8, [[1, 2, 3]] * 16],
    "cache_salt": ["t", "\U0001F600" * 100], "include_stop_str_in_output": [True], "skip_special_tokens": [False],
    "stream": [True], "stream_options": [{"include_usage": True}], "max_completion_tokens": [1, 2**31 - 1],
    "response_format": [{"type": "json_object"}], "guided_regex": ["[0-9]{1,3}", "a+"],
    "guided_choice": [["x", "\U0001F600"]], "structured_outputs": [{"json": {"type": "array", "items": {"enum": [1]}}}],
    "tool_choice": ["required", "none"], "parallel_tool_calls": [False],
    "logit_bias": [{}, {"0": -100, "511": 100}, {str(i): -0.5 for i in range(0, 512, 2)}, {"7": 1e-300}],
}

SAMPLING_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "user", "ignore_eos", "min_tokens", "stop_token_ids",
                   "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "logit_bias", "stream",
                   "stream_options", "model", "response_format", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar", "allowed_token_ids", "bad_words", "add_special_tokens",
                   "use_beam_search", "priority", "truncate_prompt_tokens"]
COMPLETION_FIELDS = ["prompt", "echo", "logprobs", "suffix", "best_of"]
CHAT_FIELDS = ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
               "parallel_tool_calls", "add_generation_prompt", "chat_template_kwargs", "documents", "reasoning_effort",
               "include_reasoning", "functions", "modalities", "echo"]


def _scalar() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(EDGE_INTS), st.integers(), st.sampled_from(EDGE_FLOATS), st.floats(),
        st.sampled_from(ODD_TEXT), st.text(max_size=40), st.booleans(), st.none())


def _value(long: bool = True) -> st.SearchStrategy[Any]:
    """An edge value of any JSON type; with ``long``, sometimes a long list (up to ~15 MB as JSON)."""
    small = st.recursive(_scalar(), lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(ODD_TEXT[:12]) | st.text(max_size=8), inner,
                                                     max_size=3)), max_leaves=8)
    if not long:
        return small
    long_lists = st.one_of(
        st.builds(lambda v, k: [v] * k, st.sampled_from(EDGE_INTS), st.sampled_from([100, 5000, 50_000])),
        st.builds(lambda v, k: [v] * k, st.sampled_from(ODD_TEXT), st.sampled_from([65, 1000])),
        st.builds(lambda k: [[1, 2, 3]] * k, st.sampled_from([2, 64, 300, 5000])))
    return st.one_of(small, long_lists)


def _messages() -> st.SearchStrategy[Any]:
    def message(long: bool) -> st.SearchStrategy[Any]:
        return st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system"]) | st.sampled_from(ODD_TEXT)},
            optional={"content": st.sampled_from(ODD_TEXT) | st.none()
                      | st.just([{"type": "text", "text": "hi"}]) | _value(long),
                      "tool_calls": _value(long), "name": _value(long)})

    # many messages, but not many long ones: 3,000 copies of a message holding 50,000-item lists
    # would be gigabytes of JSON in this process before the server's 32 MiB limit could refuse it
    return st.one_of(st.lists(message(True), min_size=1, max_size=4),
                     st.builds(lambda m, k: [m] * k, message(False), st.sampled_from([200, 3000])))


@st.composite
def request_bodies(draw: st.DrawFn, model: str) -> tuple[str, bytes]:
    """``(path, raw JSON body)``."""
    chat = draw(st.booleans())
    if chat:
        path, fields = "/v1/chat/completions", SAMPLING_FIELDS + CHAT_FIELDS
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
    else:
        path, fields = "/v1/completions", SAMPLING_FIELDS + COMPLETION_FIELDS
        body = {"model": model, "prompt": "hello"}
    body["max_tokens"] = draw(st.sampled_from([1, 4, 16]))
    valid = draw(st.booleans())  # half the bodies stay inside the ranges, to reach the engine
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        if valid and name in VALID_EDGES:
            body[name] = draw(st.sampled_from(VALID_EDGES[name]))
        elif not valid:
            body[name] = draw(_messages() if name == "messages" else _value())
    if valid and body.get("logprobs") is not None and chat:
        body["logprobs"] = True
    text = json.dumps(body)  # escapes lone surrogates as "\ud800", writes NaN / Infinity bare
    if draw(st.integers(0, 19)) == 0:  # now and then not JSON at all
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.sampled_from(["", "}", "\x00", "\\u", "\\ud800", "{" * 10_000,
                                                       '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"]))
    return path, text.encode("utf-8", "surrogatepass")
