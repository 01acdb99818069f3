"""Tool-call and reasoning parsers on outputs written in each model's format (well formed,
malformed, cut off), whole and streamed: character by character, in random pieces, and split
inside every delimiter. Streamed pieces must join to exactly what the whole output gives."""

from __future__ import annotations

import json
import random

import pytest
from fd_server.parsers import reasoning_parser, tool_parser
from fd_server.parsers.tools import CALL, CALL_END, CALLS, CALLS_END, SEP

F = "```"
DS_CALL = CALL + "function" + SEP + "{name}\n" + F + "json\n{args}\n" + F + CALL_END

# (parser, output, expected content, expected [(name, arguments)]); arguments are the model's text
TOOL_CASES = [
    ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Paris"}')]),
    ("hermes", ('Checking both.\n<tool_call>\n{"name":"a","arguments":{}}\n</tool_call>\n'
                '<tool_call>\n{"name":"b","arguments":{"x":[1,{"y":"}"}]}}\n</tool_call>'),
     "Checking both.\n", [("a", "{}"), ("b", '{"x":[1,{"y":"}"}]}')]),
    ("qwen3", '<tool_call>{"name": "f", "arguments": {"q": "a \\"quoted\\" {brace}"}}</tool_call>',
     None, [("f", '{"q": "a \\"quoted\\" {brace}"}')]),
    ("ernie-x1", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "北京"}}\n</tool_call>\n',
     None, [("get_weather", '{"location": "北京"}')]),
    ("qwen3", "No tools needed: 4.", "No tools needed: 4.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 2}}', None,
     [("a", "{}"), ("b", '{"n": 2}')]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("deepseek_v3", CALLS + DS_CALL.format(name="get_time", args='{"tz": "UTC"}') + CALLS_END, None,
     [("get_time", '{"tz": "UTC"}')]),
    ("deepseek_v3", "Let me look." + CALLS + DS_CALL.format(name="a", args="{}") + "\n"
     + DS_CALL.format(name="b", args='{\n  "k": [1, 2]\n}') + CALLS_END, "Let me look.",
     [("a", "{}"), ("b", '{\n  "k": [1, 2]\n}')]),
]

# malformed or cut off: all of it comes back as content, no calls, no exception
BROKEN = [
    ("qwen3", '<tool_call>\n{"name": "f", "arguments": {"q": "ab'),
    ("qwen3", '<tool_call>\n{invalid}\n</tool_call>'),
    ("qwen3", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("qwen3", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
    ("llama3_json", '{"x": 1}'),
    ("llama3_json", '{"name": "f", "parameters": {"a": '),
    ("deepseek_v3", CALLS + CALL + "function" + SEP + "a\n" + F + 'json\n{"k":'),
    ("deepseek_v3", CALLS + CALL + "function" + SEP),
    ("hermes", "<tool_call>"),
]


def splits(text: str, seed: int) -> list[list[str]]:
    """Ways to cut ``text`` into stream pieces: by character, random sizes, and halves at each
    position inside a delimiter."""
    rng = random.Random(seed)
    ways = [list(text)]
    for _ in range(3):
        pieces, at = [], 0
        while at < len(text):
            n = rng.randint(1, 7)
            pieces.append(text[at:at + n])
            at += n
        ways.append(pieces)
    for tag in ("<tool_call>", "</tool_call>", "<|python_tag|>", CALLS, CALL, SEP, CALL_END, "```", "</think>",
                "<response>", "</response>", "<think>"):
        at = text.find(tag)
        if at >= 0:
            for cut in range(at + 1, at + len(tag)):
                ways.append([text[:cut], text[cut:]])
    return ways


def stream_tools(parser, pieces):
    stream = parser.stream()
    content, calls = "", {}
    for piece in [*pieces, None]:
        text, deltas = stream.finish() if piece is None else stream.feed(piece)
        content += text
        for d in deltas:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert entry["id"] is None and entry["arguments"] == "", "the id and name come first, once"
                entry["id"], entry["name"] = d.id, d.name
            assert entry["id"] is not None, "arguments before the call's name"
            entry["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("name, output, content, expected", TOOL_CASES)
def test_tool_calls_whole_and_streamed(name, output, content, expected):
    parser = tool_parser(name)
    got_content, calls = parser.parse(output)
    assert got_content == content
    assert [(c.name, c.arguments) for c in calls] == expected
    for c in calls:
        json.loads(c.arguments)
        assert c.to_openai()["id"].startswith("chatcmpl-tool-")
    for pieces in splits(output, seed=len(output)):
        streamed_content, streamed = stream_tools(parser, pieces)
        assert (streamed_content or None) == content, pieces
        assert [(c["name"], c["arguments"]) for c in streamed] == expected, pieces


@pytest.mark.parametrize("name, output", BROKEN)
def test_malformed_and_truncated_calls_are_content(name, output):
    parser = tool_parser(name)
    assert parser.parse(output) == (output, [])
    for pieces in splits(output, seed=7):
        content, calls = stream_tools(parser, pieces)
        if not calls:  # no name went out before the end showed it broken: all of it is content
            assert content == output


REASONING_CASES = [
    ("qwen3", "<think>\n2+2 is 4.\n</think>\n\nThe answer is 4.", True, "\n2+2 is 4.\n", "\n\nThe answer is 4."),
    ("qwen3", "Hello!", False, None, "Hello!"),
    ("qwen3", "<think>\nLet me consider", True, "\nLet me consider", None),
    ("deepseek_r1", "The user wants X.\n</think>\n\nX is 3.", True, "The user wants X.\n", "\n\nX is 3."),
    ("deepseek_r1", "<think>short</think>ok", True, "short", "ok"),
    ("deepseek_r1", "still thinking", True, "still thinking", None),
    ("ernie_x1", "Greeting is simple.\n</think>\n\n<response>\nHi there!\n</response>\n", True,
     "Greeting is simple.\n", "Hi there!"),
    ("ernie-x1", "Need a tool.\n</think>\n\n<tool_call>\n{\"name\":\"f\",\"arguments\":{}}\n</tool_call>\n", True,
     "Need a tool.\n", "<tool_call>\n{\"name\":\"f\",\"arguments\":{}}\n</tool_call>\n"),
    ("ernie_x1", "Partial thought", True, "Partial thought", None),
    ("ernie_x1", "t\n</think>\n\n<response>\nline one\nline two</response>", True, "t\n", "line one\nline two"),
    ("ernie_x1", "t</think>bare answer", True, "t", "bare answer"),
    ("ernie_x1", "t</think>\n<response>\ncut sh", True, "t", "cut sh"),
]


@pytest.mark.parametrize("name, output, thinking, reasoning, content", REASONING_CASES)
def test_reasoning_whole_and_streamed(name, output, thinking, reasoning, content):
    parser = reasoning_parser(name)
    assert parser.parse(output, thinking) == (reasoning, content)
    for pieces in splits(output, seed=len(output)):
        stream = parser.stream(thinking)
        r, c = "", ""
        for piece in pieces:
            dr, dc = stream.feed(piece)
            r, c = r + dr, c + dc
        dr, dc = stream.finish()
        assert (r + dr or None, c + dc or None) == (reasoning, content), pieces


def test_reasoning_then_tool_calls():
    """ERNIE's thinking output with a call: the tool parser reads the content after the thought."""
    output = ("Need a tool.\n</think>\n\n<tool_call>\n"
              "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>\n")
    _, content = reasoning_parser("ernie_x1").parse(output)
    text, calls = tool_parser("ernie_x1").parse(content)
    assert text is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]


def test_unknown_parsers_name_the_choices():
    with pytest.raises(ValueError, match="deepseek_v3.*hermes.*llama3_json"):
        tool_parser("mistral")
    with pytest.raises(ValueError, match="deepseek_r1, ernie_x1, qwen3"):
        reasoning_parser("granite")


def _walked_end(text: str, start: int) -> int:
    """value_end's answer, character by character (the walk it replaced)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def test_value_end_jumps_to_where_a_walk_ends():
    """Brackets inside strings, escaped quotes and backslashes, texts cut anywhere (a stream's),
    trailing text: the same end as walking every character."""
    from fd_server.parsers.tools import value_end

    rng = random.Random(7)
    pieces = ['{', '}', '[', ']', '"', '\\"', '\\\\', '\\', 'a', ' ', ':', ',', '"}"', '"\\\\"', '"{["']
    values = [json.dumps({"q": 'a "quoted" {brace} \\ back', "n": [1, {"x": "]"}]}), '{"a": "\\\\"}']
    values += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(3000)]
    for value in values:
        for cut in {len(value), rng.randint(0, len(value))}:
            text = "xy" + value[:cut] + " tail"
            assert value_end(text, 2) == _walked_end(text, 2), text
